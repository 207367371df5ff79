"""Tensor parallelism: one model over ``size`` ranks, each holding a slice of every projection.

Megatron's layout, as vLLM's: q/k/v and gate/up are split by output (column-parallel: each
rank computes its attention heads and its share of the MLP), o and down by input
(row-parallel: each rank's partial sums are added by one all-reduce). The KV pool is split by
KV head, so each rank stores only its heads; with fewer KV heads than ranks each head is
replicated on ``size / num_kv_heads`` ranks. The LM head is split by vocabulary and its
logits gathered on rank 0 (the driver), which samples; the embedding is split the same way
(each rank looks up the tokens in its rows, one all-reduce adds them). Norms are replicated.

Each engine has two groups: a gloo group for what lives in host memory (the driver's
messages, the commit's vote) and a device group for the model's tensors (the all-reduces and
gathers): NCCL on CUDA, where rank ``r`` runs on the device ``r`` places after the driver's
and the decode graphs capture the all-reduces; a second gloo group on CPU.

Each layer declares its split (one of ``SPLITS``, in the model's weight spec);
``shard_range`` says which slice of a full (Hugging Face shaped) tensor of that split a rank
holds. The loader and weight updates cut full tensors with it, so names and full shapes stay
Hugging Face's on the wire.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from transformers import PretrainedConfig

COLUMN = "column"  # by output rows, evenly
KV_HEADS = "kv_heads"  # by output rows in whole KV heads, replicated when fewer than ranks
ROW = "row"  # by input columns; the partial sums are all-reduced
ROW_BIAS = "row_bias"  # a row-parallel layer's bias: whole, added on rank 0 only
VOCAB = "vocab"  # by vocabulary rows, the last rank's padded
# by the last dimension, evenly: the outputs of experts stored [E, in, out] (GPT-OSS's, as
# transformers holds them) and their biases [E, out]
EXPERT_OUT = "expert_out"
SPLITS = (COLUMN, KV_HEADS, ROW, ROW_BIAS, VOCAB, EXPERT_OUT)


@dataclass(slots=True)
class TensorParallel:
    """This rank's place in a tensor-parallel group (``size`` 1: no parallelism).

    ``group`` is a gloo group of the ranks of one engine (host tensors) and
    ``device_group`` its group for the model's tensors (NCCL on CUDA): the engine's own,
    independent of any default process group the process belongs to (a trainer's), or with
    ``spmd`` subgroups of that world, in which every rank runs the whole engine in step.
    """

    rank: int = 0
    size: int = 1
    group: Any = None
    device_group: Any = None
    spmd: bool = False

    @property
    def is_driver(self) -> bool:
        """True on rank 0, which schedules and samples."""
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the ranks, in place (itself when ``size`` is 1)."""
        if self.size > 1:
            self.device_group.allreduce([tensor]).wait()
        return tensor

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """The driver's ``tensor`` on every rank, over the device group (device to device on
        CUDA: no rank's host waits for it), into ``tensor`` (of its shape and dtype)."""
        if self.size > 1:
            options = dist.BroadcastOptions()
            options.rootRank = 0
            self.device_group.broadcast([tensor], options).wait()
        return tensor

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """The full ``[rows, vocab_size]`` logits on the driver from each rank's vocabulary
        slice ``[rows, ceil(vocab_size / size)]`` (padded); None on the other ranks, but
        with ``spmd`` on every rank (each samples the same tokens)."""
        if self.size == 1:
            return logits
        parts = self.gather(logits)
        return None if parts is None else torch.cat(parts, dim=-1)[:, :vocab_size]

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``tensor`` (all of one shape), in rank order, on the driver (None
        on the other ranks), or with ``spmd`` on every rank."""
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        if self.spmd:
            self.device_group.allgather([parts], [tensor]).wait()
            return parts
        options = dist.GatherOptions()
        options.rootRank = 0
        self.device_group.gather([parts] if self.is_driver else [], [tensor], options).wait()
        return parts if self.is_driver else None

    def fewest(self, value: int) -> int:
        """The smallest of every rank's ``value``, known to every rank."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.group.allreduce([tensor], options).wait()
        return int(tensor.item())

    def refusals(self, ok: bool) -> list[int]:
        """The ranks that did not say ``ok``, known to every rank (a commit's one vote)."""
        if self.size == 1:
            return [] if ok else [0]
        flags = [torch.zeros(1, dtype=torch.int32) for _ in range(self.size)]
        self.group.allgather([flags], [torch.tensor([0 if ok else 1], dtype=torch.int32)]).wait()
        return [rank for rank, flag in enumerate(flags) if flag.item()]


def device_group(store: dist.Store, rank: int, size: int, timeout: timedelta,
                 device: torch.device) -> Any:
    """The group of an engine's model tensors over ``store`` (the one its gloo group uses):
    NCCL on CUDA, gloo on CPU."""
    store = dist.PrefixStore("device/", store)
    if device.type == "cuda":
        return dist.ProcessGroupNCCL(store, rank, size, timeout)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of rank ``rank`` of an engine whose driver runs on ``device``: the CPU, or
    the CUDA device ``rank`` places after the driver's."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def spmd_group(size: int, device: torch.device) -> TensorParallel:
    """This process's rank of an engine over ``size`` consecutive ranks of the initialised
    torch.distributed world (gloo subgroups, and NCCL ones for the model's tensors on CUDA;
    every rank must call it, in step).

    Raises:
        ValueError: without a world, or when ``size`` does not divide it.
    """
    if not dist.is_initialized():
        raise ValueError("distributed_executor_backend='external_launcher' runs in an "
                         "initialised torch.distributed world (torchrun): start one, or use "
                         "'mp'.")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the world of {world} "
                         "ranks: use a divisor of it.")
    backends = ("gloo", "nccl" if device.type == "cuda" else "gloo")
    groups = [[dist.new_group(list(range(first, first + size)), backend=backend)
               for backend in backends] for first in range(0, world, size)]
    host, tensors = groups[rank // size]
    return TensorParallel(rank % size, size, host, tensors, spmd=True)


def local_heads(config: PretrainedConfig, size: int) -> tuple[int, int]:
    """``(attention heads, KV heads)`` one rank holds."""
    return config.num_attention_heads // size, max(1, config.num_key_value_heads // size)


def vocab_per_rank(vocab_size: int, size: int) -> int:
    """Rows of the LM head each rank holds (the last rank's slice padded to it)."""
    return math.ceil(vocab_size / size)


def split_dim(split: str | None, ndim: int) -> int | None:
    """The dimension along which a tensor of ``split`` (of ``ndim`` dimensions) is cut over
    the ranks, or None for a tensor every rank holds whole (norms, a row-parallel bias: only
    rank 0 adds it, see ``holds_bias``)."""
    return {COLUMN: 0, KV_HEADS: 0, VOCAB: 0, ROW: 1, EXPERT_OUT: ndim - 1}.get(split)


def shard_range(split: str | None, shape: tuple[int, ...], config: PretrainedConfig,
                tp: TensorParallel) -> tuple[int, int, int] | None:
    """``(dim, start, stop)`` of a full tensor of ``split`` (and ``shape``) that rank
    ``tp.rank`` holds, or None for a tensor every rank holds whole (see ``split_dim``)."""
    dim = split_dim(split, len(shape))
    if tp.size == 1 or dim is None:
        return None
    if split == VOCAB:
        rows = vocab_per_rank(shape[0], tp.size)
        return 0, min(shape[0], tp.rank * rows), min(shape[0], (tp.rank + 1) * rows)
    if split == KV_HEADS:
        heads = config.num_key_value_heads
        head_dim = shape[0] // heads
        first = tp.rank * heads // tp.size  # with fewer heads than ranks, shared by several
        count = local_heads(config, tp.size)[1]
        return 0, first * head_dim, (first + count) * head_dim
    part = shape[dim] // tp.size
    return dim, tp.rank * part, (tp.rank + 1) * part


def full_from_slices(split: str | None, parts: list[torch.Tensor], config: PretrainedConfig,
                     tp: TensorParallel) -> torch.Tensor:
    """The full tensor of ``split`` from every rank's slice (``parts``, in rank order):
    concatenated where split, each replicated KV head taken once."""
    dim = split_dim(split, parts[0].dim())
    if dim is None:
        return parts[0]
    heads = config.num_key_value_heads
    if split == KV_HEADS and heads < tp.size:
        parts = parts[::tp.size // heads]
    return torch.cat(parts, dim=dim)


def holds_bias(split: str | None, tp: TensorParallel) -> bool:
    """False for a row-parallel bias on ranks other than 0: the all-reduce would add it
    ``size`` times."""
    return tp.is_driver or split != ROW_BIAS


def full_shape(split: str | None, shape: tuple[int, ...], config: PretrainedConfig,
               tp: TensorParallel) -> tuple[int, ...]:
    """The full (Hugging Face) shape of a tensor of ``split`` of which a rank holds
    ``shape``."""
    dim = split_dim(split, len(shape))
    if tp.size == 1 or dim is None:
        return shape
    if split == VOCAB:
        return (config.vocab_size, *shape[1:])
    if split == KV_HEADS:
        head_dim = shape[0] // local_heads(config, tp.size)[1]
        return (config.num_key_value_heads * head_dim, *shape[1:])
    return (*shape[:dim], shape[dim] * tp.size, *shape[dim + 1:])


def local_shape(split: str | None, shape: tuple[int, ...], config: PretrainedConfig,
                tp: TensorParallel) -> tuple[int, ...]:
    """The shape of the part of a full tensor of ``split`` (and ``shape``) this rank holds."""
    spans = shard_range(split, shape, config, tp)
    if spans is None:
        return shape
    dim, start, stop = spans
    return (*shape[:dim], stop - start, *shape[dim + 1:])


def local_slice(split: str | None, full: torch.Tensor, config: PretrainedConfig,
                tp: TensorParallel) -> torch.Tensor:
    """The part of the full tensor of ``split`` this rank holds (a view; zeros for a
    row-parallel bias off rank 0)."""
    if not holds_bias(split, tp):
        return torch.zeros_like(full)
    spans = shard_range(split, tuple(full.shape), config, tp)
    if spans is None:
        return full
    dim, start, stop = spans
    return full.narrow(dim, start, stop - start)


def lora_slice(split: str | None, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float,
               config: PretrainedConfig, tp: TensorParallel
               ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The part of a run-time adapter ``(A [r, in], B [out, r], scale)`` of a weight of
    ``split`` this rank applies: B's rows of a column-parallel layer's outputs, A's columns
    of a row-parallel layer's inputs (the all-reduce then sums the adapter's partial
    terms)."""
    spans = shard_range(split, (lora_b.shape[0], lora_a.shape[1]), config, tp)
    if spans is None:
        return lora_a, lora_b, scale
    dim, start, stop = spans
    if dim == 0:
        return lora_a, lora_b[start:stop], scale
    return lora_a[:, start:stop], lora_b, scale


def check_tensor_parallel(size: int, config: PretrainedConfig, device: torch.device,
                          spmd: bool = False) -> None:
    """Refuse a tensor-parallel size this model or machine cannot run (the kernels are
    checked by ``kernels.check_sharded``).

    Raises:
        ValueError: naming the fix: a size beyond the devices (on CUDA those from the
            driver's on, or with ``spmd`` all of them; on CPU the cores), one that does not
            divide the attention heads, nor the KV heads when it is smaller than them (nor
            is divided by them when larger).
    """
    if size == 1:
        return
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's {heads} "
                         "attention heads: use a divisor of it.")
    if (kv_heads >= size and kv_heads % size) or (kv_heads < size and size % kv_heads):
        raise ValueError(f"tensor_parallel_size={size} and the model's {kv_heads} KV heads: "
                         "one must divide the other (fewer KV heads than ranks are "
                         "replicated); use a size that does.")
    if device.type == "cuda":
        first = 0 if spmd else device.index or 0
        available, where = torch.cuda.device_count() - first, f"CUDA devices from cuda:{first}"
    else:
        available, where = os.cpu_count() or 1, "CPU cores"
    if size > available:
        raise ValueError(f"tensor_parallel_size={size} exceeds the {available} {where}: use at "
                         f"most {available}.")
