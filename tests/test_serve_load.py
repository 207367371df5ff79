"""The serve load benchmark's checks (benchmarks/serve_load.py) on hand-made answers, and its
reading of the server's own /metrics rendering."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tandem.rollout.serving.metrics import ENGINE_METRICS, ServerMetrics

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
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


def test_the_gauges_are_read_from_the_servers_own_rendering():
    stats = {key: 10 + i for i, (key, *_) in enumerate(ENGINE_METRICS)}
    values = serve_load.parse_metrics(ServerMetrics("tiny").render(stats))
    assert values["tandem:kv_cache_blocks_used"] == stats["kv_blocks_used"]
    assert values["tandem:num_requests_waiting"] == stats["num_waiting"]


def test_rss_growth_starts_after_the_first_fifth_of_a_short_run():
    start = time.monotonic() - 10
    server = serve_load.Server("http://127.0.0.1:1", SimpleNamespace(pid=os.getpid()),
                               [(start + t + 0.5, 1000 + t) for t in range(10)])
    before, after = server.rss_growth(start)
    assert before == 1002 and after == server.rss[-1][1]
