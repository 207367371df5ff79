"""The CPU linear layers: oneDNN's packed matmul.

``torch.nn.functional.linear`` on CPU multiplies by the weight in its stored row-major
layout. oneDNN (what vLLM's CPU build and inductor's freezing use) first reorders the weight
once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``) and then
multiplies by that copy (``torch.ops.mkldnn._linear_pointwise``), which is faster over the
model's layers at every row count from 1 to 256 (``benchmarks/matmul_floor.py`` measures
both; at 512 rows they are even). Layers that read the same input pack as one matrix: one
call instead of three for q/k/v, much of the cost at a few rows. The packed copy is a cache of
the weight: it is rebuilt whenever the weight's storage or its version counter
(bumped by every in-place write, such as a weight update's ``copy_``) changes, so it never
serves stale weights. A weight whose values change without either (an aliased trainer
tensor) must not be packed: the model drops its packed copies then
(``pack_linear_weights(False)``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def packs(dtype: torch.dtype) -> bool:
    """True when this machine's oneDNN packs weights of ``dtype`` (float32 always; bfloat16
    only with the AVX-512 or AVX-NE-CONVERT instructions its kernels need)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedWeight:
    """The weights of one or more linear layers that read the same input (q/k/v, gate/up),
    concatenated along their outputs in oneDNN's layout, with their biases; rebuilt whenever
    any of them changes. Calling it multiplies by all of them at once."""

    __slots__ = ("layers", "key", "weight", "bias")

    def __init__(self, layers: Sequence[nn.Linear]) -> None:
        self.layers = tuple(layers)
        self.key: tuple[tuple[int, int], ...] | None = None
        self.weight = torch.empty(0)
        self.bias: torch.Tensor | None = None

    def current(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The packed weight and the concatenated bias (None without) as the layers are now."""
        params = [p for layer in self.layers for p in (layer.weight, layer.bias) if p is not None]
        key = tuple((p.data_ptr(), p._version) for p in params)
        if key != self.key:
            weights = [layer.weight.detach() for layer in self.layers]
            self.weight = torch.ops.mkldnn._reorder_linear_weight(
                weights[0] if len(weights) == 1 else torch.cat(weights), None)
            self.bias = self._stacked_bias()
            self.key = key
        return self.weight, self.bias

    def _stacked_bias(self) -> torch.Tensor | None:
        """The layers' biases end to end (zeros for a layer without), None if none has one."""
        if all(layer.bias is None for layer in self.layers):
            return None
        return torch.cat([layer.weight.new_zeros(layer.out_features) if layer.bias is None
                          else layer.bias.detach() for layer in self.layers])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T + b`` for ``x`` ``[rows, in]``, W and b the layers' stacked weights and
        biases: their outputs side by side."""
        weight, bias = self.current()
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
