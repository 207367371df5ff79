"""What in a recipe keeps the trainer's log-probs from being the engine's bit for bit
(``exact_logprobs``; see ``rollout/exact_forward.py``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.rollout.config import DTYPES

if TYPE_CHECKING:
    from .config import TrainConfig


def exact_conflicts(config: TrainConfig) -> list[str]:
    """What in this recipe keeps the trainer's log-probs from being the engine's bit for
    bit (empty: nothing here; the engine must still run its batch-invariant kernels)."""
    engine = config.rollout.engine
    return [name for name, present in [
        ("autocast", config.autocast is not None), ("sync_alias", config.sync_alias),
        ("distributed: fsdp2", config.distributed == "fsdp2"),
        ("rollout.engine.tensor_parallel_size > 1",
         engine.get("tensor_parallel_size", 1) > 1),
        ("an engine dtype other than the trainer's",
         DTYPES.get(engine.get("dtype", config.dtype)) != DTYPES[config.dtype]),
        ("rollout.engine.exact_logprobs: false", engine.get("exact_logprobs") is False),
    ] if present]
