"""A decoder layer's per-token operations in compiled C (``cpu_layers.c``): the CPU
backend's ``rms_norm``, ``gemma_rms_norm``, ``rotary_embedding``, ``silu_and_mul``,
``gelu_tanh_and_mul`` and ``store_kv``.

Each is one pass over its rows where the torch reference (``layers.py``, ``attention.py``)
takes several operations, each its own pass over memory and its own dispatch: at the few
rows of a decode step those costs exceed the arithmetic. Same signatures and results as the
references (bfloat16 rounded where torch rounds); inputs the kernels do not take (float16,
rows without a uniform stride) go to the references. Built and loaded by ``cpu_build.py``.
"""

from __future__ import annotations

import ctypes

import torch

from . import attention, cpu_build, layers
from .cpu_build import DTYPES

_POINTER, _INT = ctypes.c_void_p, ctypes.c_int64


class _RotaryArgs(ctypes.Structure):
    """``struct rotary_args`` of cpu_layers.c, field for field."""

    _fields_ = [(name, _POINTER) for name in
                ("positions", "query", "key", "cos_cache", "sin_cache")] + [
        (name, _INT) for name in (
            "num_tokens", "head_dim", "cache_stride", "query_stride_token",
            "query_stride_head", "num_query_heads", "key_stride_token", "key_stride_head",
            "num_key_heads")] + [("bf16", ctypes.c_int32)]


class _StoreKvArgs(ctypes.Structure):
    """``struct store_kv_args`` of cpu_layers.c, field for field."""

    _fields_ = [(name, _POINTER) for name in
                ("key", "value", "k_cache", "v_cache", "slot_mapping")] + [
        (name, _INT) for name in (
            "num_tokens", "num_kv_heads", "head_dim", "block_size", "element_size",
            "key_stride_token", "key_stride_head", "value_stride_token", "value_stride_head",
            "cache_stride_block", "cache_stride_token", "cache_stride_head")]


def _row_stride(x: torch.Tensor) -> int | None:
    """The element stride between ``x``'s rows of its last dimension, if uniform."""
    if x.stride(-1) != 1:
        return None
    if x.dim() == 2 or x.is_contiguous():
        return x.stride(-2) if x.dim() >= 2 else x.shape[-1]
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``layers.rms_norm``, in one pass per row (rows without a uniform stride, such as
    q/k heads split out of a fused projection, copied contiguous first: every float32 and
    bfloat16 row goes through this kernel, so its bits never depend on the layout)."""
    return _rms_norm(x, weight, eps, residual, unit_offset=False)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None
                   ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``layers.gemma_rms_norm`` (scaled by ``1 + weight`` in float32), as ``rms_norm``."""
    return _rms_norm(x, weight, eps, residual, unit_offset=True)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
              residual: torch.Tensor | None, unit_offset: bool
              ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if _row_stride(x) is None and x.stride(-1) == 1:
        x = x.contiguous()
    x_stride = _row_stride(x)
    residual_stride = 0 if residual is None else _row_stride(residual)
    if (x_stride is None or residual_stride is None or x.dtype not in DTYPES
            or weight.dtype != x.dtype or not weight.is_contiguous()
            or (residual is not None and residual.dtype != x.dtype)):
        reference = layers.gemma_rms_norm if unit_offset else layers.rms_norm
        return reference(x, weight, eps, residual)
    out = torch.empty(x.shape, dtype=x.dtype)
    total = torch.empty(x.shape, dtype=x.dtype) if residual is not None else None
    kernel = cpu_build.kernel("tandem_rms_norm", (
        _POINTER, _INT, _POINTER, _INT, _POINTER, _POINTER, _POINTER, _INT, _INT,
        ctypes.c_float, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32))
    cols = x.shape[-1]
    kernel(x.data_ptr(), x_stride, None if residual is None else residual.data_ptr(),
           residual_stride, weight.data_ptr(), out.data_ptr(),
           None if total is None else total.data_ptr(), x.numel() // cols, cols, eps,
           DTYPES[x.dtype], int(unit_offset), torch.get_num_threads())
    return out if total is None else (out, total)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``layers.silu_and_mul``, in one pass per row."""
    return _gated_activation(gate, up, gelu=False)


def gelu_tanh_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``layers.gelu_tanh_and_mul``, in one pass per row."""
    return _gated_activation(gate, up, gelu=True)


def _gated_activation(gate: torch.Tensor, up: torch.Tensor, gelu: bool) -> torch.Tensor:
    gate_stride, up_stride = _row_stride(gate), _row_stride(up)
    if (gate_stride is None or up_stride is None or gate.dtype not in DTYPES
            or up.dtype != gate.dtype or up.shape != gate.shape):
        return (layers.gelu_tanh_and_mul if gelu else layers.silu_and_mul)(gate, up)
    out = torch.empty(gate.shape, dtype=gate.dtype)
    kernel = cpu_build.kernel("tandem_gated_activation", (
        _POINTER, _INT, _POINTER, _INT, _POINTER, _INT, _INT, ctypes.c_int32, ctypes.c_int32,
        ctypes.c_int32))
    cols = gate.shape[-1]
    kernel(gate.data_ptr(), gate_stride, up.data_ptr(), up_stride, out.data_ptr(),
           gate.numel() // cols, cols, DTYPES[gate.dtype], int(gelu), torch.get_num_threads())
    return out


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_cache: torch.Tensor, sin_cache: torch.Tensor) -> None:
    """``layers.rotary_embedding``: ``query`` and ``key`` rotated in place, in one pass."""
    if (query.dim() != 3 or key.dim() != 3 or query.dtype not in DTYPES
            or key.dtype != query.dtype or query.stride(-1) != 1
            or key.stride(-1) != 1 or positions.dtype != torch.int64
            or not positions.is_contiguous() or cos_cache.dtype != torch.float32
            or sin_cache.stride() != cos_cache.stride() or cos_cache.stride(-1) != 1):
        layers.rotary_embedding(positions, query, key, cos_cache, sin_cache)
        return
    args = _RotaryArgs(
        positions.data_ptr(), query.data_ptr(), key.data_ptr(), cos_cache.data_ptr(),
        sin_cache.data_ptr(), positions.numel(), query.shape[-1], cos_cache.stride(0),
        query.stride(0), query.stride(1), query.shape[1], key.stride(0), key.stride(1),
        key.shape[1], DTYPES[query.dtype])
    kernel = cpu_build.kernel("tandem_rotary_embedding",
                              (ctypes.POINTER(_RotaryArgs), ctypes.c_int32))
    kernel(ctypes.byref(args), torch.get_num_threads())


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """``attention.store_kv``: each token's rows copied to its slot (-1: skipped). An FP8
    pool takes the reference's store, so that every CPU path quantizes through the one
    ``fp8_kv.quantize`` (the trainer's exact forward too)."""
    if (key.dtype != k_cache.dtype or value.dtype != k_cache.dtype
            or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1
            or key.stride(-1) != 1 or value.stride(-1) != 1
            or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous()):
        attention.store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    args = _StoreKvArgs(
        key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        slot_mapping.data_ptr(), slot_mapping.numel(), key.shape[1], key.shape[2],
        k_cache.shape[1], key.element_size(), key.stride(0), key.stride(1), value.stride(0),
        value.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    cpu_build.kernel("tandem_store_kv", (ctypes.POINTER(_StoreKvArgs),))(ctypes.byref(args))
