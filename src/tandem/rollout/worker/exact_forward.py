"""A trainer's forward pass through the engine's own model code and kernels: exact log-probs.

The engine samples through batch-invariant kernels (``EngineConfig.exact_logprobs``): a
token's logits have the same bits whatever batch, chunk or cache it was computed in. This
runs the trainer's parameters (a Hugging Face model, maybe a peft one) through a twin of the
engine's model, built on the meta device and bound to those parameters at each call
(``torch.func.functional_call``), whose kernels are the engine's own wrapped for autograd
(``kernels/differentiable.py``). So the trainer's first forward pass gives every sampled
token bit for bit the log-prob the engine returned, and its backward gives the gradients
autograd through transformers gives, within float tolerance.

The trainer's LoRA adapter (peft) goes in as the engine serves it: merged into each targeted
weight as the engine's merge computes it (``LoraFactors.merged``), or added at run time
through the panels as the engine's ``LoraLinear`` adds it; differentiably either way.

With an FP8 KV pool each layer of the twin attends through the engine's scales (the same
tensors): its K and V are rounded through e4m3 by the engine's own store before the same
attention arithmetic, so the bits still match (``differentiable.py``).
An engine with 8-bit weights (``quantization``) serves its projections quantized: the twin's
quantize the trainer's weights with the engine's function and multiply through the engine's
8-bit kernel (``training_quantized_linear``; the gradient passes straight through the
rounding). A merged adapter is merged, as ``LoraSync`` merges it there, onto the base the
engine serves (the base's quantized weight, dequantized), then quantized.

Each shared prefix (a group's prompt, a multi-turn group's earlier turns: each row's longest
common prefix with the row before) is computed once (``shared_prefix.py``): the rows after
attend its stream rows as a prefill chunk attends a cached prefix, which the engine's
kernels compute to the same bits (so the log-probs are the unshared forward's bit for
bit), and the backward adds every row's gradient into it (the gradients the unshared ones
within float rounding: their sum is rounded once, where the unshared backward rounds each
row's part).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from tandem.kernels import KernelOps, quantization
from tandem.kernels.differentiable import (
    training_linear,
    training_ops,
    training_quantized_linear,
)
from tandem.sync.lora import LoraFactors

from ..parallel.tensor_parallel import TensorParallel
from .models import CausalLM, model_class
from .models.moe import FusedMoE
from .models.weight_spec import assemble
from .shared_prefix import TokenStream, token_stream

_LORA = re.compile(r"(.+)\.lora_([AB])\.[^.]+\.weight$")
_PEFT_PREFIX = "base_model.model."


@dataclass(slots=True)
class ExactOutput:
    """What ``completion_logprobs`` reads of a Hugging Face model's output: the kept
    positions' logits ``[B, keep, V]`` and (asked for) the final hidden states ``[B, keep,
    H]`` as the last of ``hidden_states``."""

    logits: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...] | None = None


class ExactForward:
    """Calls like a Hugging Face causal LM on padded rows (``input_ids``, ``attention_mask``,
    ``position_ids``, ``logits_to_keep``), through the engine's kernels, differentiable in
    ``model``'s parameters.

    Args:
        model: the trainer's model (transformers, maybe wrapped by peft), the engine's
            architecture, in the engine's dtype.
        engine_model: the engine's model (its family, config and rotary tables' size).
        kernels: the engine's kernels (batch-invariant: the compiled CPU ones, or Triton's).
        lora_runtime: the engine adds the adapter at run time (else it merges it).
        shared_prefix: compute each row's longest common prefix with the row before once
            (``shared_prefix.py``; the same bits); False: every row whole.
    """

    def __init__(self, model: nn.Module, engine_model: CausalLM, kernels: KernelOps,
                 lora_runtime: bool = False, shared_prefix: bool = True) -> None:
        config, tables = engine_model.config, engine_model.rotary_emb.cos
        with torch.device("meta"):  # the engine's rotary tables, computed alike
            self.twin = model_class(config)(config, tables.shape[0], tables.device,
                                            training_ops(kernels), TensorParallel())
        for twin_layer, engine_layer in zip(self.twin.attention_layers(),
                                            engine_model.attention_layers(), strict=True):
            twin_layer.k_scale, twin_layer.v_scale = engine_layer.k_scale, engine_layer.v_scale
        self.linear = training_linear(kernels)
        self.twin.multiply_through(self.linear, f"{kernels.layers.name} (differentiable)")
        self.quantization = engine_model.quantization
        self.quantized_modules: set[str] = set()
        if self.quantization is not None:
            self.twin.multiply_quantized_through(
                training_quantized_linear(kernels, self.quantization))
            quantized = {id(layer) for layer in self.twin.quantized_layers()}
            self.quantized_modules = {name for name, module in self.twin.named_modules()
                                      if id(module) in quantized}
        self.spec = self.twin.weight_spec()
        # As transformers' embedding: the padding token's row gets no gradient.
        pad = getattr(config, "pad_token_id", None)
        self.twin.input_embedding().padding_idx = pad if pad is not None and \
            0 <= pad < config.vocab_size else None
        self.model = model
        parameters = {id(p): name for name, p in self.twin.named_parameters()}
        self.head = parameters[id(self.twin.lm_head.weight)]  # the embedding's, when tied
        self.lora_layers = _lora_layers(model)
        self.lora_runtime = lora_runtime
        self.shared_prefix = shared_prefix
        self.routing: _Routing | None = None  # see routed
        self.twin_layers = dict(self.twin.named_modules())
        names = {name for name, _ in self.twin.named_parameters()}
        missing = names - set(self._tensors())
        if missing:
            raise ValueError(f"exact_logprobs: the trainer's model lacks the engine's "
                             f"parameters {sorted(missing)[:4]}: is it the same architecture?")

    def _tensors(self) -> dict[str, torch.Tensor]:
        """The trainer's tensors under the twin's parameter names (assembled by its weight
        spec), LoRA adapters merged in as the engine merges them."""
        tensors, pairs = {}, {}
        for name, param in self.model.named_parameters():
            name = name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")
            lora = _LORA.match(name)
            if lora:
                pairs.setdefault(lora[1], {})[lora[2]] = param
            else:
                tensors[name] = param
        for module, pair in pairs.items():
            scale = _lora_scale(self.lora_layers[module])
            if scale is None:  # the adapter disabled (the reference pass)
                continue
            base = tensors[f"{module}.weight"]
            if self.lora_runtime:  # the engine adds x A^T B^T s, its factors in its dtype
                layer = self.twin_layers[module]
                lora_a, lora_b, layer.lora_scale = _runtime_factors(layer, pair["A"],
                                                                    pair["B"], scale)
                tensors[f"{module}.lora_a"] = lora_a.to(base.dtype)
                tensors[f"{module}.lora_b"] = lora_b.to(base.dtype)
                continue
            factors = LoraFactors(pair["A"].float(), pair["B"].float(), scale)
            tensors[f"{module}.weight"] = factors.merged(self._served(module, base)).to(
                base.dtype)
        return assemble(self.spec, tensors)

    def _served(self, module: str, base: torch.Tensor) -> torch.Tensor:
        """The base weight of ``module`` as the engine serves it and ``LoraSync`` reads it
        back to merge onto: quantized and dequantized where the engine holds 8-bit weights."""
        if module not in self.quantized_modules:
            return base
        return quantization.dequantize(*quantization.quantize(base, self.quantization),
                                       base.dtype)

    @contextmanager
    def routed(self, routing: torch.Tensor, replay: bool,
               count: Callable[[torch.Tensor, torch.Tensor], None]) -> Iterator[None]:
        """The calls inside route by the sampler's experts ``routing`` ``[B, T, layers, k]``
        (per padded position, -1 where none): with ``replay`` each mixture-of-experts layer
        of the twin takes them (``FusedMoE.forced``), and either way ``count(own,
        sampler)`` gets each layer's own choices and the sampler's ``[real tokens, k]``
        after each call, row by row as the unshared forward sees them. Rows share a
        position only where their routing agrees too."""
        self.routing = _Routing(routing, replay, count)
        try:
            yield
        finally:
            self.routing = None

    def __call__(self, *, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 position_ids: torch.Tensor, logits_to_keep: int,
                 output_hidden_states: bool = False, **_: object) -> ExactOutput:
        """The logits of each row's last ``logits_to_keep`` positions (zeros where a row's
        tokens end earlier), and the final hidden states there if asked."""
        real = attention_mask.bool()
        keys = torch.stack([input_ids, position_ids], -1)
        if self.routing is not None:
            keys = torch.cat([keys, self.routing.experts.to(keys).flatten(2)], -1)
        stream = token_stream(keys, attention_mask, self.shared_prefix)
        ids, positions = (t[real][stream.sources] for t in (input_ids, position_ids))
        tensors = self._tensors()
        with self._routed_as(stream, real):
            hidden = functional_call(self.twin, tensors, (ids, positions, stream.metadata))
        # Each kept stream row once through the LM head (its logits are the same in any
        # batch); padding (-1) reads a zero row, appended.
        places = stream.places[:, input_ids.shape[1] - logits_to_keep:]
        rows, inverse = torch.unique(places % (len(hidden) + 1), return_inverse=True)
        padded = torch.cat([hidden, hidden.new_zeros(1, hidden.shape[1])])
        unique = padded.index_select(0, rows)
        logits = functional_call(self.twin.lm_head, {"weight": tensors[self.head]}, (unique,))
        # soft-capped as the engine's compute_logits caps them (Gemma 2)
        logits = self.twin.soft_cap(logits)
        kept = inverse.flatten()
        logits = logits.index_select(0, kept).view(*places.shape, -1)
        hidden_states = (unique.index_select(0, kept).view(*places.shape, -1),) \
            if output_hidden_states else None
        return ExactOutput(logits, hidden_states)

    @contextmanager
    def _routed_as(self, stream: TokenStream, real: torch.Tensor) -> Iterator[None]:
        """The twin's experts for ``stream`` from ``self.routing`` (see ``routed``)."""
        if self.routing is None:
            yield
            return
        sampler = self.routing.experts.to(real.device)[real]  # [real tokens, layers, k]
        layers = [m for m in self.twin.modules() if isinstance(m, FusedMoE)]
        for index, layer in enumerate(layers):
            layer.forced = sampler[stream.sources, index] if self.routing.replay else None
        try:
            yield
            for index, layer in enumerate(layers):
                self.routing.count(layer.own_routed[stream.places[real]], sampler[:, index])
        finally:
            for layer in layers:
                layer.forced = None


@dataclass(slots=True)
class _Routing:
    """The sampler's routing the next calls take (``ExactForward.routed``)."""

    experts: torch.Tensor
    replay: bool
    count: Callable[[torch.Tensor, torch.Tensor], None]


def _runtime_factors(layer: nn.Module, lora_a: torch.Tensor, lora_b: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The factors the engine serves a trainer's adapter ``(A, B, scale)`` on ``layer``
    with, differentiably: as given on a layer of one part; on a packed layer (Phi-3's
    ``qkv_proj``) one adapter per part as ``LoraSync`` splits it (A shared, each part its
    rows of B) stacked as ``stack_lora`` stacks them (the A's repeated, the B's block-diagonal
    with the scale folded in, in float32), so the product has the engine's bits."""
    if len(layer.parts) <= 1:
        return lora_a, lora_b, scale
    lora_a, lora_b = lora_a.float(), lora_b.float()
    starts = itertools.accumulate(layer.part_rows, initial=0)
    blocks = [lora_b[start:start + rows] * scale
              for start, rows in zip(starts, layer.part_rows)]
    return torch.cat([lora_a] * len(blocks)), torch.block_diag(*blocks), 1.0


def _lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """peft's LoRA layers, by the twin's name of their module."""
    return {name.removeprefix(_PEFT_PREFIX): module for name, module in model.named_modules()
            if isinstance(getattr(module, "scaling", None), dict)}


def _lora_scale(layer: nn.Module) -> float | None:
    """The scale on ``B @ A`` of ``layer``'s active adapter; None while adapters are
    disabled."""
    if getattr(layer, "disable_adapters", False):
        return None
    active = layer.active_adapters[0] if getattr(layer, "active_adapters", None) \
        else next(iter(layer.scaling))
    return float(layer.scaling[active])
