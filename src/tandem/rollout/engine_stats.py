"""The engine's counters, as ``LLMEngine.stats()`` returns them (the server's ``/metrics``
and the trainers' round metrics read them)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine import LLMEngine


@dataclass(slots=True)
class SleepWakeSeconds:
    """Seconds the last ``sleep`` and ``wake_up`` took, whole and by part: vLLM's tags
    (``kv_cache``, ``weights``) and the decode graphs' capture on wake (about 0 when the
    graphs were kept). A part with nothing to do records about 0."""

    sleep: float = 0.0
    sleep_kv_cache: float = 0.0
    sleep_weights: float = 0.0
    wake: float = 0.0
    wake_weights: float = 0.0
    wake_kv_cache: float = 0.0
    wake_capture: float = 0.0

    @contextmanager
    def timing(self, part: str) -> Iterator[None]:
        """Record the seconds the block takes as ``part`` (a field), even if it raises."""
        start = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, part, time.perf_counter() - start)

    def as_stats(self) -> dict[str, float]:
        """The parts as ``stats()`` keys (``<part>_seconds``)."""
        return {f"{part}_seconds": seconds for part, seconds in asdict(self).items()}


def engine_stats(engine: LLMEngine) -> dict[str, int | float]:
    """The engine's counters.

    Memory held (and, when sized from a device share, the plan's parts as ``memory_*``), the
    decode graphs (how many, how often captured, the seconds and device bytes their last
    capture took), the last sleep's and wake-up's seconds by part (``SleepWakeSeconds``), KV pool
    use (``kv_blocks_used_peak``: the most blocks held at once since the engine was last
    idle), queue lengths, weight version, prefix-cache hits, copy-on-write copies,
    preemptions, prefill tokens computed, decode steps and the sequences they decoded (since
    the pool was made) and held sequences.
    """
    block_manager = engine.block_manager
    plan = engine.memory_plan.as_stats() if engine.memory_plan else {}
    return plan | engine.sleep_wake_seconds.as_stats() | {
        "sleep_level": engine.sleep_level,
        "weight_bytes": engine.runner.weight_bytes(),
        "kv_cache_bytes": engine.runner.kv_cache_bytes(),
        "num_decode_graphs": len(engine.runner.graphs.graphs) if engine.runner.graphs else 0,
        "graph_captures": engine.runner.graph_captures,
        "graph_capture_seconds": engine.runner.graph_capture_seconds,
        "graph_bytes": engine.runner.graph_bytes,
        "kv_blocks_total": block_manager.num_blocks,
        "kv_blocks_used": block_manager.num_used_blocks,
        "kv_blocks_used_peak": engine.kv_blocks_used_peak,
        "kv_blocks_cached_free": block_manager.num_cached_free_blocks,
        "num_running": len(engine.scheduler.running),
        "num_waiting": len(engine.scheduler.waiting),
        "weight_version": engine.weight_version,
        "prefix_cache_queried_tokens": block_manager.num_queried_tokens,
        "prefix_cache_hit_tokens": block_manager.num_hit_tokens,
        "cow_copies": block_manager.num_cow_copies,
        "preemptions": engine.scheduler.num_preemptions,
        "prefill_tokens": engine.scheduler.num_prefill_tokens,
        "decode_steps": engine.scheduler.num_decode_steps,
        "decoded_seqs": engine.scheduler.num_decoded_seqs,
        "held_sequences": len(engine.held),
    }
