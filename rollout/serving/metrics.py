"""The server's metrics in Prometheus' text exposition format (written here: no dependency).

Names follow vLLM's ``vllm:`` metrics under a ``tandem:`` prefix, so dashboards carry over.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

CONTENT_TYPE = "text/plain; version=0.0.4"  # the server adds "; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
SYNC_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# (stats() key, metric name, type, help) for the engine's counters.
ENGINE_METRICS = (
    ("num_running", "num_requests_running", "gauge", "Sequences in the running batch."),
    ("num_waiting", "num_requests_waiting", "gauge", "Sequences waiting to be scheduled."),
    ("kv_blocks_total", "kv_cache_blocks", "gauge", "KV blocks in the pool."),
    ("kv_blocks_used", "kv_cache_blocks_used", "gauge", "KV blocks held by sequences."),
    ("weight_version", "weight_version", "gauge", "Version of the weights being served."),
    ("prefix_cache_queried_tokens", "prefix_cache_queries", "counter",
     "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hit_tokens", "prefix_cache_hits", "counter",
     "Prompt tokens found in the prefix cache."),
    ("cow_copies", "cow_copies", "counter", "Copy-on-write copies of shared KV blocks."),
    ("preemptions", "num_preemptions", "counter", "Sequences preempted for lack of KV blocks."),
)


@dataclass(slots=True)
class Histogram:
    """Observations counted into cumulative ``le`` buckets, with their sum."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        """Count one observation."""
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    def lines(self, name: str, labels: str) -> list[str]:
        """Its sample lines: a cumulative ``_bucket`` per bound, ``_sum`` and ``_count``."""
        lines, cumulative = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            cumulative += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{name}_bucket{{{labels},le="{le}"}} {cumulative}')
        return lines + [f"{name}_sum{{{labels}}} {self.total!r}",
                        f"{name}_count{{{labels}}} {cumulative}"]


@dataclass(slots=True)
class ServerMetrics:
    """What the server measures itself; ``render`` adds the engine's ``stats()``."""

    model_name: str
    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    inter_token_latency: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    weight_sync_seconds: Histogram = field(default_factory=lambda: Histogram(SYNC_BUCKETS))
    generation_tokens: int = 0
    aborted_requests: int = 0

    def render(self, stats: dict[str, int]) -> str:
        """Every metric in the text exposition format (version 0.0.4)."""
        labels = f'model_name="{_escape(self.model_name)}"'
        out: list[str] = []
        for key, name, kind, help_text in ENGINE_METRICS:
            _family(out, name, kind, help_text, [_sample(name, kind, labels, stats[key])])
        _family(out, "kv_cache_usage_perc", "gauge", "Fraction of KV blocks in use (0 to 1).",
                [f"tandem:kv_cache_usage_perc{{{labels}}} "
                 f"{stats['kv_blocks_used'] / max(stats['kv_blocks_total'], 1)!r}"])
        queried = stats["prefix_cache_queried_tokens"]
        _family(out, "prefix_cache_hit_rate", "gauge",
                "Prefix-cache hits over queried prompt tokens since start (0 before any).",
                [f"tandem:prefix_cache_hit_rate{{{labels}}} "
                 f"{stats['prefix_cache_hit_tokens'] / queried if queried else 0.0!r}"])
        for name, kind, help_text, value in (
                ("generation_tokens", "counter", "Tokens generated.", self.generation_tokens),
                ("aborted_requests", "counter", "Requests aborted (client gone, /pause).",
                 self.aborted_requests)):
            _family(out, name, kind, help_text, [_sample(name, kind, labels, value)])
        for name, help_text, histogram in (
                ("time_to_first_token_seconds", "Arrival to first generated token.",
                 self.time_to_first_token),
                ("inter_token_latency_seconds", "Time between a request's successive tokens.",
                 self.inter_token_latency),
                ("weight_sync_seconds", "Duration of each weight update received.",
                 self.weight_sync_seconds)):
            _family(out, name, "histogram", help_text, histogram.lines(f"tandem:{name}", labels))
        return "\n".join(out) + "\n"


def _family(out: list[str], name: str, kind: str, help_text: str, samples: list[str]) -> None:
    name = _full_name(name, kind)
    out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples]


def _sample(name: str, kind: str, labels: str, value: float) -> str:
    return f"{_full_name(name, kind)}{{{labels}}} {value}"


def _full_name(name: str, kind: str) -> str:
    # The 0.0.4 format types a sample by its exact name, so a counter's family keeps _total.
    return f"tandem:{name}_total" if kind == "counter" else f"tandem:{name}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
