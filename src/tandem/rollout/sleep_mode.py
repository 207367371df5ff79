"""Sleep mode, in vLLM's terms: ``sleep(1)`` moves the weights to host memory and frees the
KV pool, ``sleep(2)`` discards both (the next update must bring every weight back), and
``release_kv_cache_memory`` frees the KV pool alone (the weights stay: what a colocated
trainer uses between steps). ``wake_up`` restores what was released at the same addresses,
so the decode graphs stay valid (``ModelRunner.graphs_current``). ``LLMEngine`` calls these
under its lock, timing each part in ``SleepWakeSeconds`` (``stats()``'s ``sleep_*`` and
``wake_*`` seconds).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine import LLMEngine

WAKE_TAGS = ("weights", "kv_cache")
STALE_WEIGHTS = ("the weights were discarded by sleep(level=2): push every weight (a full "
                 "update) before generating or merging an adapter, or sleep(level=1) to keep "
                 "them.")


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


WEIGHTS_AT_LEVEL = {0: "resident", 1: "offloaded", 2: "discarded"}


def sleep(engine: LLMEngine, level: int, preempt: bool) -> None:
    """See ``LLMEngine.sleep`` (level 0: ``release_kv_cache_memory``)."""
    if engine.has_unfinished_requests() and not preempt:
        raise ValueError("cannot sleep with unfinished requests: let them finish, abort "
                         "them, or sleep(preempt=True) to recompute them after wake_up.")
    with engine.lock, engine.sleep_wake_seconds.timing("sleep"):  # stats() sleep_*_seconds
        with engine.sleep_wake_seconds.timing("sleep_kv_cache"):
            engine.steps.drain(engine.scheduler)
            engine.scheduler.preempt_all()
            engine.scheduler.release_held_kv()
            engine.runner.free_kv_cache()
            engine.kv_cache_released = True
        with engine.sleep_wake_seconds.timing("sleep_weights"):
            _release_weights(engine, WEIGHTS_AT_LEVEL[level])
        engine.sleep_level = max(engine.sleep_level, level)


def _release_weights(engine: LLMEngine, where: str) -> None:
    """Move the weights to the host or discard them (a deeper sleep than the last only)."""
    if where == "resident" or engine.weights == "discarded" or engine.weights == where:
        return
    if where == "offloaded":
        engine.runner.offload_weights()
    else:  # from device memory (or, after a level 1 sleep, from the host buffer)
        engine.runner.discard_weights()
        engine.weights_stale = True
    engine.weights = where


def wake_up(engine: LLMEngine, tags: Collection[str] | None) -> None:
    """See ``LLMEngine.wake_up``."""
    tags = set(WAKE_TAGS if tags is None else tags)
    if not tags <= set(WAKE_TAGS):
        raise ValueError(f"unknown wake_up tags {sorted(tags - set(WAKE_TAGS))}: use "
                         f"{', '.join(WAKE_TAGS)}.")
    with engine.lock, engine.sleep_wake_seconds.timing("wake"):  # stats() wake_*_seconds
        with engine.sleep_wake_seconds.timing("wake_weights"):
            if "weights" in tags and engine.weights != "resident":
                engine.runner.reload_weights()
                engine.weights = "resident"
        with engine.sleep_wake_seconds.timing("wake_kv_cache"):
            if "kv_cache" in tags and engine.kv_cache_released:
                engine.runner.allocate_kv_cache(engine.num_kv_blocks)
                engine.new_pool()
                engine.kv_cache_released = False
        with engine.sleep_wake_seconds.timing("wake_capture"):
            if not engine.is_sleeping:
                engine.sleep_level = 0
                if not engine.runner.graphs_current():
                    engine.runner.capture_graphs()
