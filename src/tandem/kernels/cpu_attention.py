"""Paged attention on CPU in compiled C kernels (``cpu_attention.c``): the decodes, and the
prefill chunks.

The torch reference (``attention.py``) gathers every sequence's keys and values out of the
pool into a contiguous copy, upcasts a half-precision copy to float32, and multiplies it in
batched matmuls (decodes) or SDPA's flash kernel (prefills, one sequence at a time, each KV
head's keys and values repeated for its query heads, a mask built for a chunk after a
cached prefix). The C kernels read each key and value row in place, converting bfloat16 as
they load, with the softmax in float32, every sequence of the step in one parallel call:
the same arithmetic without the copies (``benchmarks/cpu_backends.py``). An FP8 pool's
bytes are read through a table of their float32 values (torch's own conversion of each of
the 256), its key scale folded into the query's and its value scale into the output. Under
a sliding window a task reads the keys from its first token's window on, never the blocks
before. Attention sinks (a float32 copy of them) join each row's softmax, and a soft cap
bends each row's scores before it. Built and loaded by ``cpu_build.py``; where it does not
build, the engine takes the reference.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from . import attention, cpu_build
from .attention import AttentionMetadata
from .cpu_build import DTYPES, MAX_GROUP, MAX_HEAD_DIM
from .fp8_kv import FP8

# cpu_attention.c's FORMAT_FP8_E4M3 (after DTYPES' float32 and bfloat16 flags).
FP8_FORMAT = 2


class _AttentionArgs(ctypes.Structure):
    """``struct attention_args`` of cpu_attention.c, field for field."""

    _fields_ = [(name, ctypes.c_void_p) for name in
                ("query", "output", "k_cache", "v_cache", "block_tables", "context_lens",
                 "query_starts", "k_scale", "v_scale", "fp8_values", "sinks")] + [
        (name, ctypes.c_int64) for name in (
            "block_table_stride", "query_stride_seq", "query_stride_head",
            "output_stride_seq", "output_stride_head", "num_heads", "num_kv_heads",
            "head_dim", "block_size", "cache_stride_block", "cache_stride_token",
            "cache_stride_head", "sliding_window")] + [
        ("scale", ctypes.c_float), ("softcap", ctypes.c_float), ("bf16", ctypes.c_int32),
        ("kv_format", ctypes.c_int32)]


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """True when the compiled kernels take this query and pool (dtype, head size, GQA
    group size, contiguous head rows); the reference serves the rest."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    return (cpu_build.available() and query.dtype in DTYPES
            and k_cache.dtype in (query.dtype, FP8)
            and head_dim <= MAX_HEAD_DIM and num_heads % num_kv_heads == 0
            and num_heads // num_kv_heads <= MAX_GROUP
            and query.stride(2) == 1 and k_cache.stride(3) == 1)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    metadata: AttentionMetadata, scale: float,
                    k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None,
                    sliding_window: int | None = None, sinks: torch.Tensor | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """``attention.paged_attention``'s result, by the compiled kernels: the decodes (the
    first ``metadata.num_decodes`` query tokens), then the prefill chunks; with a
    ``sliding_window``, each tile reading the keys from its first token's window on; with
    ``sinks`` and a ``softcap``, each row's softmax taking them.

    Falls back to the reference for inputs the kernels do not take (``supports``).

    Raises:
        MemoryError: when a kernel cannot allocate its scratch rows.
    """
    if not supports(query, k_cache) or k_cache.stride() != v_cache.stride():
        return attention.paged_attention(query, k_cache, v_cache, metadata, scale, k_scale,
                                         v_scale, sliding_window, sinks, softcap)
    output = torch.empty(query.shape, dtype=query.dtype)
    args = _attention_args(query, k_cache, v_cache, metadata, scale, output, k_scale, v_scale,
                           sliding_window, sinks, softcap)
    num_seqs, num_decodes = len(metadata.context_lens), metadata.num_decodes
    threads = torch.get_num_threads()
    status = 0
    if num_decodes:
        decode = cpu_build.kernel("tandem_decode_attention", (
            ctypes.POINTER(_AttentionArgs), ctypes.c_int64, ctypes.c_int32), ctypes.c_int32)
        status = decode(ctypes.byref(args), num_decodes, threads)
    if num_seqs > num_decodes and status == 0:
        prefill = cpu_build.kernel("tandem_prefill_attention", (
            ctypes.POINTER(_AttentionArgs), ctypes.c_int64, ctypes.c_int64, ctypes.c_int32),
            ctypes.c_int32)
        status = prefill(ctypes.byref(args), num_decodes, num_seqs, threads)
    if status != 0:
        raise MemoryError("the CPU attention kernels could not allocate their scratch rows")
    return output


def _attention_args(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    metadata: AttentionMetadata, scale: float, output: torch.Tensor,
                    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                    sliding_window: int | None, sinks: torch.Tensor | None,
                    softcap: float | None) -> _AttentionArgs:
    """The kernels' arguments, holding on to the int64 and float32 copies they point into
    (the scales and the e4m3 table for an FP8 pool only, the sinks where there are); a
    window or a soft cap of 0 is none."""
    block_tables = metadata.block_tables.to(torch.int64).contiguous()
    context_lens = metadata.context_lens.to(torch.int64).contiguous()
    query_starts = metadata.cu_seqlens_q.to(torch.int64).contiguous()
    fp8 = k_cache.dtype == FP8
    scales = [s.float().contiguous() if fp8 else None for s in (k_scale, v_scale)]
    table = _fp8_values() if fp8 else None
    sinks = None if sinks is None else sinks.detach().float().contiguous()
    args = _AttentionArgs(
        query.data_ptr(), output.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        block_tables.data_ptr(), context_lens.data_ptr(), query_starts.data_ptr(),
        *(None if t is None else t.data_ptr() for t in (*scales, table, sinks)),
        block_tables.stride(0), query.stride(0), query.stride(1), output.stride(0),
        output.stride(1), query.shape[1], k_cache.shape[2], query.shape[2], k_cache.shape[1],
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), sliding_window or 0, scale,
        softcap or 0.0, DTYPES[query.dtype], FP8_FORMAT if fp8 else DTYPES[query.dtype])
    args.tensors = (block_tables, context_lens, query_starts, *scales, table, sinks)
    return args


@functools.cache
def _fp8_values() -> torch.Tensor:
    """The float32 value of each of the 256 e4m3 bytes, as torch converts them."""
    return torch.arange(256, dtype=torch.uint8).view(FP8).float()
