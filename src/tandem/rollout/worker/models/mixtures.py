"""Mixture-of-experts families on the Llama skeleton: Qwen3-MoE, Qwen2-MoE and Mixtral.

Each is ``LlamaForCausalLM`` with a ``SparseMoeBlock`` in place of the MLP (in every layer
for Mixtral; for the Qwen families in the layers ``sparse_layer`` picks, a dense MLP in the
others). Qwen2-MoE's block adds a shared expert that every token takes.
Run-time LoRA adapts the attention projections only (the experts are not ``LoraLinear``:
an adapter on them is refused by name). The experts follow the model's linear plan, so
exact log-probs hold for them as for the dense layers (``moe.py``).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from tandem.kernels import KernelOps

from ...parallel.tensor_parallel import TensorParallel
from .llama import ArchitectureSpec, LlamaForCausalLM, LlamaMLP
from .moe import MoeSpec, SparseMoeBlock

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def qwen3_moe_block(config: PretrainedConfig, ops: KernelOps, tp: TensorParallel
                    ) -> SparseMoeBlock:
    """Qwen3-MoE's block: ``num_experts`` of ``moe_intermediate_size``, top-k weights
    renormalised when ``norm_topk_prob``."""
    spec = MoeSpec(config.num_experts, config.num_experts_per_tok,
                   config.moe_intermediate_size, bool(config.norm_topk_prob))
    return SparseMoeBlock(config.hidden_size, spec, ops, tp)


def qwen2_moe_block(config: PretrainedConfig, ops: KernelOps, tp: TensorParallel
                    ) -> SparseMoeBlock:
    """Qwen2-MoE's block: Qwen3-MoE's experts and router, and a shared expert of
    ``shared_expert_intermediate_size`` gated per token."""
    spec = MoeSpec(config.num_experts, config.num_experts_per_tok,
                   config.moe_intermediate_size, bool(config.norm_topk_prob))
    shared = LlamaMLP(config, ops, tp, config.shared_expert_intermediate_size)
    return SparseMoeBlock(config.hidden_size, spec, ops, tp, shared)


def mixtral_block(config: PretrainedConfig, ops: KernelOps, tp: TensorParallel
                  ) -> SparseMoeBlock:
    """Mixtral's block: ``num_local_experts`` of ``intermediate_size``, top-k weights always
    renormalised; checkpoints name it ``block_sparse_moe`` and its projections w1/w3/w2."""
    spec = MoeSpec(config.num_local_experts, config.num_experts_per_tok,
                   config.intermediate_size, True, ("w1", "w3", "w2"), "block_sparse_moe")
    return SparseMoeBlock(config.hidden_size, spec, ops, tp)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE: Qwen3's attention (q/k RMSNorm) and sparse expert blocks."""

    arch = ArchitectureSpec(qk_norm=True, bias_from_config=True, moe=qwen3_moe_block)
    lora_targets = ATTENTION_TARGETS


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    """Qwen2-MoE: Qwen2's attention (q/k/v biases, as its config's ``qkv_bias`` says),
    experts with a shared expert."""

    arch = ArchitectureSpec(qkv_bias=True, moe=qwen2_moe_block)
    lora_targets = ATTENTION_TARGETS


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral: Mistral's attention, and experts in every layer."""

    arch = ArchitectureSpec(moe=mixtral_block)
    lora_targets = ATTENTION_TARGETS
