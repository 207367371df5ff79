"""The server's metrics, kept and rendered by ``prometheus_client`` (vLLM's choice).

Names follow vLLM's ``vllm:`` metrics under a ``tandem:`` prefix, so dashboards carry over.
Each server has its own ``CollectorRegistry`` (several servers may share a process, as the
tests' do), never the library's global one.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
SYNC_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# vLLM's request_latency_buckets (its e2e latency and queue time histograms).
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# (stats() key, metric name, family, help) for the engine's counters.
ENGINE_METRICS = (
    ("num_running", "num_requests_running", GaugeMetricFamily,
     "Sequences in the running batch."),
    ("num_waiting", "num_requests_waiting", GaugeMetricFamily,
     "Sequences waiting to be scheduled."),
    ("kv_blocks_total", "kv_cache_blocks", GaugeMetricFamily, "KV blocks in the pool."),
    ("kv_blocks_used", "kv_cache_blocks_used", GaugeMetricFamily,
     "KV blocks held by sequences."),
    ("weight_version", "weight_version", GaugeMetricFamily,
     "Version of the weights being served."),
    ("prefix_cache_queried_tokens", "prefix_cache_queries", CounterMetricFamily,
     "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hit_tokens", "prefix_cache_hits", CounterMetricFamily,
     "Prompt tokens found in the prefix cache."),
    ("cow_copies", "cow_copies", CounterMetricFamily,
     "Copy-on-write copies of shared KV blocks."),
    ("preemptions", "num_preemptions", CounterMetricFamily,
     "Sequences preempted for lack of KV blocks."),
)
LABEL = "model_name"
T = TypeVar("T", Counter, Histogram)


def token_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's 1-2-5 series up to ``max_model_len`` (1, 2, 5, 10, 20, 50, ...): the bounds of
    the per-request token histograms."""
    series = (mantissa * 10**exponent for exponent in itertools.count()
              for mantissa in (1, 2, 5))
    return tuple(itertools.takewhile(lambda bound: bound <= max_model_len, series))


class EngineCollector:
    """The engine's ``stats()`` as gauges and counters: those given to the last
    ``ServerMetrics.render``.

    Args:
        model_name: the ``model_name`` label of its samples.
    """

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.engine_stats: Mapping[str, int | float] = {}

    def collect(self) -> Iterator[Metric]:
        """One family per ``ENGINE_METRICS`` row, then the KV-cache use and the prefix-cache
        hit rate derived from them."""
        stats = self.engine_stats
        for key, name, family, help_text in ENGINE_METRICS:
            yield self._family(family, name, help_text, stats[key])
        yield self._family(GaugeMetricFamily, "kv_cache_usage_perc",
                           "Fraction of KV blocks in use (0 to 1).",
                           stats["kv_blocks_used"] / max(stats["kv_blocks_total"], 1))
        queried = stats["prefix_cache_queried_tokens"]
        yield self._family(
            GaugeMetricFamily, "prefix_cache_hit_rate",
            "Prefix-cache hits over queried prompt tokens since start (0 before any).",
            stats["prefix_cache_hit_tokens"] / queried if queried else 0.0)

    def _family(self, family: type[Metric], name: str, help_text: str, value: float) -> Metric:
        metric = family(f"tandem:{name}", help_text, labels=[LABEL])
        metric.add_metric([self.model_name], value)
        return metric


class ServerMetrics:
    """One server's metrics on its own registry: what the server measures itself, and the
    engine's ``stats()`` through an ``EngineCollector``.

    A request here is one prompt with its ``n`` completions; the four request histograms
    observe those that finished (an aborted one counts in ``aborted_requests`` only).

    Args:
        model_name: the ``model_name`` label of every sample.
        max_model_len: the largest bound of the per-request token histograms.
    """

    def __init__(self, model_name: str, max_model_len: int) -> None:
        self.model_name = model_name
        tokens = token_buckets(max_model_len)
        self.registry = CollectorRegistry()
        self.engine_collector = EngineCollector(model_name)
        self.registry.register(self.engine_collector)
        self.generation_tokens = self._add(Counter, "generation_tokens", "Tokens generated.")
        self.aborted_requests = self._add(Counter, "aborted_requests",
                                          "Requests aborted (client gone, /pause).")
        self.time_to_first_token = self._add(
            Histogram, "time_to_first_token_seconds", "Arrival to first generated token.",
            buckets=LATENCY_BUCKETS)
        self.inter_token_latency = self._add(
            Histogram, "inter_token_latency_seconds",
            "Time between a request's successive tokens.", buckets=LATENCY_BUCKETS)
        self.weight_sync_seconds = self._add(
            Histogram, "weight_sync_seconds", "Duration of each weight update received.",
            buckets=SYNC_BUCKETS)
        self.e2e_request_latency = self._add(
            Histogram, "e2e_request_latency_seconds",
            "Arrival to finish of each finished request.", buckets=REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = self._add(
            Histogram, "request_queue_time_seconds",
            "Arrival until the start of the first engine step that scheduled the finished "
            "request (its first prefill chunk, or its group's prompt).",
            buckets=REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = self._add(
            Histogram, "request_prompt_tokens", "Prompt tokens of each finished request.",
            buckets=tokens)
        self.request_generation_tokens = self._add(
            Histogram, "request_generation_tokens",
            "Tokens generated by each finished request (its n completions together).",
            buckets=tokens)

    def request_finished(self, queue_seconds: float, e2e_seconds: float,
                         num_prompt_tokens: int, num_generation_tokens: int) -> None:
        """Observe a finished request in the four request histograms."""
        self.request_queue_time.observe(queue_seconds)
        self.e2e_request_latency.observe(e2e_seconds)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_generation_tokens)

    def render(self, engine_stats: Mapping[str, int | float]) -> bytes:
        """Every metric in Prometheus' text format (``prometheus_client.CONTENT_TYPE_LATEST``),
        the engine's from ``engine_stats`` (its ``stats()``)."""
        self.engine_collector.engine_stats = engine_stats
        return generate_latest(self.registry)

    def _add(self, metric: type[T], name: str, help_text: str, **options: object) -> T:
        """A ``tandem:`` metric on this registry, as its one ``model_name`` child."""
        return metric(f"tandem:{name}", help_text, [LABEL], registry=self.registry,
                      **options).labels(self.model_name)
