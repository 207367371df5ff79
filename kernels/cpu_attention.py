"""Paged attention on CPU with the decodes in a compiled C kernel (``cpu_attention.c``).

The torch reference (``attention.py``) gathers every decode's keys and values out of the
pool into a contiguous copy, upcasts a half-precision copy to float32, and multiplies it in
batched matmuls of a few rows each. The C kernel reads each key and value row once, in
place, converting bfloat16 as it loads, with the softmax in float32: the same arithmetic
without the copies. Prefill chunks stay with the reference (SDPA's flash kernel). Built and
loaded by ``cpu_build.py``; where it does not build, the engine takes the reference.
"""

from __future__ import annotations

import ctypes

import torch

from . import attention, cpu_build
from .attention import AttentionMetadata, attend_prefills
from .cpu_build import DTYPES, MAX_GROUP, MAX_HEAD_DIM


class _DecodeArgs(ctypes.Structure):
    """``struct decode_args`` of cpu_attention.c, field for field."""

    _fields_ = [(name, ctypes.c_void_p) for name in
                ("query", "output", "k_cache", "v_cache", "block_tables", "context_lens")] + [
        (name, ctypes.c_int64) for name in (
            "block_table_stride", "query_stride_seq", "query_stride_head",
            "output_stride_seq", "output_stride_head", "num_heads", "num_kv_heads",
            "head_dim", "block_size", "cache_stride_block", "cache_stride_token",
            "cache_stride_head")] + [("scale", ctypes.c_float), ("bf16", ctypes.c_int32)]


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """True when the compiled kernel takes this query and pool (dtype, head size, GQA
    group size, contiguous head rows); the reference serves the rest."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    return (cpu_build.available() and query.dtype in DTYPES and k_cache.dtype == query.dtype
            and head_dim <= MAX_HEAD_DIM and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= MAX_GROUP
            and query.stride(2) == 1 and k_cache.stride(3) == 1)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    metadata: AttentionMetadata, scale: float) -> torch.Tensor:
    """``attention.paged_attention``'s result, the decodes attended by the compiled kernel.

    Falls back to the reference for inputs the kernel does not take (``supports``).
    """
    if not supports(query, k_cache) or k_cache.stride() != v_cache.stride():
        return attention.paged_attention(query, k_cache, v_cache, metadata, scale)
    output = torch.empty(query.shape, dtype=query.dtype)
    if metadata.num_decodes:
        decode_attention(query, k_cache, v_cache, metadata, scale, output)
    attend_prefills(query, k_cache, v_cache, metadata, scale, output)
    return output


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     metadata: AttentionMetadata, scale: float, output: torch.Tensor) -> None:
    """Write the attention of the first ``metadata.num_decodes`` query tokens (one per
    decode) into the same rows of ``output`` (contiguous, ``query``'s shape and dtype).

    Raises:
        MemoryError: when the kernel cannot allocate its scratch rows.
    """
    num_decodes = metadata.num_decodes
    block_tables = metadata.block_tables[:num_decodes].to(torch.int64).contiguous()
    context_lens = metadata.context_lens[:num_decodes].to(torch.int64).contiguous()
    args = _DecodeArgs(
        query.data_ptr(), output.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), context_lens.data_ptr(), block_tables.stride(0),
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        query.shape[1], k_cache.shape[2], query.shape[2], k_cache.shape[1],
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), scale,
        DTYPES[query.dtype])
    decode = cpu_build.kernel("tandem_decode_attention",
                              (ctypes.POINTER(_DecodeArgs), ctypes.c_int64, ctypes.c_int32),
                              ctypes.c_int32)
    status = decode(ctypes.byref(args), num_decodes, torch.get_num_threads())
    if status != 0:
        raise MemoryError("the CPU attention kernel could not allocate its scratch rows")
