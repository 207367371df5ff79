"""Rollouts of a torchrun trainer whose engines are tensor parallel (SPMD, as verl lays it out).

With ``rollout.engine.tensor_parallel_size = T > 1`` under a world of ``W`` ranks, each run of
``T`` consecutive ranks is one engine (``distributed_executor_backend="external_launcher"``):
every rank of it holds a slice of the model and runs the same requests in step. Such a group
generates the prompts of all its ranks: each rank's examples are gathered within the group
(as JSON), every rank generates them all with the group's one seed (and the group's extra
prompts, for dynamic sampling and partial rollouts), and each trains on its share of the
step's groups, as many as it would have had with an engine of its own. With one rank
(``W == 1``) a TP engine starts its own worker processes instead (``"mp"``) and nothing here
applies.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tandem.rollout.parallel.tensor_parallel import TensorParallel

from .config import TrainConfig
from .data_parallel import DistributedContext
from .tasks import Example


def tensor_parallel_size(config: TrainConfig) -> int:
    """The engine's tensor-parallel size (1 without)."""
    return int(config.rollout.engine.get("tensor_parallel_size", 1))


def is_spmd(config: TrainConfig, context: DistributedContext) -> bool:
    """True when the ranks of this world share tensor-parallel engines."""
    return tensor_parallel_size(config) > 1 and context.world_size > 1


def engine_options(config: TrainConfig, context: DistributedContext) -> dict[str, Any]:
    """The ``LLM`` arguments of this rank's engine: the recipe's, the trainer's dtype and
    device, a seed shared by the ranks of one engine, its batch-invariant kernels as the
    recipe's ``exact_logprobs`` says (off under ``sync_alias``, whose aliased weights they
    cannot follow), its 8-bit weights (``rollout.quantization``), and the SPMD backend when
    they share."""
    exact = False if config.sync_alias or config.exact_logprobs is False \
        else config.exact_logprobs
    options = {"dtype": config.dtype, "seed": config.seed + rollout_rank(config, context),
               "exact_logprobs": exact, "quantization": config.rollout.quantization,
               **config.rollout.engine, "device": str(context.device)}
    if is_spmd(config, context):
        options["distributed_executor_backend"] = "external_launcher"
    return options


def rollout_rank(config: TrainConfig, context: DistributedContext) -> int:
    """Which engine this rank belongs to (its rank when each has its own)."""
    return context.rank // tensor_parallel_size(config) if is_spmd(config, context) \
        else context.rank


def rollout_slot(config: TrainConfig, context: DistributedContext, step: int) -> int:
    """This rank's engine's place among every engine's steps: ``step`` (from 1) times the
    engines, plus its own (shared by the ranks of an SPMD engine, so they agree)."""
    engines = context.world_size // tensor_parallel_size(config) if is_spmd(config, context) \
        else context.world_size
    return (step - 1) * engines + rollout_rank(config, context)


def shared_rollouts(tp: TensorParallel, examples: list[Example],
                    run: Callable[[list[Example], slice | None], Any]) -> Any:
    """``run(examples, keep)`` over the examples of every rank of an SPMD engine (``tp``);
    otherwise over this rank's alone (``keep`` None).

    ``keep`` is this rank's share of the step's groups in key order: as many as it has
    examples, at the place of its examples among the group's. Every rank of the engine
    collects the same groups (the same requests, tokens and scores), so the shares split
    them exactly, dynamic sampling's replacements and partial rollouts' carried groups too.
    """
    if not tp.spmd:
        return run(examples, None)
    group = tp.group
    gathered = _all_gather_json(examples, group)
    rank = dist.get_rank(group)
    offset = sum(len(part) for part in gathered[:rank])
    combined = [example for part in gathered for example in part]
    combined[offset:offset + len(examples)] = examples  # this rank's own objects
    return run(combined, slice(offset, offset + len(examples)))


def _all_gather_json(value: Any, group: Any) -> list[Any]:
    """Every rank's ``value`` (JSON), in rank order."""
    payload = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    size = dist.get_world_size(group)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(lengths, torch.tensor([len(payload)]), group=group)
    longest = int(max(length.item() for length in lengths))
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[:len(payload)] = payload
    parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(size)]
    dist.all_gather(parts, padded, group=group)
    return [json.loads(part[:int(length.item())].numpy().tobytes())
            for part, length in zip(parts, lengths, strict=True)]
