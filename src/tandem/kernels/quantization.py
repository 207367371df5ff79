"""8-bit weights with one scale per output channel: what a quantized weight is, and the one
function that makes it.

``quantization="int8"`` and ``"fp8"`` (``EngineConfig.quantization``) store each linear
projection's weight ``W [out, in]`` as 8-bit codes ``q`` and a float32 scale per output
channel ``s [out]``, ``W ≈ s[:, None] · q`` (vLLM's per-channel weight-only int8 and its fp8
``FP8_DYNAMIC`` weight format): ``s = max |W[o]| / MAX`` and ``q = round(W / s)`` clamped to
``±MAX``, with ``MAX`` 127 for int8 (symmetric) and 448 for fp8 e4m3 (``float8_e4m3fn``, the
cast rounding to nearest even). A matmul through them (the CPU panels, ``cpu_linear.c``; the
Triton matmul, ``triton_linear.py``) sums ``x · q`` in float32 and multiplies each output by
its channel's scale at the end.

The engine quantizes at load and in every weight commit, from the weight in the model's
dtype; a trainer's exact forward quantizes its own weights with the same function
(``quantize``), so both hold the same bits. Each channel's scale depends on that channel's
row alone, so packed projections (q/k/v, gate/up) quantize part by part or whole alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The smallest normal float32: a channel of zeros (or of values this small) gets this scale,
# so no division by zero and no denormal scale (the C kernels run with -ffast-math).
MIN_SCALE = torch.finfo(torch.float32).tiny


@dataclass(frozen=True, slots=True)
class QuantFormat:
    """An 8-bit weight format: its name, its torch dtype and its largest code."""

    name: str
    dtype: torch.dtype
    max_code: float


FORMATS = {"int8": QuantFormat("int8", torch.int8, 127.0),
           "fp8": QuantFormat("fp8", torch.float8_e4m3fn, 448.0)}
QUANTIZATIONS = tuple(FORMATS)
QUANTIZED_DTYPES = tuple(quant.dtype for quant in FORMATS.values())


def check_quantization(name: str | None) -> None:
    """Raise ValueError, naming the valid ones, unless ``name`` is None or a format."""
    if name is not None and name not in FORMATS:
        raise ValueError(f"quantization={name!r} is invalid: use one of "
                         f"{', '.join(map(repr, QUANTIZATIONS))}, or None (the model's dtype).")


def quantize(weight: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[..., out, in]`` as 8-bit codes of the same shape in ``method``'s format
    and float32 scales ``[..., out]``, one per output channel (see the module docstring),
    computed in float32 on ``weight``'s device."""
    quant = FORMATS[method]
    values = weight.detach().float()
    scale = (values.abs().amax(dim=-1) / quant.max_code).clamp(min=MIN_SCALE)
    scaled = (values / scale.unsqueeze(-1)).clamp(-quant.max_code, quant.max_code)
    if quant.dtype == torch.int8:
        scaled = scaled.round()
    return scaled.to(quant.dtype), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight ``scale · codes`` (what the 8-bit matmuls multiply by), in ``dtype``."""
    return (codes.float() * scale.unsqueeze(-1)).to(dtype)


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is one of 8-bit weight codes (int8 or fp8 e4m3)."""
    return dtype in QUANTIZED_DTYPES
