"""Llama-family decoders (Llama, Mistral, Qwen2, Qwen3, SmolLM) over the paged KV cache.

Parameters keep Hugging Face's names and shapes (separate q/k/v and gate/up projections), so
a checkpoint loads name for name and a trainer's weights need no mapping; on CPU the
projections that read one input multiply as one packed matrix (``FusedProjections``). Each
architecture is a subclass differing only in its ``ArchitectureSpec``; a variant family (a
different MLP, say) subclasses with its own spec and registers under its name
(``registry.register_model``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from tandem.kernels import AttentionMetadata, KernelOps

from ...parallel.tensor_parallel import (
    COLUMN,
    KV_HEADS,
    ROW,
    VOCAB,
    TensorParallel,
    local_heads,
)
from .base import CausalLM, KVShape
from .layers import FusedProjections, Linear, LoraLinear, RMSNorm, VocabEmbedding
from .moe import SparseMoeBlock
from .rotary import RotaryEmbedding, check_rope_type, rotary_dim

Rope = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # positions, cos table, sin table
# The attention layer types (a config's ``layer_types``) the family runs.
ATTENTION_TYPES = ("full_attention", "sliding_attention")


class LlamaAttention(nn.Module):
    """Self-attention that writes this step's K/V into the pool and reads through it (an
    FP8 pool through its scales ``k_scale``/``v_scale``, which the runner binds); the
    leading ``rotary_dim`` dimensions of each head rotate (all unless the config rotates
    part of each head). ``sliding_window`` (set by the decoder layer from the config,
    ``sliding_window_of``; None: full attention) limits each token to its last positions.
    ``sinks`` (None: none) is each of this rank's query heads' sink logit, joining its
    softmax (GPT-OSS: a subclass sets it to an ``nn.Parameter`` ``[local heads]`` after
    ``__init__``, which sets it None: a class attribute would make torch refuse the
    parameter); ``logit_softcap`` (None: none) soft-caps the scores (a family sets it from
    its config, as Gemma 2's ``attn_logit_softcapping``)."""

    sliding_window: int | None = None
    logit_softcap: float | None = None
    kv_group: int = 0  # its KV group (bound with the pool): whose tables it reads

    def __init__(self, config: PretrainedConfig, arch: ArchitectureSpec, ops: KernelOps,
                 tp: TensorParallel) -> None:
        super().__init__()
        self.ops = ops
        self.tp = tp
        self.num_heads, self.num_kv_heads = local_heads(config, tp.size)
        self.head_dim = head_dim_of(config)
        self.rotary_dim = rotary_dim(config, self.head_dim)
        self.scale = self.head_dim ** -0.5
        config_bias = bool(getattr(config, "attention_bias", False)) and arch.bias_from_config
        # Qwen2-MoE's config says whether q/k/v have biases (``qkv_bias``)
        qkv_bias = getattr(config, "qkv_bias", arch.qkv_bias) or config_bias
        o_bias = arch.o_bias or config_bias
        hidden, q_size = config.hidden_size, self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv = self.input_projections(hidden, q_size, kv_size, qkv_bias)
        self.o_proj = LoraLinear(q_size, hidden, o_bias, ROW)
        if arch.qk_norm:
            self.q_norm = arch.norm(self.head_dim, config.rms_norm_eps, ops)
            self.k_norm = arch.norm(self.head_dim, config.rms_norm_eps, ops)
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        self.sinks: torch.Tensor | None = None

    def input_projections(self, hidden: int, q_size: int, kv_size: int, bias: bool
                          ) -> FusedProjections:
        """The q, k and v projections (this rank's ``q_size`` and ``kv_size`` rows), as
        the group the forward pass reads them through: here three layers."""
        self.q_proj = LoraLinear(hidden, q_size, bias, COLUMN)
        self.k_proj = LoraLinear(hidden, kv_size, bias, KV_HEADS)
        self.v_proj = LoraLinear(hidden, kv_size, bias, KV_HEADS)
        return FusedProjections(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, rope: Rope, hidden: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """Attend each token of ``hidden`` ``[tokens, hidden]`` to its sequence's context."""
        q, k, v = self.qkv(hidden)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        rotated = self.rotary_dim
        self.ops.rotary_embedding(rope[0], q[..., :rotated], k[..., :rotated], rope[1], rope[2])
        scales = self.k_scale, self.v_scale
        window = self.sliding_window
        if self.ops.causal_attention is not None:  # a trainer's forward: no pool
            out = self.ops.causal_attention(q, k, v, metadata, self.scale, *scales,
                                            sliding_window=window, sinks=self.sinks,
                                            softcap=self.logit_softcap)
        else:
            metadata = metadata.of_group(self.kv_group)
            self.ops.store_kv(k, v, self.k_cache, self.v_cache, metadata.slot_mapping, *scales)
            out = self.ops.paged_attention(q, self.k_cache, self.v_cache, metadata, self.scale,
                                           *scales, sliding_window=window, sinks=self.sinks,
                                           softcap=self.logit_softcap)
        return self.tp.all_reduce(self.o_proj(out.flatten(1)))


class LlamaMLP(nn.Module):
    """SiLU-gated feed-forward block (of the config's ``intermediate_size`` unless given:
    a shared expert's)."""

    def __init__(self, config: PretrainedConfig, ops: KernelOps, tp: TensorParallel,
                 intermediate_size: int | None = None) -> None:
        super().__init__()
        self.ops = ops
        self.tp = tp
        hidden = config.hidden_size
        intermediate = (intermediate_size or config.intermediate_size) // tp.size
        self.gate_up = self.input_projections(hidden, intermediate)
        self.down_proj = LoraLinear(intermediate, hidden, False, ROW)

    def input_projections(self, hidden: int, intermediate: int) -> FusedProjections:
        """The gate and up projections (this rank's ``intermediate`` rows each), as the
        group the forward pass reads them through: here two layers."""
        self.gate_proj = LoraLinear(hidden, intermediate, False, COLUMN)
        self.up_proj = LoraLinear(hidden, intermediate, False, COLUMN)
        return FusedProjections(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(x)) * up(x))."""
        return self.tp.all_reduce(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output (its slice of the intermediate dimension), before
        the ranks' all-reduce."""
        return self.down_proj(self.ops.silu_and_mul(*self.gate_up(x)))


@dataclass(frozen=True, slots=True)
class ArchitectureSpec:
    """What distinguishes one Llama-family architecture from another."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    bias_from_config: bool = False
    # built as mlp(config, ops, tp); it exposes ``gate_up`` (its input projections, a
    # ``FusedProjections``) and ``down_proj``
    mlp: type[nn.Module] = LlamaMLP
    # a mixture of experts' block (``moe.SparseMoeBlock``), built as moe(config, ops, tp)
    # in the layers ``sparse_layer`` picks; None: a dense model
    moe: Callable[..., nn.Module] | None = None
    # built as attention(config, arch, ops, tp); it exposes ``qkv`` (giving q, k and v) and
    # ``o_proj``
    attention: type[nn.Module] = LlamaAttention
    # every layer norm (q/k norms included), built as norm(size, eps, ops): Gemma's scales
    # by 1 + weight
    norm: type[RMSNorm] = RMSNorm


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each with a residual connection.

    The residual add is fused into the next norm (vLLM's layout): a layer takes and returns
    the MLP output and the residual stream separately.
    """

    def __init__(self, config: PretrainedConfig, arch: ArchitectureSpec, ops: KernelOps,
                 tp: TensorParallel, index: int) -> None:
        super().__init__()
        self.self_attn = arch.attention(config, arch, ops, tp)
        self.self_attn.sliding_window = sliding_window_of(config, index)
        sparse = arch.moe is not None and sparse_layer(config, index)
        self.mlp = arch.moe(config, ops, tp) if sparse else arch.mlp(config, ops, tp)
        self.input_layernorm = arch.norm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = arch.norm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, rope: Rope, hidden: torch.Tensor, residual: torch.Tensor | None,
                metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """One transformer block; ``residual`` is None for the first layer."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(rope, hidden, metadata)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm."""

    def __init__(self, config: PretrainedConfig, arch: ArchitectureSpec, max_position: int,
                 device: torch.device, ops: KernelOps, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config, tp)
        self.rotary_emb = RotaryEmbedding(config, head_dim_of(config), max_position, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, arch, ops, tp, index)
            for index in range(config.num_hidden_layers))
        self.norm = arch.norm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """Final hidden states ``[tokens, hidden]`` of the flat token stream."""
        hidden = self.embed_tokens(input_ids)
        rope = (positions, self.rotary_emb.cos, self.rotary_emb.sin)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual, metadata)
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(CausalLM):
    """A Llama-family causal LM; ``lm_head`` shares the embedding when the config ties them
    (under tensor parallelism both hold this rank's rows of the vocabulary)."""

    arch: ClassVar[ArchitectureSpec] = ArchitectureSpec(bias_from_config=True)
    # the embedding, decoder layers and final norm, built as backbone(config, arch,
    # max_position, device, ops, tp), with ``embed_tokens``, ``layers`` and ``rotary_emb``
    backbone: ClassVar[type[nn.Module]] = LlamaModel
    lora_targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                    "down_proj")

    def __init__(self, config: PretrainedConfig, max_position: int, device: torch.device,
                 ops: KernelOps, tp: TensorParallel) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = self.backbone(config, self.arch, max_position, device, ops, tp)
        self.rotary_emb = self.model.rotary_emb
        _, start, stop = self.model.embed_tokens.vocab_rows
        self.lm_head = Linear(config.hidden_size, stop - start, False, VOCAB)
        self.tie_weights()

    @classmethod
    def check_config(cls, config: PretrainedConfig) -> None:
        """Refuse a rope type, an MLP activation or an attention layer type this family does
        not implement, and a sliding window under 1."""
        check_rope_type(config, head_dim_of(config))
        for index in range(config.num_hidden_layers):
            sliding_window_of(config, index)
        if issubclass(cls.arch.mlp, LlamaMLP) and config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only "
                             "'silu').")

    @classmethod
    def layer_windows(cls, config: PretrainedConfig) -> list[int | None]:
        """Each layer's ``sliding_window_of``."""
        return [sliding_window_of(config, index) for index in range(config.num_hidden_layers)]

    @classmethod
    def kv_shape(cls, config: PretrainedConfig, tp_size: int) -> KVShape:
        """Every layer's KV heads of this rank (see ``local_heads``), of ``head_dim_of``."""
        return KVShape(config.num_hidden_layers, *local_heads(config, tp_size),
                       head_dim_of(config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """Final hidden states of every token in the step."""
        return self.model(input_ids, positions, metadata)

    def input_embedding(self) -> VocabEmbedding:
        """The token embedding."""
        return self.model.embed_tokens

    def decoder_layers(self) -> list[nn.Module]:
        """The decoder layers, in order."""
        return list(self.model.layers)

    def attention_layers(self) -> list[nn.Module]:
        """The attention modules, in layer order, for binding the KV pool."""
        return [layer.self_attn for layer in self.model.layers]

    def linear_groups(self, layer: nn.Module) -> list[Linear | FusedProjections]:
        """q/k/v, o, and the MLP's input projections (its ``gate_up``) and ``down_proj``, or
        a mixture of experts' (``SparseMoeBlock.linear_groups``)."""
        attention, mlp = layer.self_attn, layer.mlp
        if isinstance(mlp, SparseMoeBlock):
            return [attention.qkv, attention.o_proj, *mlp.linear_groups()]
        return [attention.qkv, attention.o_proj, mlp.gate_up, mlp.down_proj]


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama's layout, no biases."""

    arch = ArchitectureSpec()


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: biases on q/k/v."""

    arch = ArchitectureSpec(qkv_bias=True)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: RMSNorm on each query and key head."""

    arch = ArchitectureSpec(qk_norm=True, bias_from_config=True)


def sparse_layer(config: PretrainedConfig, index: int) -> bool:
    """Whether layer ``index`` of a mixture of experts holds experts (Qwen-MoE's
    ``mlp_only_layers`` and ``decoder_sparse_step``; every layer where the config has
    neither)."""
    return index not in (getattr(config, "mlp_only_layers", None) or []) and \
        (index + 1) % (getattr(config, "decoder_sparse_step", None) or 1) == 0


def sliding_window_of(config: PretrainedConfig, index: int) -> int | None:
    """Layer ``index``'s sliding window W, as transformers applies it: a token attends to its
    last W positions, its own included; None for full attention. Where the config lists
    ``layer_types`` (Qwen2, Qwen3, Qwen2-MoE; transformers derives them from
    ``use_sliding_window`` and ``max_window_layers``), its ``sliding_window`` for a
    ``"sliding_attention"`` layer; else its ``sliding_window`` for every layer (Mistral,
    Mixtral, Phi-3, Qwen3-MoE), None where it has none.

    Raises:
        ValueError: for a layer type other than ``ATTENTION_TYPES``, or a window under 1.
    """
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        layer_type = layer_types[index]
        if layer_type not in ATTENTION_TYPES:
            raise ValueError(f"layer_types[{index}] is {layer_type!r}, which Tandem does not "
                             f"implement: it runs {', '.join(map(repr, ATTENTION_TYPES))}.")
        if layer_type == "full_attention":
            window = None
    if window is not None and window < 1:
        raise ValueError(f"sliding_window={window} (layer {index}) is invalid: a layer "
                         "attends to at least its own position, so the window must be at "
                         "least 1.")
    return window


def head_dim_of(config: PretrainedConfig) -> int:
    """The attention head size (explicit in the config or hidden_size / num_heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
