"""The server's /metrics as prometheus_client's parser reads it: each metric's type, the
request histograms and token counter against the requests made, and two servers in one
process keeping their own values."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .test_server import ENGINE_OPTIONS, MODEL, collect, openai_client, running_server

GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_blocks",
          "kv_cache_blocks_used", "kv_cache_usage_perc", "prefix_cache_hit_rate",
          "weight_version")
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "cow_copies", "num_preemptions",
            "generation_tokens", "aborted_requests")
HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds",
              "weight_sync_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_prompt_tokens",
              "request_generation_tokens")
# One token, a 1-2-5 bucket bound, a KV block plus one.
PROMPTS = [[7], [5, 9, 33, 70, 2], list(range(3, 20))]
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def servers(llama_dir) -> Iterator[tuple[str, str]]:
    """Two servers in this process (the second with half the KV blocks); their addresses."""
    with running_server(llama_dir) as (first, _), \
            running_server(llama_dir, ENGINE_OPTIONS | {"num_kv_blocks": 128}) as (second, _):
        yield first, second


def scrape(url: str) -> dict[str, dict[str, float]]:
    """Per family (name without ``tandem:``), its samples by name suffix (``""``, ``_total``,
    ``_sum``, ``_count``, ``_bucket:LE``); each must carry the served model's label."""
    families: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        samples = families.setdefault(family.name.removeprefix("tandem:"), {})
        for sample in family.samples:
            assert sample.labels["model_name"] == MODEL
            bound = f":{sample.labels['le']}" if "le" in sample.labels else ""
            samples[sample.name.removeprefix(family.name) + bound] = sample.value
    return families


def families_by_type(url: str) -> dict[str, str]:
    """Each family's name and type, leaving out prometheus_client's ``_created`` gauges."""
    text = httpx.get(f"{url}/metrics").text
    return {family.name: family.type for family in text_string_to_metric_families(text)
            if not family.name.endswith("_created")}


def change(before: dict, after: dict, family: str, sample: str) -> float:
    return after[family][sample] - before[family][sample]


def test_each_metric_has_its_prometheus_type(servers):
    expected = {f"tandem:{name}": kind for names, kind in (
        (GAUGES, "gauge"), (COUNTERS, "counter"), (HISTOGRAMS, "histogram")) for name in names}
    assert families_by_type(servers[0]) == expected


def test_request_histograms_observe_each_finished_request_and_its_tokens(servers):
    url = servers[0]
    client = openai_client(url)
    before = scrape(url)
    whole = client.completions.create(model=MODEL, prompt=PROMPTS, n=2, max_tokens=MAX_TOKENS,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
    streamed = collect(client.completions.create(
        model=MODEL, prompt=[11], max_tokens=1, stream=True,
        extra_body={"return_token_ids": True}), lambda choice: choice.text)
    after = scrape(url)
    prompt_tokens = [len(prompt) for prompt in PROMPTS] + [1]
    generated = [0] * len(PROMPTS)  # per request: its two completions together
    for choice in whole.choices:
        generated[choice.index // 2] += len(choice.model_extra["token_ids"])
    generated.append(len(streamed[0]["token_ids"]))
    assert change(before, after, "generation_tokens", "_total") == sum(generated)
    for name in ("e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens",
                 "time_to_first_token_seconds"):
        assert change(before, after, name, "_count") == len(prompt_tokens), name
    assert change(before, after, "request_prompt_tokens", "_sum") == sum(prompt_tokens)
    assert change(before, after, "request_generation_tokens", "_sum") == sum(generated)
    for name, observed in (("request_prompt_tokens", prompt_tokens),
                           ("request_generation_tokens", generated)):
        for bound in (1, 2, 5, 10, 20, 200):
            assert change(before, after, name, f"_bucket:{float(bound)}") == sum(
                value <= bound for value in observed), (name, bound)
    # A step adds at most one token to each completion, and all n complete together.
    assert len(PROMPTS) * (MAX_TOKENS - 1) <= change(
        before, after, "inter_token_latency_seconds", "_count") <= sum(generated) - len(generated)
    queue, first_token, e2e = (change(before, after, name, "_sum") for name in (
        "request_queue_time_seconds", "time_to_first_token_seconds",
        "e2e_request_latency_seconds"))
    assert 0 <= queue <= first_token <= e2e


def test_two_servers_in_one_process_keep_their_own_metrics(servers):
    first, second = servers
    openai_client(first).completions.create(model=MODEL, prompt="The quick brown fox",
                                            max_tokens=3, extra_body={"ignore_eos": True})
    ours, theirs = scrape(first), scrape(second)
    assert ours["generation_tokens"]["_total"] >= 3
    assert ours["e2e_request_latency_seconds"]["_count"] >= 1
    assert theirs["generation_tokens"]["_total"] == 0
    assert theirs["e2e_request_latency_seconds"]["_count"] == 0
    assert (ours["kv_cache_blocks"][""], theirs["kv_cache_blocks"][""]) == (256, 128)
