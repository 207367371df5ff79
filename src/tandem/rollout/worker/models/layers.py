"""The layers every model family builds on: linear layers that pack on CPU, split under
tensor parallelism, hold 8-bit weights when quantized and take LoRA adapters at run time;
RMSNorm; the vocabulary-parallel embedding.

Each layer declares its tensor-parallel split and the Hugging Face tensors it holds
(``weight_targets``): a model's weight spec (``base.CausalLM.weight_spec``) is theirs.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from tandem.kernels import KernelOps, quantization
from tandem.kernels.cpu_linear import PackedWeight

from ...parallel.tensor_parallel import ROW, ROW_BIAS, VOCAB, TensorParallel, shard_range
from .weight_spec import WeightTarget


class Linear(nn.Linear):
    """A linear layer that multiplies through a packed copy of its weight when it has one
    (``packed``, set on CPU by ``pack_linear_weights``; see ``kernels/cpu_linear.py``), or
    through a kernel of its own (``LiveLinear``, set by ``multiply_through``).

    Quantized (``quantize``), its weight is 8-bit codes ``[out, in]`` (int8 or fp8 e4m3,
    no gradient) and ``weight_scale`` a float32 buffer ``[out]``, one scale per output
    channel (``kernels/quantization.py``); only a kernel that reads them multiplies it (the
    panels, the Triton matmul), never ``F.linear``.

    Args:
        split: how tensor parallelism splits it (``tensor_parallel.SPLITS``): ``"column"``
            by output, ``"kv_heads"`` by output in whole KV heads, ``"row"`` by input,
            ``"vocab"`` by vocabulary rows; None replicated. A layer of several parts may
            give one per part (q by column, k and v by KV heads).
        parts: the Hugging Face modules whose weights it stacks along its outputs, in
            equal parts (vLLM's merged column-parallel layer, e.g. ``("gate_proj",
            "up_proj")`` for a ``gate_up_proj``); empty when it is one Hugging Face module.
        part_rows: this rank's output rows of each part where they differ (vLLM's QKV
            layer: q, k and v of grouped-query attention); empty: equal parts.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 split: str | tuple[str, ...] | None = None, parts: tuple[str, ...] = (),
                 part_rows: tuple[int, ...] = ()) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.split = split
        self.parts = parts
        count = max(1, len(parts))
        self.part_rows = part_rows or (out_features // count,) * count
        self.packed: PackedWeight | LiveLinear | None = None
        self.register_buffer("weight_scale", None, persistent=False)

    def quantize(self, method: str) -> None:
        """Replace the weight by its 8-bit codes in ``method``'s format and set
        ``weight_scale`` (``quantization.quantize``); the float weight is freed."""
        codes, scale = quantization.quantize(self.weight, method)
        self.unquantized_dtype = self.weight.dtype
        self.weight = nn.Parameter(codes, requires_grad=False)
        self.weight_scale = scale

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of its inputs and outputs: its weight's, or its float weight's before
        ``quantize``."""
        return self.weight.dtype if self.weight_scale is None else self.unquantized_dtype

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        """This layer's Hugging Face tensors (``prefix`` its module name) and where each
        goes: its own weight and bias, or each part's, in its slot."""
        names = [name for name, _ in self.named_parameters(recurse=False)]
        if not self.parts:
            return {f"{prefix}.{name}": WeightTarget(f"{prefix}.{name}", _kind(self.split, name))
                    for name in names}
        module = prefix.rpartition(".")[0]
        splits = self.split if isinstance(self.split, tuple) else (self.split,) * len(self.parts)
        sizes = self.part_rows if len(set(self.part_rows)) > 1 else len(self.parts)
        return {f"{module}.{part}.{name}": WeightTarget(
                    f"{prefix}.{name}", _kind(splits[index], name), ((index, sizes),))
                for index, part in enumerate(self.parts) for name in names}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T + b``."""
        return F.linear(x, self.weight, self.bias) if self.packed is None else self.packed(x)


class LoraLinear(Linear):
    """A linear layer that can add a LoRA adapter at run time: ``x W^T + s (x A^T) B^T``.

    The factors are non-persistent buffers, so they follow the model across devices. A
    layer of several ``parts`` serves one adapter per part (``stack_lora``).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 split: str | tuple[str, ...] | None = None, parts: tuple[str, ...] = (),
                 part_rows: tuple[int, ...] = ()) -> None:
        super().__init__(in_features, out_features, bias, split, parts, part_rows)
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
        self.lora_a = lora_a.to(self.weight.device, self.compute_dtype)
        self.lora_b = lora_b.to(self.weight.device, self.compute_dtype)

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
    call (no copy, so an aliased or trainer-bound weight is always current); for a quantized
    layer ``linear(x, codes, bias, weight_scale)``."""

    __slots__ = ("layer", "linear")

    def __init__(self, layer: Linear, linear: Callable[..., torch.Tensor]) -> None:
        self.layer, self.linear = layer, linear

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T + b``."""
        layer = self.layer
        if layer.weight_scale is None:
            return self.linear(x, layer.weight, layer.bias)
        return self.linear(x, layer.weight, layer.bias, layer.weight_scale)


class FusedProjections:
    """Projections that read the same input (q/k/v, gate/up), each keeping its own module,
    Hugging Face name, weight and LoRA adapter. With ``packed`` set (on CPU, by
    ``pack_linear_weights``) they multiply as one packed matrix; else each on its own.
    With ``by_part`` a layer of several parts (a packed ``qkv_proj``) gives each part's
    output (views of its own), so a family with packed layers runs Llama's forward."""

    __slots__ = ("layers", "sizes", "packed", "by_part")

    def __init__(self, *layers: LoraLinear, by_part: bool = False) -> None:
        self.layers = layers
        self.sizes = [layer.out_features for layer in layers]
        self.packed: PackedWeight | None = None
        self.by_part = by_part

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each projection of ``x`` (with ``by_part`` each part of each), in order."""
        if self.packed is None:
            outs = [layer(x) for layer in self.layers]
        else:
            outs = [layer.add_lora(x, out) for layer, out in
                    zip(self.layers, self.packed(x).split(self.sizes, dim=-1), strict=True)]
        if not self.by_part:
            return outs
        # one view per part (narrow; split's views may not be rotated in place under autograd)
        return [out.narrow(-1, start, rows) for layer, out in zip(self.layers, outs, strict=True)
                for start, rows in zip(itertools.accumulate(layer.part_rows, initial=0),
                                       layer.part_rows)]


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


class VocabEmbedding(nn.Embedding):
    """The token embedding; under tensor parallelism this rank's rows of the vocabulary
    (``vocab_rows``, the LM head's), each token looked up on the rank that holds it and the
    ranks' rows added by one all-reduce (zeros elsewhere), as vLLM's vocabulary-parallel
    embedding does."""

    def __init__(self, config: PretrainedConfig, tp: TensorParallel) -> None:
        self.vocab_rows = shard_range(VOCAB, (config.vocab_size,), config, tp) \
            or (0, 0, config.vocab_size)
        super().__init__(self.vocab_rows[2] - self.vocab_rows[1], config.hidden_size)
        self.tp = tp

    def weight_targets(self, prefix: str) -> dict[str, WeightTarget]:
        """The embedding, split by vocabulary rows."""
        return {f"{prefix}.weight": WeightTarget(f"{prefix}.weight", VOCAB)}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings ``[tokens, hidden]`` of ``input_ids``."""
        if self.tp.size == 1:
            return super().forward(input_ids)
        _, start, stop = self.vocab_rows
        local = input_ids - start
        elsewhere = (local < 0) | (local >= stop - start)
        hidden = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        return self.tp.all_reduce(hidden.masked_fill_(elsewhere.unsqueeze(-1), 0))


def _kind(split: str | None, name: str) -> str | None:
    """The split of a layer's ``name`` tensor (weight or bias) for the layer's ``split``: a
    row-parallel layer's bias is whole, added on rank 0 (``"row_bias"``)."""
    return ROW_BIAS if name == "bias" and split == ROW else split


def stack_lora(parts: list[tuple[torch.Tensor, torch.Tensor, float] | None], sizes: list[int]
               ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One adapter for a layer of several parts from each part's ``(A, B, scale)`` (None:
    that part has none): the A's stacked, the B's block-diagonal with each scale folded in,
    so ``x A^T B^T`` gives every part its own term in its own rows (``sizes`` each)."""
    given = [factors for factors in parts if factors is not None]
    lora_a = torch.cat([a for a, _, _ in given])
    lora_b = lora_a.new_zeros(sum(sizes), lora_a.shape[0])
    row, rank = 0, 0
    for factors, size in zip(parts, sizes, strict=True):
        if factors is not None:
            a, b, scale = factors
            lora_b[row:row + size, rank:rank + a.shape[0]] = b * scale
            rank += a.shape[0]
        row += size
    return lora_a, lora_b, 1.0
