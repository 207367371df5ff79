"""Paged attention in Triton: ``store_kv`` and ``paged_attention`` with the reference's signatures.

Decodes (one query token per sequence) run one program per (sequence, KV head, split): the
program holds all query heads of its KV head (GQA), walks its share of the context through
the block table and keeps an online softmax in float32. With few sequences and long contexts
the context is split across programs (flash-decoding) and a second kernel merges the
splits by their log-sum-exp. Prefill chunks run one program per (sequence, head, query
tile), causal, reading every key (earlier chunks, prefix-cache hits and this step's, which
``store_kv`` wrote first) from the pool.

A layer's sliding window W (``sliding_window``; 0 in the kernels for none) is a scalar
argument, never specialised on: a decode reads its last W keys alone (split among its
programs); a prefill tile starts at its first token's window, rounded down to the grid of
key tiles every chunk shares, so a token's tiles (and its bits, for exact log-probs) do
not depend on its chunk.

Attention sinks (``sinks``, a logit per query head) start each row's online softmax at
its sink (maximum the sink, sum 1, no value), so no key's step changes; a split decode
starts its first split alone so, and the merge counts the sink once. A soft cap
(``softcap``) bends each score, ``cap * tanh(score / cap)``, before the mask; the kernels
keep scores in log2 units (``exp2``), where it is the same cap times ``LOG2E`` (tanh
written out through ``sigmoid``: Triton's own is libdevice's, which the interpreter lacks).
Without them (None, a constexpr) the kernels compile as they did before.

Scores and products are accumulated in float32. Matrix products take float16/bfloat16
operands on a GPU (tensor cores, products exact in float32); the Triton interpreter
computes bfloat16 products wrongly, so there every operand is converted to float32 right
after it is loaded.

An FP8 pool (``fp8_kv.py``; GPUs of compute capability 8.9 and newer) is read with each
element converted to the query's dtype as it loads (exactly: every e4m3 value is a float16
and a bfloat16), its KV head's key scale folded into the softmax scale and its value scale
into the output. ``store_kv`` rounds to e4m3 in float32 arithmetic of its own (torch's
conversion, written out), so the stored bits are torch's on every device.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import triton
import triton.language as tl

from .attention import AttentionMetadata
from .fp8_kv import FP8, FP8_MAX

MAX_SPLITS = 16
LOG2E = 1.4426950408889634
E4M3_MAX = tl.constexpr(FP8_MAX)  # a kernel reads module globals only as constexprs
LOG2E_CONSTEXPR = tl.constexpr(LOG2E)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the pool;
    into an FP8 pool quantized by its ``k_scale``/``v_scale`` (``fp8_kv.quantize``'s bits).

    Tokens whose slot is -1 (padding) are skipped.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key, value = _rows_contiguous(key), _rows_contiguous(value)
    k_scale, v_scale = _scales(k_cache, k_scale, v_scale)
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *k_cache.stride()[:3], num_kv_heads, head_dim,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_H=_pow2(num_kv_heads), BLOCK_D=_pow2(head_dim))


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    metadata: AttentionMetadata, scale: float,
                    k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None,
                    sliding_window: int | None = None, sinks: torch.Tensor | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Causal attention of ``query`` ``[num_tokens, num_heads, head_dim]`` over the pool
    (an FP8 one read through its ``k_scale``/``v_scale``).

    Query heads are grouped over the KV heads (GQA). Each query token attends to the keys of
    its own sequence at positions up to its own, and with a ``sliding_window`` W only to the
    last W of them (its own included); each head's softmax with its ``sinks`` logit, over
    scores soft-capped at ``softcap``. Returns ``[num_tokens, num_heads, head_dim]``.
    Never synchronises with the device, so a pure-decode step can be captured in a graph.
    """
    output = torch.empty_like(query)
    num_decodes = metadata.num_decodes
    if num_decodes:
        paged_decode_attention(query[:num_decodes], k_cache, v_cache,
                               metadata.block_tables[:num_decodes],
                               metadata.context_lens[:num_decodes], scale,
                               output=output[:num_decodes], k_scale=k_scale, v_scale=v_scale,
                               sliding_window=sliding_window, sinks=sinks, softcap=softcap)
    num_prefills = metadata.context_lens.shape[0] - num_decodes
    if num_prefills:
        _prefill_attention(query, k_cache, v_cache, metadata, scale, output, num_prefills,
                           k_scale, v_scale, sliding_window, sinks, softcap)
    return output


def batch_invariant_attention(query: torch.Tensor, k_cache: torch.Tensor,
                              v_cache: torch.Tensor, metadata: AttentionMetadata,
                              scale: float, k_scale: torch.Tensor | None = None,
                              v_scale: torch.Tensor | None = None,
                              sliding_window: int | None = None,
                              sinks: torch.Tensor | None = None,
                              softcap: float | None = None) -> torch.Tensor:
    """``paged_attention`` with every query, decodes included, through the prefill kernel:
    a decode is a one-token chunk, so a token's attention runs the same tiles, in the same
    order, with the same online softmax, whether it was decoded or prefilled and wherever
    its chunk began (exact log-probs; no flash-decoding split, whose count follows the
    batch). Keys past a query's position, or before its window, fold in as exact no-ops;
    each row's sink starts its softmax, whatever its chunk."""
    output = torch.empty_like(query)
    if metadata.context_lens.shape[0]:
        _prefill_attention(query, k_cache, v_cache, dataclasses.replace(
            metadata, num_decodes=0, max_query_len=max(metadata.max_query_len, 1)), scale,
            output, metadata.context_lens.shape[0], k_scale, v_scale, sliding_window, sinks,
            softcap)
    return output


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None,
                           output: torch.Tensor | None = None,
                           k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None,
                           sliding_window: int | None = None,
                           sinks: torch.Tensor | None = None,
                           softcap: float | None = None) -> torch.Tensor:
    """Attention of one query token per sequence ``[num_seqs, num_heads, head_dim]`` (over
    an FP8 pool through its ``k_scale``/``v_scale``), to its last ``sliding_window`` keys
    where one is given, with each head's ``sinks`` logit and scores soft-capped at
    ``softcap`` where given.

    ``num_splits`` splits each context (or its window) across that many programs (default:
    enough programs to fill the device); the first split's softmax holds the sink. Writes
    into ``output`` when given; returns the output. A sequence whose context length is 0
    (graph padding) gets zeros.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if output is None:
        output = torch.empty_like(query)
    if num_splits is None:
        num_splits = _num_splits(num_seqs * num_kv_heads, query.device)
    lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    partial = output.unsqueeze(2) if num_splits == 1 else torch.empty(
        num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
    group = num_heads // num_kv_heads
    block_d = _pow2(head_dim)
    k_scale, v_scale = _scales(k_cache, k_scale, v_scale)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, k_scale, v_scale, _sinks(sinks), block_tables, context_lens,
        partial, lse, scale * LOG2E, _softcap_log2(softcap), sliding_window or 0,
        query.stride(0), query.stride(1),
        *k_cache.stride()[:3], block_tables.stride(0), *partial.stride()[:3],
        *lse.stride()[:2], num_splits, head_dim,
        BLOCK_SIZE=k_cache.shape[1], GROUP=group, BLOCK_G=max(16, _pow2(group)),
        BLOCK_N=_decode_keys(query.dtype, block_d, k_scale is not None), BLOCK_D=block_d,
        UPCAST=_interpreting(), num_warps=4)
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            partial, lse, output, *partial.stride()[:3], *lse.stride()[:2],
            output.stride(0), output.stride(1), num_splits, head_dim,
            BLOCK_S=_pow2(num_splits), BLOCK_D=block_d)
    return output


def _prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       metadata: AttentionMetadata, scale: float, output: torch.Tensor,
                       num_prefills: int, k_scale: torch.Tensor | None,
                       v_scale: torch.Tensor | None, sliding_window: int | None,
                       sinks: torch.Tensor | None, softcap: float | None) -> None:
    k_scale, v_scale = _scales(k_cache, k_scale, v_scale)
    num_heads, head_dim = query.shape[1:]
    block_m = 16 if _interpreting() else _prefill_tile(query.dtype, head_dim,
                                                       k_scale is not None)
    grid = (num_prefills, num_heads, triton.cdiv(metadata.max_query_len, block_m))
    _prefill_kernel[grid](
        query, k_cache, v_cache, k_scale, v_scale, _sinks(sinks), metadata.block_tables,
        metadata.context_lens, metadata.cu_seqlens_q, output, scale * LOG2E,
        _softcap_log2(softcap), sliding_window or 0, metadata.num_decodes,
        query.stride(0), query.stride(1), *k_cache.stride()[:3],
        metadata.block_tables.stride(0), output.stride(0), output.stride(1), head_dim,
        BLOCK_SIZE=k_cache.shape[1], GROUP=num_heads // k_cache.shape[2], BLOCK_M=block_m,
        BLOCK_N=block_m, BLOCK_D=_pow2(head_dim), UPCAST=_interpreting(), num_warps=4)


@triton.jit
def _store_kv_kernel(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, stride_kt,
                     stride_kh, stride_vt, stride_vh, stride_cb, stride_ct, stride_ch,
                     num_kv_heads, head_dim, BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token)
    if slot < 0:
        return
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)
    cache_offset = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct
    cache_offset += h * stride_ch + d
    k = tl.load(key + token * stride_kt + h * stride_kh + d, mask=mask).to(tl.float32)
    v = tl.load(value + token * stride_vt + h * stride_vh + d, mask=mask).to(tl.float32)
    if k_scale is not None:  # an FP8 pool
        k = _round_to_e4m3(k, tl.load(k_scale + h, mask=h < num_kv_heads, other=1.0))
        v = _round_to_e4m3(v, tl.load(v_scale + h, mask=h < num_kv_heads, other=1.0))
    tl.store(k_cache + cache_offset, k.to(k_cache.dtype.element_ty), mask=mask)
    tl.store(v_cache + cache_offset, v.to(v_cache.dtype.element_ty), mask=mask)


@triton.jit
def _round_to_e4m3(x, scale):
    """``x / scale`` (IEEE division), clamped to ±448 and rounded to the nearest e4m3 value
    (ties to even), as float32: torch's conversion (c10's ``fp8e4m3fn_from_fp32_value``)
    written out. Triton's own cast rounds through float16 on sm_89 and wrongly in the
    interpreter; of an e4m3 value it is exact everywhere."""
    y = tl.clamp(tl.math.div_rn(x, scale), -E4M3_MAX, E4M3_MAX)
    bits = y.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    # Normal (from 2^-6): keep 3 of the 23 mantissa bits, rounding the 20 dropped to even.
    normal = (magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) & -0x100000
    # Subnormal (spacing 2^-9): an add at 2^14, whose float32 spacing is 2^-9, rounds it.
    subnormal = (magnitude.to(tl.float32, bitcast=True) + 16384.0) - 16384.0
    rounded = tl.where(magnitude >= 121 << 23, normal,
                       subnormal.to(tl.int32, bitcast=True))
    return (rounded | (bits ^ magnitude)).to(tl.float32, bitcast=True)


@triton.jit
def _attend_tile(q, k_cache, v_cache, block_table, kv_head, n, n_in, n_valid, d, d_mask,
                 row_max, row_sum, acc, scale_log2, softcap_log2, stride_cb, stride_ct,
                 stride_ch, BLOCK_SIZE: tl.constexpr):
    """Fold the keys ``n`` into the online softmax ``(row_max, row_sum, acc)``.

    ``n_in`` marks the keys inside the context; ``n_valid`` (rows × keys, or 1 × keys) those
    each query row may see. The products take ``q``'s type for their operands. Scores in
    log2 units are soft-capped at ``softcap_log2`` (the cap times LOG2E; None: no cap).
    """
    block = tl.load(block_table + n // BLOCK_SIZE, mask=n_in, other=0)
    offset = (block * stride_cb + (n % BLOCK_SIZE) * stride_ct + kv_head * stride_ch)[:, None]
    kv_mask = n_in[:, None] & d_mask[None, :]
    k = tl.load(k_cache + offset + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
    if softcap_log2 is not None:  # cap tanh(s / cap)
        scores = softcap_log2 * _tanh(scores / softcap_log2)
    scores = tl.where(n_valid, scores, float("-inf"))
    m_new = tl.maximum(row_max, tl.max(scores, 1))
    # A row that has seen no key yet (a window's leading tiles) stays empty, not NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(scores - m_safe[:, None])
    alpha = tl.exp2(row_max - m_safe)
    v = tl.load(v_cache + offset + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision="ieee")
    return m_new, row_sum * alpha + tl.sum(p, 1), acc


@triton.jit
def _tanh(x):
    """tanh(x) = 2 sigmoid(2x) - 1, x clamped to ±15 (whose tanh is ±1 in float32) so that
    no exp overflows (Triton's own tanh is libdevice's, which the interpreter lacks). As
    (1 - e) / (1 + e) with e = exp(-2|x|), ptxas spilled the bfloat16 decode with sinks on
    sm_90."""
    return 2.0 * tl.sigmoid(2.0 * tl.clamp(x, -15.0, 15.0)) - 1.0


@triton.jit(do_not_specialize=["sliding_window"])
def _decode_kernel(query, k_cache, v_cache, k_scale, v_scale, sinks, block_tables,
                   context_lens, partial, lse, scale_log2, softcap_log2, sliding_window,
                   stride_qt, stride_qh, stride_cb,
                   stride_ct, stride_ch, stride_bt, stride_ps, stride_ph, stride_psplit,
                   stride_ls, stride_lh, num_splits, head_dim, BLOCK_SIZE: tl.constexpr,
                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens + seq)
    first = tl.where(sliding_window > 0, tl.maximum(context_len - sliding_window, 0), 0)
    split_len = tl.cdiv(tl.cdiv(context_len - first, num_splits), BLOCK_N) * BLOCK_N
    start = first + split * split_len
    end = tl.minimum(start + split_len, context_len)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < head_dim
    mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(query + seq * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=mask,
                other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    if k_scale is not None:  # an FP8 pool: q . (k s) = (q s) . k
        scale_log2 = scale_log2 * tl.load(k_scale + kv_head)
    row_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_G], tl.float32)
    if sinks is not None:  # the first split starts at the sink: the merge counts it once
        row_max = tl.load(sinks + heads, mask=g_mask & (split == 0),
                          other=float("-inf")).to(tl.float32) * LOG2E_CONSTEXPR
        row_sum = tl.where(row_max > float("-inf"), 1.0, 0.0)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for n_start in range(start, end, BLOCK_N):
        n = n_start + tl.arange(0, BLOCK_N)
        n_in = n < end
        row_max, row_sum, acc = _attend_tile(
            q, k_cache, v_cache, block_tables + seq * stride_bt, kv_head, n, n_in,
            n_in[None, :], d, d_mask, row_max, row_sum, acc, scale_log2, softcap_log2,
            stride_cb, stride_ct, stride_ch, BLOCK_SIZE)
    has_keys = row_sum > 0
    out = acc / tl.where(has_keys, row_sum, 1.0)[:, None]
    if v_scale is not None:  # sum p (v s) = s sum p v
        out = out * tl.load(v_scale + kv_head)
    tl.store(partial + seq * stride_ps + heads[:, None] * stride_ph + split * stride_psplit
             + d[None, :], out, mask=mask)
    log_sum = row_max + tl.log2(tl.where(has_keys, row_sum, 1.0))
    tl.store(lse + seq * stride_ls + heads * stride_lh + split,
             tl.where(has_keys, log_sum, float("-inf")), mask=g_mask)


@triton.jit
def _merge_splits_kernel(partial, lse, output, stride_ps, stride_ph, stride_psplit,
                         stride_ls, stride_lh, stride_ot, stride_oh, num_splits, head_dim,
                         BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    split_lse = tl.load(lse + seq * stride_ls + head * stride_lh + s, mask=s_mask,
                        other=float("-inf"))
    top = tl.max(split_lse, 0)
    weights = tl.exp2(split_lse - tl.where(top == float("-inf"), 0.0, top))
    mask = s_mask[:, None] & (d < head_dim)[None, :]
    parts = tl.load(partial + seq * stride_ps + head * stride_ph + s[:, None] * stride_psplit
                    + d[None, :], mask=mask, other=0.0)
    total = tl.sum(weights, 0)
    out = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(output + seq * stride_ot + head * stride_oh + d, out, mask=d < head_dim)


@triton.jit(do_not_specialize=["sliding_window"])
def _prefill_kernel(query, k_cache, v_cache, k_scale, v_scale, sinks, block_tables,
                    context_lens, cu_seqlens_q, output, scale_log2, softcap_log2,
                    sliding_window, num_decodes, stride_qt, stride_qh, stride_cb, stride_ct,
                    stride_ch, stride_bt, stride_ot, stride_oh, head_dim,
                    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    seq = num_decodes + tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + seq)
    # Positions in int32, as the key indices: registers are tight at 64 x 64 tiles.
    q_len = (tl.load(cu_seqlens_q + seq + 1) - q_start).to(tl.int32)
    if tile * BLOCK_M >= q_len:
        return
    context_len = tl.load(context_lens + seq).to(tl.int32)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    positions = context_len - q_len + rows
    # A row sees the keys less than `span` positions back: its window, or all before it.
    span = tl.where(sliding_window > 0, sliding_window, context_len)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    mask = (rows < q_len)[:, None] & d_mask[None, :]
    q_offset = (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :]
    q = tl.load(query + q_offset, mask=mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    if k_scale is not None:  # an FP8 pool: q . (k s) = (q s) . k
        scale_log2 = scale_log2 * tl.load(k_scale + head // GROUP)
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if sinks is not None:  # every row starts at its head's sink, whatever its chunk
        sink = tl.load(sinks + head).to(tl.float32) * LOG2E_CONSTEXPR
        row_max = tl.zeros([BLOCK_M], tl.float32) + sink
        row_sum = tl.full([BLOCK_M], 1.0, tl.float32)
    end = tl.minimum(context_len, context_len - q_len + (tile + 1) * BLOCK_M)
    # From the tile's first row's first key, on the grid of key tiles every chunk shares.
    first_position = context_len - q_len + tile * BLOCK_M
    start = tl.maximum(first_position - span + 1, 0) // BLOCK_N * BLOCK_N
    for n_start in range(start, end, BLOCK_N):
        n = n_start + tl.arange(0, BLOCK_N)
        n_in = n < end
        back = positions[:, None] - n[None, :]
        n_valid = (back >= 0) & (back < span) & n_in[None, :]
        row_max, row_sum, acc = _attend_tile(
            q, k_cache, v_cache, block_tables + seq * stride_bt, head // GROUP, n, n_in, n_valid,
            d, d_mask, row_max, row_sum, acc, scale_log2, softcap_log2, stride_cb, stride_ct,
            stride_ch, BLOCK_SIZE)
    out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
    if v_scale is not None:  # sum p (v s) = s sum p v
        out = out * tl.load(v_scale + head // GROUP)
    tl.store(output + (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :],
             out, mask=mask)


def _scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None,
            v_scale: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The scales a kernel takes: an FP8 pool's, None (a constexpr: no code) for any other."""
    return (k_scale, v_scale) if k_cache.dtype == FP8 else (None, None)


def _sinks(sinks: torch.Tensor | None) -> torch.Tensor | None:
    """The sinks as the kernels index them (stride 1), or None (a constexpr: no code)."""
    return None if sinks is None else _rows_contiguous(sinks.detach())


def _softcap_log2(softcap: float | None) -> float | None:
    """The soft cap in the kernels' log2 units (``cap tanh(s / cap)`` of scores times LOG2E
    is ``cap LOG2E tanh(s LOG2E / (cap LOG2E))``), or None (a constexpr: no code)."""
    return None if softcap is None else softcap * LOG2E


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a contiguous last dimension (the kernels index it with stride 1)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _prefill_tile(dtype: torch.dtype, head_dim: int, fp8: bool) -> int:
    """The prefill's query and key tile: 64 in 16-bit types; in float32, whose products run
    on FMA units with 32-bit operands, tiles small enough that ptxas keeps them in registers
    (64 x 64 spilled a 6 KB stack at head dim 64; 32 x 32 over an FP8 pool, converted in
    registers, 640 bytes)."""
    if dtype != torch.float32:
        return 64
    return 32 if head_dim <= 64 and not fp8 else 16


def _decode_keys(dtype: torch.dtype, block_d: int, fp8: bool) -> int:
    """Keys the decode kernel reads at a time: 32 for heads of 128 and more, and for float32
    over an FP8 pool (64 spilled 284 bytes at head dim 64), else 64."""
    return 32 if block_d >= 128 or (fp8 and dtype == torch.float32) else 64


def _pow2(n: int) -> int:
    return triton.next_power_of_2(n)


def _interpreting() -> bool:
    """True under Triton's interpreter, where products must take float32 operands."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _num_splits(num_programs: int, device: torch.device) -> int:
    """Splits per context so that about two programs run per streaming multiprocessor."""
    return max(1, min(MAX_SPLITS, 2 * _num_processors(device) // num_programs))


@functools.cache
def _num_processors(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
