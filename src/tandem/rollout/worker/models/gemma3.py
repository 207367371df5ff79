"""Gemma 3 (``Gemma3ForCausalLM``, the text models: ``gemma3_text``) and Gemma 2
(``Gemma2ForCausalLM``): Llama's projections under Gemma's layer.

What differs from Llama, each as transformers computes it:

- every norm is Gemma's RMSNorm, scaled by ``1 + weight`` in float32 before the one
  rounding to the model dtype (``KernelOps.gemma_rms_norm``); Gemma 3 also norms each query
  and key head (QK-norm);
- each decoder layer is a sandwich: the attention's and the MLP's outputs are normed
  before their residual adds (``post_attention_layernorm``, ``post_feedforward_layernorm``),
  the MLP's input by ``pre_feedforward_layernorm`` (into which the residual add is fused);
- the MLP is GELU-gated (tanh approximation, ``KernelOps.gelu_tanh_and_mul``);
- the embeddings are scaled by sqrt(hidden_size) rounded to the model dtype; attention
  scores by ``query_pre_attn_scalar ** -0.5``; the LM head is the embedding (tied);
- layers alternate sliding and full attention (``layer_types``), and Gemma 3 rotates each
  type with its own rope parameters (theta 1e4 for sliding layers, 1e6 for full ones, which
  may be scaled): one ``RotaryEmbedding`` holds every type's tables;
- Gemma 2 soft-caps the attention scores (``attn_logit_softcapping``, the attention
  kernels' ``softcap``) and the final logits (``final_logit_softcapping``,
  ``CausalLM.soft_cap``), as Gemma 3 does its logits where its config asks.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from tandem.kernels import AttentionMetadata, KernelOps

from ...parallel.tensor_parallel import TensorParallel
from .layers import RMSNorm, VocabEmbedding
from .llama import (
    ArchitectureSpec,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    Rope,
    head_dim_of,
    sliding_window_of,
)
from .rotary import RotaryEmbedding, check_rope_type

# The MLP activations the family runs: the tanh approximation of GELU.
ACTIVATIONS = ("gelu_pytorch_tanh",)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: scaled by ``1 + weight`` (its weights centred on zero), in float32
    before rounding (``layers.gemma_rms_norm``)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise ``x`` (plus ``residual``, returning the sum too; see ``rms_norm``)."""
        return self.ops.gemma_rms_norm(x, self.weight, self.eps, residual)


class GemmaMLP(LlamaMLP):
    """The GELU-gated feed-forward block: ``down(gelu_tanh(gate(x)) * up(x))``."""

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output, before the ranks' all-reduce."""
        return self.down_proj(self.ops.gelu_tanh_and_mul(*self.gate_up(x)))


class Gemma3Attention(LlamaAttention):
    """Llama's attention with scores scaled by ``query_pre_attn_scalar ** -0.5`` (its q/k
    norms Gemma's, ``ArchitectureSpec.norm``). transformers' Gemma 3 does not soft-cap its
    scores, whatever ``attn_logit_softcapping`` says; nor does this."""

    def __init__(self, config: PretrainedConfig, arch: ArchitectureSpec, ops: KernelOps,
                 tp: TensorParallel) -> None:
        super().__init__(config, arch, ops, tp)
        self.scale = config.query_pre_attn_scalar ** -0.5


class Gemma2Attention(Gemma3Attention):
    """Gemma 3's attention without QK-norm, its scores soft-capped at
    ``attn_logit_softcapping`` (None: not capped)."""

    def __init__(self, config: PretrainedConfig, arch: ArchitectureSpec, ops: KernelOps,
                 tp: TensorParallel) -> None:
        super().__init__(config, arch, ops, tp)
        self.logit_softcap = config.attn_logit_softcapping


class GemmaDecoderLayer(LlamaDecoderLayer):
    """Llama's layer with sandwich norms; it rotates by its ``layer_type``'s tables.

    As in Llama's, a layer takes and returns its output and the residual stream apart, the
    add fused into the next norm: transformers' ``residual + post_attention_layernorm(...)``
    is ``pre_feedforward_layernorm``'s, and ``residual + post_feedforward_layernorm(...)``
    the next layer's ``input_layernorm``'s (each the same sum in the model dtype).
    """

    def __init__(self, config: PretrainedConfig, arch: ArchitectureSpec, ops: KernelOps,
                 tp: TensorParallel, index: int) -> None:
        super().__init__(config, arch, ops, tp, index)
        self.layer_type = config.layer_types[index]
        self.pre_feedforward_layernorm = arch.norm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_feedforward_layernorm = arch.norm(config.hidden_size, config.rms_norm_eps,
                                                    ops)

    def forward(self, rope: Rope, hidden: torch.Tensor, residual: torch.Tensor | None,
                metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """One transformer block; ``residual`` is None for the first layer."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(rope, hidden, metadata))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaModel(nn.Module):
    """The embedding (scaled by sqrt(hidden_size)), the decoder layers, each rotating by its
    layer type's tables, and the final norm."""

    def __init__(self, config: PretrainedConfig, arch: ArchitectureSpec, max_position: int,
                 device: torch.device, ops: KernelOps, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config, tp)
        self.embed_scale = config.hidden_size ** 0.5
        self.rotary_emb = RotaryEmbedding(config, head_dim_of(config), max_position, device)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, arch, ops, tp, index)
            for index in range(config.num_hidden_layers))
        self.norm = arch.norm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """Final hidden states ``[tokens, hidden]`` of the flat token stream."""
        hidden = self.embed_tokens(input_ids)
        # transformers multiplies by a float32 tensor of the scale cast to the model dtype
        # (in bfloat16 sqrt(3072) = 55.4256 becomes 55.5)
        hidden = hidden * torch.tensor(self.embed_scale, dtype=torch.float32).to(hidden.dtype)
        ropes = {layer_type: (positions, *self.rotary_emb.tables(layer_type))
                 for layer_type in dict.fromkeys(layer.layer_type for layer in self.layers)}
        residual = None
        for layer in self.layers:
            hidden, residual = layer(ropes[layer.layer_type], hidden, residual, metadata)
        return self.norm(hidden, residual)[0]


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's text model (``gemma3_text``; see the module docstring): QK-norm, a rope per
    layer type, no attention soft-capping."""

    arch = ArchitectureSpec(qk_norm=True, bias_from_config=True, mlp=GemmaMLP,
                            attention=Gemma3Attention, norm=GemmaRMSNorm)
    backbone = GemmaModel

    def __init__(self, config: PretrainedConfig, max_position: int, device: torch.device,
                 ops: KernelOps, tp: TensorParallel) -> None:
        super().__init__(config, max_position, device, ops, tp)
        self.final_logit_softcap = config.final_logit_softcapping

    @classmethod
    def check_config(cls, config: PretrainedConfig) -> None:
        """Refuse bidirectional attention, an MLP activation other than GELU-tanh, a rope
        type (of any layer type) or an attention layer type this family does not implement,
        and a sliding window under 1."""
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention=True (each token attends to the "
                             "text after it too: an encoder's attention) cannot generate "
                             "token by token: set it to False to serve the model as a "
                             "causal LM.")
        if config.hidden_activation not in ACTIVATIONS:
            raise ValueError(f"hidden_activation {config.hidden_activation!r} is not "
                             f"supported (only {', '.join(map(repr, ACTIVATIONS))}, the tanh "
                             "approximation of GELU that Gemma checkpoints use).")
        for index in range(config.num_hidden_layers):
            sliding_window_of(config, index)
        check_rope_type(config, head_dim_of(config))


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    """Gemma 2 (see the module docstring): no QK-norm, one rope for every layer, attention
    scores and final logits soft-capped."""

    arch = ArchitectureSpec(bias_from_config=True, mlp=GemmaMLP, attention=Gemma2Attention,
                            norm=GemmaRMSNorm)
