"""Data-parallel colocation under torchrun: process group, device, policy wrapping, reductions.

torchrun sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; every rank runs its own engine on
its own device (``cuda:LOCAL_RANK``, or the CPU with gloo). Nothing home-made distributes:
the same command scales to several nodes through torchrun's rendezvous.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(slots=True)
class DistributedContext:
    """This process's place in the run."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """True on rank 0, which logs and saves."""
        return self.rank == 0


def init_distributed(device: str | None) -> DistributedContext:
    """Join torchrun's process group when there is one (NCCL on CUDA, gloo on CPU).

    ``device`` (``rollout.engine.device``) forces ``"cpu"`` or ``"cuda"``, by default CUDA
    when available; under torchrun each rank takes ``cuda:LOCAL_RANK`` whatever index it
    names, alone a named index (``"cuda:1"``) is kept.
    """
    use_cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if world_size == 1 and device is not None and torch.device(device).index is not None:
        chosen = torch.device(device)
    else:
        chosen = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)
    return DistributedContext(rank, world_size, chosen)


def shutdown(context: DistributedContext, status: int) -> None:
    """Leave torchrun's process group and, when there was one, end the process with ``status``
    now: at interpreter teardown a C++ thread of the distributed stack, still joinable, aborts
    the process in some exits (seen about one in three on a loaded CPU with gloo), after all
    the work is done; ``os._exit`` skips that teardown. Returns when there is no group."""
    if not dist.is_initialized():
        return
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def wrap_policy(policy: nn.Module, context: DistributedContext, mode: str) -> nn.Module:
    """The policy wrapped for data parallelism: DDP, or FSDP2's ``fully_shard`` in place."""
    if context.world_size == 1:
        return policy
    if mode == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        return fully_shard(policy)
    device_ids = [context.device.index] if context.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(policy, device_ids=device_ids)


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn the all-reduce of gradients on or off (off for all but a step's last micro-batch)."""
    if hasattr(model, "require_backward_grad_sync"):
        model.require_backward_grad_sync = enabled
    elif hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(enabled)


def full_named_parameters(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter as a whole tensor (FSDP2 shards gathered), detached."""
    for name, parameter in module.named_parameters():
        tensor = parameter.detach()
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        yield name, tensor


def all_reduce_metrics(metrics: dict[str, float], context: DistributedContext
                       ) -> dict[str, float]:
    """Metrics reduced over ranks: ``*_min`` by min, ``*_max`` by max, the rest by mean."""
    if context.world_size == 1:
        return metrics
    reduced = {}
    for suffix, op in (("_min", dist.ReduceOp.MIN), ("_max", dist.ReduceOp.MAX), ("", None)):
        keys = sorted(k for k in metrics if k not in reduced and k.endswith(suffix))
        if not keys:
            continue
        values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64,
                              device=context.device)
        dist.all_reduce(values, op=op or dist.ReduceOp.SUM)
        if op is None:
            values /= context.world_size
        reduced.update(zip(keys, values.tolist()))
    return reduced
