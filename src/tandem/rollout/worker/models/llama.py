"""Llama-family decoders (Llama, Mistral, Qwen2, Qwen3, SmolLM) over the paged KV cache.

Parameters keep Hugging Face's names and shapes (separate q/k/v and gate/up projections), so
a checkpoint loads name for name and a trainer's weights need no mapping. On CPU the
weights may be stored column-major, or multiplied through oneDNN copies under which the
projections that read the same input multiply as one matrix (``pack_linear_weights``,
``FusedProjections``). Under tensor parallelism (``tp``) each rank builds its slice of every
projection, of the same names, and adds the row-parallel partial sums with one all-reduce
each (see ``tensor_parallel.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from tandem.kernels import AttentionMetadata, KernelOps, cpu_linear
from tandem.kernels.cpu_build import cache_dir
from tandem.kernels.cpu_linear import PackedWeight
from tandem.kernels.differentiable import panel_linear

from ...parallel.tensor_parallel import TensorParallel, local_heads, shard_range, vocab_per_rank
from .rotary import RotaryEmbedding

Rope = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # positions, cos table, sin table
CALIBRATION_BYTES = 64 << 20  # weights timed to choose the CPU linear layout


@dataclass(frozen=True, slots=True)
class ArchitectureSpec:
    """What distinguishes one Llama-family architecture from another."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    bias_from_config: bool = False


class Linear(nn.Linear):
    """A linear layer that multiplies through a packed copy of its weight when it has one
    (``packed``, set on CPU by ``pack_linear_weights``; see ``kernels/cpu_linear.py``), or
    through a kernel of its own (``LiveLinear``, set by ``multiply_through``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.packed: PackedWeight | LiveLinear | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T + b``."""
        return F.linear(x, self.weight, self.bias) if self.packed is None else self.packed(x)


class LoraLinear(Linear):
    """A linear layer that can add a LoRA adapter at run time: ``x W^T + s (x A^T) B^T``.

    The factors are non-persistent buffers, so they follow the model across devices.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.register_buffer("lora_a", None, persistent=False)
        self.register_buffer("lora_b", None, persistent=False)
        self.lora_scale = 0.0
        self.lora_product: Callable[..., torch.Tensor] = F.linear  # the adapter's matmul

    def set_lora(self, factors: tuple[torch.Tensor, torch.Tensor, float] | None) -> None:
        """Serve ``(A [r, in], B [out, r], scale)`` from now on, or no adapter (None)."""
        if factors is None:
            self.lora_a = self.lora_b = None
            return
        lora_a, lora_b, self.lora_scale = factors
        self.lora_a = lora_a.to(self.weight.device, self.weight.dtype)
        self.lora_b = lora_b.to(self.weight.device, self.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The linear map, plus the adapter's low-rank term when one is set."""
        return self.add_lora(x, super().forward(x))

    def add_lora(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` (this layer's ``x W^T + b``) plus the adapter's term of ``x``, if any."""
        if self.lora_a is None:
            return out
        product = self.lora_product
        return out + product(product(x, self.lora_a), self.lora_b) * self.lora_scale


class LiveLinear:
    """A layer's multiply by ``linear(x, weight, bias)`` with its weight as it is at each
    call (no copy, so an aliased or trainer-bound weight is always current)."""

    __slots__ = ("layer", "linear")

    def __init__(self, layer: nn.Linear, linear: Callable[..., torch.Tensor]) -> None:
        self.layer, self.linear = layer, linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T + b``."""
        return self.linear(x, self.layer.weight, self.layer.bias)


class FusedProjections:
    """Projections that read the same input (q/k/v, gate/up), each keeping its own module,
    Hugging Face name, weight and LoRA adapter. With ``packed`` set (on CPU, by
    ``pack_linear_weights``) they multiply as one packed matrix; else each on its own."""

    __slots__ = ("layers", "sizes", "packed")

    def __init__(self, *layers: LoraLinear) -> None:
        self.layers = layers
        self.sizes = [layer.out_features for layer in layers]
        self.packed: PackedWeight | None = None

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each projection of ``x``, in order."""
        if self.packed is None:
            return [layer(x) for layer in self.layers]
        outs = self.packed(x).split(self.sizes, dim=-1)
        return [layer.add_lora(x, out) for layer, out in zip(self.layers, outs, strict=True)]


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in float32 as transformers does."""

    def __init__(self, hidden_size: int, eps: float, ops: KernelOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise ``x`` (plus ``residual``, returning the sum too; see ``rms_norm``)."""
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class LlamaAttention(nn.Module):
    """Self-attention that writes this step's K/V into the pool and reads through it."""

    def __init__(self, config: PretrainedConfig, spec: ArchitectureSpec, ops: KernelOps,
                 tp: TensorParallel) -> None:
        super().__init__()
        self.ops = ops
        self.tp = tp
        self.num_heads, self.num_kv_heads = local_heads(config, tp.size)
        self.head_dim = head_dim_of(config)
        self.scale = self.head_dim ** -0.5
        config_bias = bool(getattr(config, "attention_bias", False)) and spec.bias_from_config
        qkv_bias, o_bias = spec.qkv_bias or config_bias, spec.o_bias or config_bias
        hidden, q_size = config.hidden_size, self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.q_proj = LoraLinear(hidden, q_size, bias=qkv_bias)
        self.k_proj = LoraLinear(hidden, kv_size, bias=qkv_bias)
        self.v_proj = LoraLinear(hidden, kv_size, bias=qkv_bias)
        self.o_proj = LoraLinear(q_size, hidden, bias=o_bias)
        self.qkv = FusedProjections(self.q_proj, self.k_proj, self.v_proj)
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, rope: Rope, hidden: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """Attend each token of ``hidden`` ``[tokens, hidden]`` to its sequence's context."""
        q, k, v = self.qkv(hidden)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        self.ops.rotary_embedding(rope[0], q, k, rope[1], rope[2])
        if self.ops.causal_attention is not None:  # a trainer's forward: no pool
            out = self.ops.causal_attention(q, k, v, metadata, self.scale)
        else:
            self.ops.store_kv(k, v, self.k_cache, self.v_cache, metadata.slot_mapping)
            out = self.ops.paged_attention(q, self.k_cache, self.v_cache, metadata, self.scale)
        return self.tp.all_reduce(self.o_proj(out.flatten(1)))


class LlamaMLP(nn.Module):
    """SiLU-gated feed-forward block."""

    def __init__(self, config: PretrainedConfig, ops: KernelOps, tp: TensorParallel) -> None:
        super().__init__()
        self.ops = ops
        self.tp = tp
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only 'silu').")
        hidden, intermediate = config.hidden_size, config.intermediate_size // tp.size
        self.gate_proj = LoraLinear(hidden, intermediate, bias=False)
        self.up_proj = LoraLinear(hidden, intermediate, bias=False)
        self.down_proj = LoraLinear(intermediate, hidden, bias=False)
        self.gate_up = FusedProjections(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(x)) * up(x))."""
        return self.tp.all_reduce(self.down_proj(self.ops.silu_and_mul(*self.gate_up(x))))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each with a residual connection.

    The residual add is fused into the next norm (vLLM's layout): a layer takes and returns
    the MLP output and the residual stream separately.
    """

    def __init__(self, config: PretrainedConfig, spec: ArchitectureSpec, ops: KernelOps,
                 tp: TensorParallel) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, spec, ops, tp)
        self.mlp = LlamaMLP(config, ops, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

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


class VocabEmbedding(nn.Embedding):
    """The token embedding; under tensor parallelism this rank's rows of the vocabulary
    (``vocab_rows``, the LM head's), each token looked up on the rank that holds it and the
    ranks' rows added by one all-reduce (zeros elsewhere), as vLLM's vocabulary-parallel
    embedding does."""

    def __init__(self, config: PretrainedConfig, tp: TensorParallel) -> None:
        self.vocab_rows = shard_range("embed_tokens.weight", (config.vocab_size,), config, tp) \
            or (0, 0, config.vocab_size)
        super().__init__(self.vocab_rows[2] - self.vocab_rows[1], config.hidden_size)
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings ``[tokens, hidden]`` of ``input_ids``."""
        if self.tp.size == 1:
            return super().forward(input_ids)
        _, start, stop = self.vocab_rows
        local = input_ids - start
        elsewhere = (local < 0) | (local >= stop - start)
        hidden = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        return self.tp.all_reduce(hidden.masked_fill_(elsewhere.unsqueeze(-1), 0))


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm."""

    def __init__(self, config: PretrainedConfig, spec: ArchitectureSpec, max_position: int,
                 device: torch.device, ops: KernelOps, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config, tp)
        self.rotary_emb = RotaryEmbedding(config, head_dim_of(config), max_position, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, spec, ops, tp) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """Final hidden states ``[tokens, hidden]`` of the flat token stream."""
        hidden = self.embed_tokens(input_ids)
        rope = (positions, self.rotary_emb.cos, self.rotary_emb.sin)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual, metadata)
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM; ``lm_head`` shares the embedding when the config ties them
    (under tensor parallelism both hold this rank's rows of the vocabulary)."""

    def __init__(self, config: PretrainedConfig, spec: ArchitectureSpec, max_position: int,
                 device: torch.device, ops: KernelOps, tp: TensorParallel) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = LlamaModel(config, spec, max_position, device, ops, tp)
        _, start, stop = self.model.embed_tokens.vocab_rows
        self.lm_head = Linear(config.hidden_size, stop - start, bias=False)
        self.linear_layout: str | None = None  # see pack_linear_weights
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with ``lm_head`` when the config ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """Final hidden states of every token in the step."""
        return self.model(input_ids, positions, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Vocabulary logits of the given hidden rows (under tensor parallelism gathered on
        the driver; None on the other ranks)."""
        logits = self.lm_head(hidden)
        if self.tp.size == 1:
            return logits
        rows = vocab_per_rank(self.config.vocab_size, self.tp.size)
        logits = F.pad(logits, (0, rows - logits.shape[-1]))
        return self.tp.gather_vocab(logits, self.config.vocab_size)

    def pack_linear_weights(self, layout: str | None) -> None:
        """Multiply every projection in ``layout`` (one of ``cpu_linear.LAYOUTS``):
        ``"transposed"`` re-stores each weight column-major in place, ``"onednn"`` and
        ``"panels"`` multiply through copies (``PackedWeight``), q/k/v and gate/up each as
        one matrix; None through the row-major weights themselves (an aliased weight
        changes in place unseen, so it must never be copied). The LM head is packed with
        the projections: ``F.linear``'s own last bits change with the row count (MKL blocks
        each shape its own way), so it kept no bit-for-bit parity with transformers' batch
        shapes, and packed it is about 2-3x faster at decode row counts
        (``benchmarks/matmul_floor.py --role lm_head``)."""
        fused = self.fused_projections()
        in_fused = {id(layer) for group in fused for layer in group.layers}
        copied = layout in cpu_linear.COPIES
        for module in self.modules():
            if not isinstance(module, Linear):
                continue
            alone = id(module) not in in_fused
            if module is not self.lm_head:  # tied to the embedding: never re-stored
                cpu_linear.store_column_major(module.weight, layout == "transposed")
            if isinstance(module, LoraLinear):  # the panels' rows are batch-invariant
                module.lora_product = panel_linear if layout == "panels" else F.linear
            module.packed = PackedWeight([module], layout) if alone and copied else None
        for group in fused:
            group.packed = PackedWeight(group.layers, layout) if copied else None
        self.linear_layout = layout

    def multiply_through(self, linear: Callable[..., torch.Tensor], name: str) -> None:
        """Every linear layer, the LM head and the LoRA products each through ``linear(x,
        weight, bias)`` (``LiveLinear``: q/k/v and gate/up each on its own), ``name`` being
        the layout reported: the batch-invariant Triton matmul of exact log-probs on CUDA,
        or a trainer's differentiable kernels in its twin (``exact_forward.py``)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.packed = LiveLinear(module, linear)
            if isinstance(module, LoraLinear):
                module.lora_product = linear
        for group in self.fused_projections():
            group.packed = None
        self.linear_layout = name

    def fastest_linear_layout(self) -> str | None:
        """The layout ``cpu_linear.fastest_layout`` finds fastest for this model's
        projections, timed on its leading layers (as many as hold ``CALIBRATION_BYTES`` of
        weights, at least one) as the forward pass groups them; remembered per machine in
        the Tandem cache folder."""
        groups, size = [], 0
        for layer in self.model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            groups += [attention.qkv.layers, [attention.o_proj], mlp.gate_up.layers,
                       [mlp.down_proj]]
            size += sum(p.numel() * p.element_size() for p in layer.parameters())
            if size >= CALIBRATION_BYTES:
                break
        return cpu_linear.fastest_layout(groups, self.lm_head.weight.dtype,
                                         cache_dir() / "cpu_linear_layouts.json")

    def fused_projections(self) -> list[FusedProjections]:
        """Every layer's q/k/v and gate/up groups."""
        return [group for layer in self.model.layers
                for group in (layer.self_attn.qkv, layer.mlp.gate_up)]

    def packed_weights(self) -> list[PackedWeight]:
        """Every packed copy of a weight the forward pass multiplies through (none unpacked)."""
        owners = [*self.fused_projections(), *(m for m in self.modules() if isinstance(m, Linear))]
        return [owner.packed for owner in owners if isinstance(owner.packed, PackedWeight)]

    def attention_layers(self) -> list[LlamaAttention]:
        """The attention modules, in layer order, for binding the KV pool."""
        return [layer.self_attn for layer in self.model.layers]


def head_dim_of(config: PretrainedConfig) -> int:
    """The attention head size (explicit in the config or hidden_size / num_heads)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
