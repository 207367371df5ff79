"""MXFP4 expert weights (GPT-OSS's checkpoints), dequantized at load.

A GPT-OSS checkpoint stores each stacked expert projection as two uint8 tensors beside its
bfloat16 bias: ``<name>_blocks`` ``[E, out, in / 32, 16]``, two FP4 (e2m1) values a byte
(the low nibble first), and ``<name>_scales`` ``[E, out, in / 32]``, one e8m0 exponent
(a power of two, biased by 127) per block of 32 values. ``dequantize`` gives the tensor
transformers' ``GptOssExperts`` holds, ``[E, in, out]`` (its ``convert_moe_packed_tensors``,
value for value), which the loader then treats as the checkpoint's ``<name>``.

Tandem dequantizes at load, to the model's dtype, as vLLM's CPU path (and transformers
without its Triton kernels) does: every FP4 value times a power of two is exact in bfloat16
and float32, so the weights served are the checkpoint's exactly, and the experts run through
the same kernels (panels, Triton's grouped matmul) as any other family's, with exact
log-probs and weight updates by transformers' names. The 8-bit path (``quantization``) is
not used: its codes are per output channel, not per 32 values, so requantizing would round
the checkpoint's weights a second time; and an MXFP4 matmul of its own is not built.
"""

from __future__ import annotations

import torch

# The 16 e2m1 codes' values (sign bit, two exponent bits, one mantissa bit), as the OCP
# microscaling spec and transformers' FP4_VALUES list them.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0_BIAS = 127
BLOCK = 32  # values per scale
SUFFIXES = ("_blocks", "_scales")


def packed_part(name: str) -> tuple[str, str] | None:
    """``(tensor name, "_blocks" or "_scales")`` of one half of an MXFP4 tensor's checkpoint
    pair (``...experts.gate_up_proj_blocks``), or None for another name."""
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix), suffix
    return None


def dequantize(name: str, blocks: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    """The tensor ``name`` of MXFP4 ``blocks`` ``[E, out, G, 16]`` and ``scales`` ``[E,
    out, G]`` (both uint8) in ``dtype``, as transformers' GPT-OSS holds it: ``[E, G * 32,
    out]`` (a transposed view).

    Raises:
        ValueError: naming ``name`` and the fix, for tensors that are not uint8 or whose
            shapes do not pair.
    """
    _check(name, blocks, scales)
    table = torch.tensor(E2M1_VALUES, dtype=dtype)
    experts, rows, groups = scales.shape
    out = torch.empty(experts, rows, groups * BLOCK, dtype=dtype)
    for expert in range(experts):  # one expert's temporaries at a time
        out[expert] = _decoded(blocks[expert], scales[expert], table)
    return out.transpose(1, 2)


def _decoded(blocks: torch.Tensor, scales: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """One expert's ``[out, G * 32]`` values: each nibble's e2m1 value (``table``) times its
    block's power of two (exact: an FP4 value times a power of two)."""
    codes = blocks.to(torch.int64)
    values = torch.stack([table[codes & 0x0F], table[codes >> 4]], dim=-1).flatten(-2)
    exponents = scales.to(torch.int32)[..., None] - E8M0_BIAS
    return torch.ldexp(values, exponents).flatten(-2)


def _check(name: str, blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """Raise ValueError unless ``blocks`` and ``scales`` are one MXFP4 tensor's pair."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"checkpoint tensors {name}_blocks and {name}_scales are "
                         f"{blocks.dtype} and {scales.dtype}; MXFP4 stores both as uint8 "
                         "(U8): re-export the checkpoint's experts in MXFP4, or unquantized.")
    if blocks.dim() != 4 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"checkpoint tensors {name}_blocks {tuple(blocks.shape)} and "
                         f"{name}_scales {tuple(scales.shape)} do not pair: MXFP4 blocks are "
                         f"[experts, out, in / {BLOCK}, {BLOCK // 2}] and their scales "
                         f"[experts, out, in / {BLOCK}]; re-export the checkpoint.")
