"""Sleep mode: the engine frees its KV pool (level 2 also moves its weights to host memory)
while a trainer steps, and restores both at the same addresses, so the decode graphs stay
valid (``ModelRunner.graphs_current``). ``LLMEngine.sleep`` and ``wake_up`` call these
under the engine's lock, timing each part in ``SleepWakeSeconds`` (``stats()``'s
``sleep_*`` and ``wake_*`` seconds).
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


def sleep(engine: LLMEngine, level: int, preempt: bool) -> None:
    """See ``LLMEngine.sleep``."""
    if level not in (1, 2):
        raise ValueError(f"sleep level {level} is invalid: use 1 (free the KV pool) or 2 "
                         "(also move the weights to CPU).")
    if engine.has_unfinished_requests() and not preempt:
        raise ValueError("cannot sleep with unfinished requests: let them finish, abort "
                         "them, or sleep(preempt=True) to recompute them after wake_up.")
    with engine.lock, engine.sleep_wake_seconds.timing("sleep"):  # stats() sleep_*_seconds
        with engine.sleep_wake_seconds.timing("sleep_kv_cache"):
            engine.steps.drain(engine.scheduler)
            engine.scheduler.preempt_all()
            engine.scheduler.release_held_kv()
            engine.runner.free_kv_cache()
        with engine.sleep_wake_seconds.timing("sleep_weights"):
            if level == 2 and not engine.weights_offloaded:
                engine.runner.offload_weights()
                engine.weights_offloaded = True
        engine.sleep_level = level


def wake_up(engine: LLMEngine, tags: Collection[str] | None) -> None:
    """See ``LLMEngine.wake_up``."""
    tags = set(WAKE_TAGS if tags is None else tags)
    if not tags <= set(WAKE_TAGS):
        raise ValueError(f"unknown wake_up tags {sorted(tags - set(WAKE_TAGS))}: use "
                         f"{', '.join(WAKE_TAGS)}.")
    with engine.lock, engine.sleep_wake_seconds.timing("wake"):  # stats() wake_*_seconds
        with engine.sleep_wake_seconds.timing("wake_weights"):
            if "weights" in tags and engine.weights_offloaded:
                engine.runner.reload_weights()
                engine.weights_offloaded = False
        with engine.sleep_wake_seconds.timing("wake_kv_cache"):
            if "kv_cache" in tags and engine.runner.kv_cache_bytes() == 0:
                engine.runner.allocate_kv_cache(engine.num_kv_blocks)
                engine.new_pool()
        with engine.sleep_wake_seconds.timing("wake_capture"):
            runner = engine.runner
            if engine.sleep_level and not engine.weights_offloaded and runner.kv_cache_bytes():
                engine.sleep_level = 0
                if not engine.runner.graphs_current():
                    engine.runner.capture_graphs()
