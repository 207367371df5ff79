"""GPT-OSS (``GptOssForCausalLM``): Llama's skeleton with attention sinks, alternating
sliding and full attention, YaRN rope, and a mixture of experts in every layer.

- Attention: biases on q, k, v and o (the config's ``attention_bias``), and a learned sink
  logit per query head (``self_attn.sinks``) that joins each row's softmax denominator
  (``LlamaAttention.sinks``, which every attention kernel takes); under tensor parallelism
  each rank holds its query heads' sinks (``"column"``, as q's rows). ``layer_types``
  alternates ``"sliding_attention"`` (the config's ``sliding_window``, 128 in the released
  models) and ``"full_attention"`` (``llama.sliding_window_of``); YaRN's tables are
  transformers' (``rotary.py``).
- Experts (``moe.py``): a router with a bias that takes the top k of its logits and a
  softmax over those k; experts held as transformers holds them (``gate_up_proj`` ``[E, H,
  2I]``, gate and up interleaved, ``down_proj`` ``[E, I, H]``, both with biases), under its
  names, so a checkpoint, a trainer's ``named_parameters()`` and its exact forward bind them
  name for name; the clamped SwiGLU (``moe.ClampedSwiGLU``). A released checkpoint's MXFP4
  experts are dequantized at load (``mxfp4.py``).

Run-time LoRA adapts the attention projections only, as for the other mixtures of experts.
The decoder layer, residuals and norms are Llama's: in bfloat16 transformers' GPT-OSS norm
multiplies by its weight in float32 before rounding once, where Tandem's (Llama's) rounds
the normalised value first, a last-bit difference from transformers in bfloat16 only.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from tandem.kernels import KernelOps

from ...parallel.tensor_parallel import COLUMN, TensorParallel
from .llama import (
    ArchitectureSpec,
    LlamaAttention,
    LlamaForCausalLM,
    head_dim_of,
    sliding_window_of,
)
from .mixtures import ATTENTION_TARGETS
from .moe import ClampedSwiGLU, MoeSpec, SparseMoeBlock
from .rotary import check_rope_type
from .weight_spec import WeightTarget

# What a GPT-OSS config's quantization_config may ask for: MXFP4 experts, which the loader
# dequantizes (``mxfp4.py``).
QUANT_METHODS = ("mxfp4",)


class GptOssAttention(LlamaAttention):
    """Llama's attention with a sink logit per query head (``sinks``, this rank's heads)."""

    def __init__(self, config: PretrainedConfig, arch: ArchitectureSpec, ops: KernelOps,
                 tp: TensorParallel) -> None:
        super().__init__(config, arch, ops, tp)
        self.sinks = nn.Parameter(torch.empty(self.num_heads))

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        """The sinks, split by query head as q's rows are."""
        return {f"{prefix}.sinks": WeightTarget(f"{prefix}.sinks", COLUMN)}


def gpt_oss_block(config: PretrainedConfig, ops: KernelOps, tp: TensorParallel
                  ) -> SparseMoeBlock:
    """GPT-OSS's block: ``num_local_experts`` of ``intermediate_size`` in transformers'
    layout, with biases, the clamped SwiGLU of ``swiglu_alpha`` and ``swiglu_limit``, and a
    router (``router``, with a bias) that softmaxes its top k logits."""
    spec = MoeSpec(config.num_local_experts, config.num_experts_per_tok,
                   config.intermediate_size, renormalize=False, transposed=True,
                   activation=ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit),
                   router="router", router_bias=True, topk_first=True)
    return SparseMoeBlock(config.hidden_size, spec, ops, tp)


class GptOssForCausalLM(LlamaForCausalLM):
    """GPT-OSS: attention with biases and sinks, alternating sliding and full layers, YaRN,
    and experts in every layer (see the module docstring)."""

    arch = ArchitectureSpec(bias_from_config=True, moe=gpt_oss_block,
                            attention=GptOssAttention)
    lora_targets = ATTENTION_TARGETS

    @classmethod
    def check_config(cls, config: PretrainedConfig) -> None:
        """Refuse what the family cannot run, naming the fix: a rope type or attention layer
        type it does not implement, ``layer_types`` not one per layer, a sliding window
        under 1, a top k outside the experts, a swiglu_limit that is not positive, and a
        quantization other than MXFP4. (``hidden_act`` is not read: the experts' activation
        is the clamped SwiGLU whatever it says, as in transformers.)"""
        layer_types = config.layer_types
        if len(layer_types) != config.num_hidden_layers:
            raise ValueError(f"layer_types lists {len(layer_types)} layers, the model has "
                             f"num_hidden_layers={config.num_hidden_layers}: give one type "
                             "per layer.")
        check_rope_type(config, head_dim_of(config))
        for index in range(config.num_hidden_layers):
            sliding_window_of(config, index)
        experts, top_k = config.num_local_experts, config.num_experts_per_tok
        if not 1 <= top_k <= experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and "
                             f"num_local_experts={experts}: lower it to at most {experts}.")
        if not config.swiglu_limit > 0:
            raise ValueError(f"swiglu_limit={config.swiglu_limit} must be positive (the "
                             "clamp of the experts' gate and up): GPT-OSS uses 7.0.")
        _check_quantization(config)


def _check_quantization(config: PretrainedConfig) -> None:
    """Refuse a ``quantization_config`` whose method the loader cannot read."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return
    method = quantization.get("quant_method") if isinstance(quantization, dict) \
        else getattr(quantization, "quant_method", None)
    if method not in QUANT_METHODS:
        raise ValueError(f"quantization_config quant_method {method!r} is not supported for "
                         "GPT-OSS: Tandem loads its MXFP4 experts (dequantized at load) or "
                         "unquantized weights; use the released MXFP4 checkpoint or a "
                         "bfloat16 one.")
