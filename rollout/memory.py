"""The engine's device-memory plan: what its fixed share of the device is spent on.

The share is ``gpu_memory_utilization`` × the device's *total* memory (vLLM's meaning), never
what is free: a colocated trainer's memory must not shrink or grow the engine. Out of the
share come the weights the engine owns, a reserve for staging a full weight update (the
staged protocol holds a second copy until commit), the activation and logits peak of the
largest step, the memory pool of the captured decode graphs, and the KV pool, which gets
the rest.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from transformers import PretrainedConfig

GRAPH_OVERHEAD_BYTES = 4 << 20


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


def activation_bytes(hf_config: PretrainedConfig, max_num_batched_tokens: int,
                     max_num_seqs: int) -> int:
    """A float32 upper estimate of one step's activations plus the sampler's logits."""
    per_token = 4 * hf_config.hidden_size + 3 * hf_config.intermediate_size
    return 4 * (max_num_batched_tokens * per_token + 4 * max_num_seqs * hf_config.vocab_size)


def graph_pool_bytes(hf_config: PretrainedConfig, batch_sizes: list[int]) -> int:
    """An upper estimate of the decode graphs' memory: one shared pool, sized by the largest.

    The pool holds one float32 decode step's activations for the largest batch (the graphs
    replay one at a time), plus ``GRAPH_OVERHEAD_BYTES`` per graph for what CUDA keeps of
    each. Nothing when no graph is captured (``batch_sizes`` empty).
    """
    if not batch_sizes:
        return 0
    per_token = 4 * hf_config.hidden_size + 3 * hf_config.intermediate_size
    return 4 * per_token * batch_sizes[-1] + GRAPH_OVERHEAD_BYTES * len(batch_sizes)


def plan_memory(total_bytes: int, utilization: float, weight_bytes: int,
                activations: int, graphs: int) -> MemoryPlan:
    """Split ``utilization`` × ``total_bytes`` between weights, staging, activations, graphs
    and KV.

    Raises:
        ValueError: when the fixed parts leave nothing for the KV pool, listing each part.
    """
    budget = int(utilization * total_bytes)
    kv_cache = budget - 2 * weight_bytes - activations - graphs
    if kv_cache <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} gives this engine {budget / 2**30:.2f} GiB, "
            f"but its weights take {weight_bytes / 2**30:.2f} GiB, staging a weight update "
            f"{weight_bytes / 2**30:.2f} GiB, activations {activations / 2**30:.2f} GiB and "
            f"decode graphs {graphs / 2**30:.2f} GiB, leaving nothing for the KV pool: raise "
            "gpu_memory_utilization, or lower max_num_batched_tokens or max_num_seqs (or set "
            "enforce_eager=True).")
    return MemoryPlan(budget, weight_bytes, weight_bytes, activations, graphs, kv_cache)
