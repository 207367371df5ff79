"""Phi-3, Phi-3.5 and Phi-4-mini (``Phi3ForCausalLM``): Llama's skeleton with packed
projections and LongRoPE.

Phi-3's checkpoints store q, k and v as one ``qkv_proj`` (``[q; k; v]`` rows) and the MLP's
gate and up as one ``gate_up_proj`` (``[gate; up]``); the engine keeps them packed too, one
``LoraLinear`` of several parts each (vLLM's QKV and merged column-parallel layers). The
weight spec names the parts (``q_proj``, ``k_proj``, ``v_proj``, ``gate_proj``,
``up_proj``), each in its slot of the packed parameter with its own tensor-parallel split,
and each layer takes the checkpoint's packed tensor under its own name as those parts
(``aliases``): so loading, full and partial updates by the trainer's names and tensor
parallelism go through the spec unchanged. The trainer's exact forward binds its packed
tensors to the same packed parameters by name.

LongRoPE and the partial rotary of Phi-4-mini are ``rotary.py``'s: the short or long
factors are chosen once per engine by ``max_model_len`` (see there).

A PEFT adapter on the packed modules (``qkv_proj``, ``gate_up_proj``, as ``lora_targets``
names them for a trainer's transformers model) is split into the parts by ``LoraSync``
(A shared, each part its rows of B, merged as rows of the one packed product, as PEFT
merges); served at run time, the parts' adapters are stacked (``stack_lora``), and the
trainer's exact forward stacks the packed adapter alike, so its log-probs stay the engine's.
"""

from __future__ import annotations

import itertools

import torch
from transformers import PretrainedConfig

from tandem.kernels import KernelOps

from ...parallel.tensor_parallel import COLUMN, KV_HEADS, TensorParallel
from .layers import FusedProjections, LoraLinear
from .llama import ArchitectureSpec, LlamaAttention, LlamaForCausalLM, LlamaMLP, head_dim_of

QKV_PARTS = ("q_proj", "k_proj", "v_proj")
GATE_UP_PARTS = ("gate_proj", "up_proj")


class Phi3Attention(LlamaAttention):
    """Llama's attention over one packed ``qkv_proj``."""

    def __init__(self, config: PretrainedConfig, arch: ArchitectureSpec, ops: KernelOps,
                 tp: TensorParallel) -> None:
        super().__init__(config, arch, ops, tp)
        head_dim = head_dim_of(config)
        kv_rows = config.num_key_value_heads * head_dim
        self.checkpoint_rows = [config.num_attention_heads * head_dim, kv_rows, kv_rows]

    def input_projections(self, hidden: int, q_size: int, kv_size: int, bias: bool
                          ) -> FusedProjections:
        """One ``qkv_proj`` of this rank's q, k and v rows, each part split its own way."""
        self.qkv_proj = LoraLinear(hidden, q_size + 2 * kv_size, bias,
                                   (COLUMN, KV_HEADS, KV_HEADS), QKV_PARTS,
                                   (q_size, kv_size, kv_size))
        return FusedProjections(self.qkv_proj, by_part=True)

    def aliases(self, prefix: str, name: str, tensor: torch.Tensor
                ) -> list[tuple[str, torch.Tensor]] | None:
        """The checkpoint's packed ``qkv_proj`` tensor (full, ``[q; k; v]``) as its parts
        (views); None for another name."""
        return _packed_parts(f"{prefix}.qkv_proj", QKV_PARTS, self.checkpoint_rows, prefix,
                             name, tensor)


class Phi3MLP(LlamaMLP):
    """Llama's SiLU-gated MLP over one packed ``gate_up_proj``."""

    def input_projections(self, hidden: int, intermediate: int) -> FusedProjections:
        """One ``gate_up_proj`` of this rank's gate and up rows, in equal parts."""
        self.gate_up_proj = LoraLinear(hidden, 2 * intermediate, False, COLUMN, GATE_UP_PARTS)
        return FusedProjections(self.gate_up_proj, by_part=True)

    def aliases(self, prefix: str, name: str, tensor: torch.Tensor
                ) -> list[tuple[str, torch.Tensor]] | None:
        """The checkpoint's packed ``gate_up_proj`` tensor (full, ``[gate; up]``) as its
        parts (views); None for another name."""
        half = tensor.shape[0] // 2
        return _packed_parts(f"{prefix}.gate_up_proj", GATE_UP_PARTS, [half, half], prefix,
                             name, tensor)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3: packed q/k/v and gate/up projections, no biases; LongRoPE (its factors chosen
    by ``max_model_len``) and partial rotary where the config asks (``rotary.py``, whose
    ``check_rope_type`` refuses LongRoPE without its original length or with factors that
    do not fit); an activation other than SiLU is refused."""

    arch = ArchitectureSpec(mlp=Phi3MLP, attention=Phi3Attention)
    lora_targets = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _packed_parts(packed: str, parts: tuple[str, ...], rows: list[int], prefix: str,
                  name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """``tensor`` named ``packed`` (its weight or bias) as each part's rows (``rows`` of
    each, the last part the rest: a tensor of the wrong size is refused by the part's shape
    check, naming it) under the part's name beside it in ``prefix``; None for another name."""
    stem, _, kind = name.rpartition(".")
    if stem != packed or kind not in ("weight", "bias"):
        return None
    starts = list(itertools.accumulate(rows[:-1], initial=0))
    return [(f"{prefix}.{part}.{kind}", tensor[start:stop])
            for part, start, stop in zip(parts, starts, [*starts[1:], None], strict=True)]
