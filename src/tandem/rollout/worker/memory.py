"""The KV pool's size, decided in one place: from the options, or from a device share.

``num_kv_blocks`` (option), ``kv_cache_memory_bytes`` (option), 1 GiB on CPU, or, on CUDA,
what the engine's memory plan leaves; a block's bytes count the pool's element size
(``kv_cache_dtype``: one byte for FP8, so the same bytes hold twice bfloat16's blocks). The
plan: what its fixed share of the device is spent on.

The share is ``gpu_memory_utilization`` × the device's *total* memory (vLLM's meaning), never
what is free: a colocated trainer's memory must not shrink or grow the engine. Out of the
share come the weights the engine owns, a reserve for staging a full weight update (the
staged protocol holds a second copy until commit), the activation and logits peak of the
largest step, the memory pool of the captured decode graphs, and the KV pool, which gets
the rest.

A block of the pool is a page of the model's KV groups (``core/kv_groups.py``): one group's
``rows`` layers by ``block_size`` tokens (every layer, for a model without sliding layers
that cut into its contexts). The pool must hold one max_model_len prompt in every group
(a prompt's pages are all allocated on admission) and the null page of the dropped ones.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from transformers import PretrainedConfig

from ..config import EngineConfig
from ..core.block_manager import num_blocks_for
from ..core.kv_groups import KVGroups, kv_groups
from ..core.scheduler import MAX_SCORED_TOKENS
from .models import model_class

GRAPH_OVERHEAD_BYTES = 4 << 20
CPU_KV_CACHE_BYTES = 1 << 30


@dataclass(slots=True)
class MemoryPlan:
    """Bytes of each part of the engine's device-memory share."""

    budget_bytes: int
    weight_bytes: int
    staging_bytes: int
    activation_bytes: int
    graph_bytes: int
    kv_cache_bytes: int

    def as_stats(self) -> dict[str, int]:
        """The plan as ``stats()`` keys (``memory_<part>``)."""
        return {f"memory_{name}": value for name, value in asdict(self).items()}


@dataclass(slots=True)
class KVCacheSize:
    """How many KV blocks the pool has, each how large, the KV groups they are pages of, and
    the plan it came from (CUDA shares only)."""

    num_blocks: int
    block_bytes: int
    groups: KVGroups
    plan: MemoryPlan | None = None


def model_kv_groups(config: PretrainedConfig, max_model_len: int) -> KVGroups:
    """The KV groups of the config's model for contexts up to ``max_model_len``: its
    layers' sliding windows (``CausalLM.layer_windows``) grouped (``kv_groups``)."""
    return kv_groups(model_class(config).layer_windows(config), max_model_len)


def kv_block_bytes(config: PretrainedConfig, block_size: int, dtype: torch.dtype,
                   tensor_parallel_size: int = 1, rows: int | None = None) -> int:
    """Bytes one KV block (a page) takes across its ``rows`` layers (default: all of them;
    K and V) on one rank (which holds its share of the KV heads), its elements of
    ``dtype``, the pool's (one byte for FP8, whose scales live outside the pool)."""
    shape = model_class(config).kv_shape(config, tensor_parallel_size)
    per_token = 2 * shape.num_kv_heads * shape.head_dim * dtype.itemsize
    return per_token * (rows or shape.num_layers) * block_size


def size_kv_cache(config: EngineConfig, hf_config: PretrainedConfig, kv_dtype: torch.dtype,
                  max_model_len: int, weight_bytes: int, graph_sizes: list[int],
                  staging_bytes: int | None = None) -> KVCacheSize:
    """The KV pool for ``config``, of ``kv_dtype`` elements (``WorkerConfig.kv_torch_dtype``):
    set directly, 1 GiB on CPU, or what the device share leaves (each a budget per rank under
    tensor parallelism: every rank holds as many blocks). ``staging_bytes``: what a full
    weight update stages (default ``weight_bytes``; more with 8-bit weights, which an update
    sends in the model's dtype).

    Raises:
        ValueError: when the pool cannot hold one max_model_len sequence (naming the options
            that fix it), or the device share leaves nothing for it (see ``plan_memory``).
    """
    groups = model_kv_groups(hf_config, max_model_len)
    block_bytes = kv_block_bytes(hf_config, config.block_size, kv_dtype,
                                 config.tensor_parallel_size, groups.rows)
    plan = None
    if config.num_kv_blocks is not None:
        num_blocks = config.num_kv_blocks
    elif config.kv_cache_memory_bytes is not None:
        num_blocks = config.kv_cache_memory_bytes // block_bytes
    elif config.torch_device.type == "cpu":
        num_blocks = CPU_KV_CACHE_BYTES // block_bytes
    else:
        plan = plan_memory(
            torch.cuda.get_device_properties(config.torch_device).total_memory,
            config.gpu_memory_utilization or 0.9, weight_bytes,
            activation_bytes(hf_config, config.max_num_batched_tokens, config.max_num_seqs),
            graph_pool_bytes(hf_config, graph_sizes), staging_bytes)
        num_blocks = plan.kv_cache_bytes // block_bytes
    _check_holds_one_sequence(num_blocks, block_bytes, config.block_size, max_model_len,
                              groups)
    return KVCacheSize(num_blocks, block_bytes, groups, plan)


def _check_holds_one_sequence(num_blocks: int, block_bytes: int, block_size: int,
                              max_model_len: int, groups: KVGroups) -> None:
    needed = num_blocks_for(max_model_len, block_size) * groups.num_groups + groups.windowed
    if num_blocks < needed:
        raise ValueError(
            f"the KV pool ({num_blocks} blocks of {block_size} tokens, {block_bytes} bytes "
            f"each) cannot hold one sequence of max_model_len={max_model_len} tokens "
            f"({needed} blocks): raise num_kv_blocks, kv_cache_memory_bytes or "
            "gpu_memory_utilization, or lower max_model_len.")


def activation_bytes_per_token(hf_config: PretrainedConfig) -> int:
    """A float32 upper estimate of one token's activations in a forward pass."""
    return 4 * (4 * hf_config.hidden_size + 3 * hf_config.intermediate_size)


def activation_bytes(hf_config: PretrainedConfig, max_num_batched_tokens: int,
                     max_num_seqs: int) -> int:
    """A float32 upper estimate of one step's activations plus its logits: four float32
    copies of each sampling row's (the sampler's), and three of each prompt position's that
    a step may score for prompt log-probs (``MAX_SCORED_TOKENS``: logits, float32, log-probs)."""
    logits = 4 * (4 * max_num_seqs + 3 * MAX_SCORED_TOKENS) * hf_config.vocab_size
    return max_num_batched_tokens * activation_bytes_per_token(hf_config) + logits


def graph_pool_bytes(hf_config: PretrainedConfig, batch_sizes: list[int]) -> int:
    """An upper estimate of the decode graphs' memory: one shared pool, sized by the largest.

    The pool holds one float32 decode step's activations for the largest batch (the graphs
    replay one at a time), plus ``GRAPH_OVERHEAD_BYTES`` per graph for what CUDA keeps of
    each. Nothing when no graph is captured (``batch_sizes`` empty).
    """
    if not batch_sizes:
        return 0
    activations = activation_bytes_per_token(hf_config) * batch_sizes[-1]
    return activations + GRAPH_OVERHEAD_BYTES * len(batch_sizes)


def plan_memory(total_bytes: int, utilization: float, weight_bytes: int,
                activations: int, graphs: int, staging_bytes: int | None = None) -> MemoryPlan:
    """Split ``utilization`` × ``total_bytes`` between weights, staging (``staging_bytes``,
    default ``weight_bytes``), activations, graphs and KV.

    Raises:
        ValueError: when the fixed parts leave nothing for the KV pool, listing each part.
    """
    budget = int(utilization * total_bytes)
    staging = weight_bytes if staging_bytes is None else staging_bytes
    kv_cache = budget - weight_bytes - staging - activations - graphs
    if kv_cache <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} gives this engine {budget / 2**30:.2f} GiB, "
            f"but its weights take {weight_bytes / 2**30:.2f} GiB, staging a weight update "
            f"{staging / 2**30:.2f} GiB, activations {activations / 2**30:.2f} GiB and "
            f"decode graphs {graphs / 2**30:.2f} GiB, leaving nothing for the KV pool: raise "
            "gpu_memory_utilization, or lower max_num_batched_tokens or max_num_seqs (or set "
            "enforce_eager=True).")
    return MemoryPlan(budget, weight_bytes, staging, activations, graphs, kv_cache)
