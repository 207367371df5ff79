"""The CPU linear layers: oneDNN's packed matmul.

``torch.nn.functional.linear`` on CPU multiplies by the weight in its stored row-major
layout. oneDNN (what vLLM's CPU build and inductor's freezing use) first reorders the weight
once into its blocked layout (``torch.ops.mkldnn._reorder_linear_weight``) and then
multiplies by that copy (``torch.ops.mkldnn._linear_pointwise``), which is faster over the
model's layers at every row count from 1 to 256 (``benchmarks/matmul_floor.py`` measures
both; at 512 rows they are even). The packed copy
is a cache of the weight: it is rebuilt whenever the weight's storage or its version counter
(bumped by every in-place write, such as a weight update's ``copy_``) changes, so it never
serves stale weights. A weight whose values change without either (an aliased trainer
tensor) must not be packed: the model drops its packed copies then (``unpack``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def packs(dtype: torch.dtype) -> bool:
    """True when this machine's oneDNN packs weights of ``dtype`` (float32 always; bfloat16
    only with the AVX-512 or AVX-NE-CONVERT instructions its kernels need)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedWeight:
    """One linear layer's weight in oneDNN's layout, rebuilt whenever the weight changes."""

    __slots__ = ("key", "packed")

    def __init__(self) -> None:
        self.key: tuple[int, int] | None = None
        self.packed = torch.empty(0)

    def of(self, weight: torch.Tensor) -> torch.Tensor:
        """The packed copy of ``weight`` as it is now."""
        key = (weight.data_ptr(), weight._version)
        if key != self.key:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            self.key = key
        return self.packed


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: PackedWeight | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[rows, in]``: through ``packed`` when given, else
    the plain matmul."""
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed.of(weight), bias, "none", [], "")
