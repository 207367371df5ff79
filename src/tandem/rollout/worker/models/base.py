"""The model contract: what a model family provides to the engine, and what every family
gets from it.

A family subclasses ``CausalLM``, builds its layers from ``layers.py`` (whose linear layers
declare their tensor-parallel split and Hugging Face tensors), and provides:

- ``__init__(config, max_position, device, ops, tp)``: this rank's slice of the model, every
  kernel through ``ops``, with ``lm_head`` (a ``Linear`` split ``"vocab"``: this rank's
  vocabulary rows) and ``rotary_emb`` (its rotary tables, which are not buffers);
- ``forward(input_ids, positions, metadata)``: the final hidden states of a step's tokens;
- ``input_embedding()``, ``decoder_layers()``, ``attention_layers()`` (each holding
  ``k_cache``/``v_cache`` bound to the pool and ``k_scale``/``v_scale``, an FP8 pool's
  scales or None, and passing all four to its kernels, with its ``sliding_window``, an
  int or None for full attention), and ``linear_groups(layer)``: a layer's
  projections in the order its forward pass runs them, those reading one input as one
  ``FusedProjections``;
- the class methods ``check_config`` (refuse what the family cannot run) and ``kv_shape``
  (the KV pool's shape per rank, known before the model is built; with ``layer_windows``,
  each layer's sliding window, which groups the pool's pages), and the class attributes
  ``lora_targets`` (the module names a trainer's adapter targets by default) and
  ``batch_invariant`` (whether its layers support exact log-probs).

A family whose logits are soft-capped (Gemma 2's ``final_logit_softcapping``) sets
``final_logit_softcap``: ``compute_logits`` caps them for sampling and prompt log-probs,
and the trainer's exact forward through ``soft_cap`` as well.

From these ``CausalLM`` derives the weight spec (``weight_spec``; a layer's ``aliases`` map
another layout's names onto it, ``unalias``), logits under tensor parallelism, the CPU
linear layouts, 8-bit weights (``quantize_weights``: the decoder layers' projections, as
``linear_groups`` lists them) and the tied embedding. Families register by
architecture name (``registry.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from tandem.kernels import AttentionMetadata, cpu_linear
from tandem.kernels.cpu_build import cache_dir
from tandem.kernels.cpu_linear import PackedWeight
from tandem.kernels.differentiable import panel_linear

from ...parallel.tensor_parallel import TensorParallel, vocab_per_rank
from .layers import FusedProjections, Linear, LiveLinear, LoraLinear, VocabEmbedding
from .rotary import RotaryEmbedding
from .weight_spec import WeightSpec, WeightTarget

CALIBRATION_BYTES = 64 << 20  # weights timed to choose the CPU linear layout


@dataclass(frozen=True, slots=True)
class KVShape:
    """What one rank's KV pool holds per token: layers, query and KV heads, head size."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


class CausalLM(nn.Module):
    """A causal LM over the paged KV cache (see the module docstring for the contract)."""

    lora_targets: ClassVar[tuple[str, ...]] = ()
    # Its forward keeps a row's bits at any batch with the backend's batch-invariant kernels
    # (exact log-probs); a family whose layers do not yet (the experts) says False.
    batch_invariant: ClassVar[bool] = True
    config: PretrainedConfig
    tp: TensorParallel
    lm_head: Linear
    rotary_emb: RotaryEmbedding
    linear_layout: str | None = None  # see pack_linear_weights
    quantization: str | None = None  # see quantize_weights
    final_logit_softcap: float | None = None  # see soft_cap

    @classmethod
    def check_config(cls, config: PretrainedConfig) -> None:
        """Raise ValueError, naming the fix, for a config this family cannot run."""

    @classmethod
    def kv_shape(cls, config: PretrainedConfig, tp_size: int) -> KVShape:
        """The KV pool's shape on one of ``tp_size`` ranks."""
        raise NotImplementedError

    @classmethod
    def layer_windows(cls, config: PretrainedConfig) -> list[int | None]:
        """Each layer's sliding window (None: full attention), as its attention module's
        ``sliding_window`` will be: the KV pool groups layers by it (``kv_groups.py``)."""
        return [None] * cls.kv_shape(config, 1).num_layers

    def input_embedding(self) -> VocabEmbedding:
        """The token embedding."""
        raise NotImplementedError

    def decoder_layers(self) -> list[nn.Module]:
        """The decoder layers, in order."""
        raise NotImplementedError

    def attention_layers(self) -> list[nn.Module]:
        """The attention modules, in layer order, for binding the KV pool."""
        raise NotImplementedError

    def linear_groups(self, layer: nn.Module) -> list[Linear | FusedProjections]:
        """``layer``'s projections in forward order; those reading one input fused."""
        raise NotImplementedError

    def tie_weights(self) -> None:
        """Share the embedding with ``lm_head`` when the config ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.input_embedding().weight

    def weight_spec(self) -> dict[str, WeightTarget]:
        """Every Hugging Face tensor the model holds, by name, and where it goes (a tied
        weight under its first name only): each layer's own ``weight_targets`` where it
        has them, else its parameters whole, replicated."""
        spec, seen = {}, set()
        for prefix, module in self.named_modules():
            own = dict(module.named_parameters(recurse=False, prefix=prefix))
            fresh = {name for name, param in own.items() if id(param) not in seen}
            seen |= {id(param) for param in own.values()}
            targets = module.weight_targets(prefix) if hasattr(module, "weight_targets") \
                else {name: WeightTarget(name) for name in own}
            spec.update({name: target for name, target in targets.items()
                         if target.parameter in fresh})
        return spec

    def unalias(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
        """A tensor given under another layout's name (transformers' stacked experts, a
        checkpoint's other module name) as the weight spec's names and tensors (views), or
        None when no layer knows the name (each layer's own ``aliases``)."""
        if not hasattr(self, "_aliasing"):
            self._aliasing = [(prefix, module) for prefix, module in self.named_modules()
                              if hasattr(module, "aliases")]
        for prefix, module in self._aliasing:
            found = module.aliases(prefix, name, tensor)
            if found is not None:
                return found
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Vocabulary logits of the given hidden rows (under tensor parallelism gathered on
        the driver; None on the other ranks)."""
        logits = self.soft_cap(self.lm_head(hidden))  # per element: before the gather
        if self.tp.size == 1:
            return logits
        rows = vocab_per_rank(self.config.vocab_size, self.tp.size)
        logits = F.pad(logits, (0, rows - logits.shape[-1]))
        return self.tp.gather_vocab(logits, self.config.vocab_size)

    def soft_cap(self, logits: torch.Tensor) -> torch.Tensor:
        """The LM head's ``logits`` soft-capped where the family sets
        ``final_logit_softcap`` c: ``c tanh(logits / c)``, in their dtype as transformers
        computes it (as they are where it is None)."""
        cap = self.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def fused_projections(self) -> list[FusedProjections]:
        """Every layer's projections that read one input."""
        return [group for layer in self.decoder_layers() for group in self.linear_groups(layer)
                if isinstance(group, FusedProjections)]

    def quantized_layers(self) -> list[Linear]:
        """The projections ``quantize_weights`` quantizes: every decoder layer's linear
        layers (``linear_groups``: q/k/v, o, gate/up, down); the embedding, the LM head and
        the norms keep the model's dtype, as in vLLM."""
        return [layer for decoder in self.decoder_layers() for group in self.linear_groups(decoder)
                for layer in (group.layers if isinstance(group, FusedProjections) else [group])]

    def quantize_weights(self, method: str) -> None:
        """Store every ``quantized_layers`` weight as 8-bit codes with a float32 scale per
        output channel (``Linear.quantize``; ``method`` one of
        ``quantization.QUANTIZATIONS``), in place of its float weight.

        Raises:
            ValueError: for a model with stacked experts (a mixture of experts), which are
                not quantized yet.
        """
        if any(hasattr(module, "pack_weights") for module in self.modules()):
            raise ValueError(f"quantization={method!r} does not cover a mixture of experts' "
                             "stacked experts yet: start the engine with quantization=None.")
        for layer in self.quantized_layers():
            layer.quantize(method)
        self.quantization = method

    def weight_bytes(self) -> int:
        """Bytes of the weights held: the parameters (tied ones once, 8-bit ones at a byte
        each) and the scales of the quantized ones."""
        scales = [layer.weight_scale for layer in self.modules()
                  if isinstance(layer, Linear) and layer.weight_scale is not None]
        return sum(t.numel() * t.element_size() for t in [*self.parameters(), *scales])

    def pack_linear_weights(self, layout: str | None) -> None:
        """Multiply every projection in ``layout`` (one of ``cpu_linear.LAYOUTS``):
        ``"transposed"`` re-stores each weight column-major in place, ``"onednn"`` and
        ``"panels"`` multiply through copies (``PackedWeight``), each ``FusedProjections``
        as one matrix; None through the row-major weights themselves (an aliased weight
        changes in place unseen, so it must never be copied). The LM head is packed with
        the projections: ``F.linear``'s own last bits change with the row count (MKL blocks
        each shape its own way), and packed it is about 2-3x faster at decode row counts
        (``benchmarks/matmul_floor.py --role lm_head``).

        Raises:
            ValueError: for a layout other than ``"panels"`` on a quantized model (the
                panels alone read 8-bit weights on CPU).
        """
        if self.quantization is not None and layout != "panels":
            raise ValueError(f"quantization={self.quantization!r} multiplies through the "
                             f"panels on CPU, not the {layout!r} layout.")
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
        for module in self.modules():  # layers of their own weights (stacked experts)
            if hasattr(module, "pack_weights"):
                module.pack_weights(layout)
        self.linear_layout = layout

    def multiply_through(self, linear: Callable[..., torch.Tensor], name: str) -> None:
        """Every linear layer, the LM head and the LoRA products each through ``linear(x,
        weight, bias)`` (``LiveLinear``: fused projections each on its own), ``name`` being
        the layout reported: the batch-invariant Triton matmul of exact log-probs on CUDA,
        or a trainer's differentiable kernels in its twin (``exact_forward.py``)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.packed = LiveLinear(module, linear)
            if isinstance(module, LoraLinear):
                module.lora_product = linear
        for group in self.fused_projections():
            group.packed = None
        for module in self.modules():
            if module is not self and hasattr(module, "multiply_through"):
                module.multiply_through(linear)
        self.linear_layout = name

    def multiply_quantized_through(self, linear: Callable[..., torch.Tensor]) -> None:
        """The quantized projections (``quantized_layers``) each through ``linear``
        (``LiveLinear``), the other layers as they are: on CUDA the Triton 8-bit matmul
        (``linear(x, codes, bias, weight_scale)``), in a trainer's twin a differentiable
        matmul that quantizes the trainer's float weight as the engine does."""
        for layer in self.quantized_layers():
            layer.packed = LiveLinear(layer, linear)
        for group in self.fused_projections():
            group.packed = None

    def fastest_linear_layout(self) -> str | None:
        """The layout ``cpu_linear.fastest_layout`` finds fastest for this model's
        projections, timed on its leading layers (as many as hold ``CALIBRATION_BYTES`` of
        weights, at least one) as the forward pass groups them; remembered per machine in
        the Tandem cache folder."""
        groups, size = [], 0
        for layer in self.decoder_layers():
            groups += [list(group.layers) if isinstance(group, FusedProjections) else [group]
                       for group in self.linear_groups(layer)]
            size += sum(p.numel() * p.element_size() for p in layer.parameters())
            if size >= CALIBRATION_BYTES:
                break
        return cpu_linear.fastest_layout(groups, self.lm_head.weight.dtype,
                                         cache_dir() / "cpu_linear_layouts.json")

    def packed_weights(self) -> list[PackedWeight]:
        """Every packed copy of a weight the forward pass multiplies through (none unpacked)."""
        owners = [*self.fused_projections(), *(m for m in self.modules() if isinstance(m, Linear))]
        return [owner.packed for owner in owners if isinstance(owner.packed, PackedWeight)]

    def lora_layers(self, spec: WeightSpec) -> dict[str, tuple[LoraLinear, int]]:
        """The layers that add a run-time LoRA adapter, by Hugging Face weight name (of
        ``spec``, this model's ``weight_spec()``), each with the part of the layer the name
        is (0 for a layer of one part)."""
        modules = dict(self.named_modules())
        layers = {}
        for name, target in spec.items():
            module = modules[target.parameter.rpartition(".")[0]]
            if isinstance(module, LoraLinear) and target.parameter.endswith(".weight"):
                layers[name] = (module, target.slot[0][0] if target.slot else 0)
        return layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """Final hidden states ``[tokens, hidden]`` of every token in the step."""
        raise NotImplementedError
