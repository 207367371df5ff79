"""The compiled CPU decode attention against attention from its definition in float64, on
the inputs the engine gives it: strided query views, a head-major pool (in the model's dtype
or FP8), long contexts, sliding windows; and against itself: a token's bits do not depend on
how its step computes it, with or without a window."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.kernels import AttentionMetadata, cpu_attention
from tandem.kernels.testing import TOLERANCE, relative_error

from .test_attention import float64_attention, fp8_batch, fp8_pool, head_major, paged_batch

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_kv_heads,group", [(3, 3), (1, 8), (2, 1)])
def test_decodes_match_float64_with_a_strided_query(dtype, num_kv_heads, group):
    # Contexts of one token, a block, a block plus one and many blocks; the query is a view
    # into a wider projection output, as the fused q/k/v split gives it.
    query, k_cache, v_cache, metadata = paged_batch([1, 16, 17, 300, 47], [], num_kv_heads,
                                                    group, dtype, seed=5)
    k_cache, v_cache = head_major(k_cache), head_major(v_cache)
    wide = torch.randn(query.shape[0], query.shape[1] + 2, query.shape[2]).to(dtype)
    wide[:, 1:-1] = query
    query = wide[:, 1:-1]
    assert cpu_attention.supports(query, k_cache) and not query.is_contiguous()
    out = cpu_attention.paged_attention(query, k_cache, v_cache, metadata, 0.125)
    reference = float64_attention(query, k_cache, v_cache, metadata, 0.125)
    assert out.dtype == dtype
    assert relative_error(out, reference) < TOLERANCE[dtype]


def test_decode_of_an_empty_context_is_zero():
    query, k_cache, v_cache, metadata = paged_batch([20, 20], [], 2, 2, torch.float32)
    reference = float64_attention(query, k_cache, v_cache, metadata, 0.2)[:1]
    metadata.context_lens = torch.tensor([20, 0])
    out = cpu_attention.paged_attention(query, k_cache, v_cache, metadata, 0.2)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert relative_error(out[:1], reference) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(3, 3, 64), (1, 8, 64), (2, 1, 40)])
def test_prefill_chunks_match_float64_beside_decodes(dtype, num_kv_heads, group, head_dim):
    # Whole prompts (one token, one tile, many tiles), chunks after a cached prefix (one
    # token, part of a tile, several tiles) and decodes in one step; a head size that is
    # not a multiple of the kernel's vector; the query a strided view, as the q/k/v split
    # gives it.
    prefills = [(1, 1), (5, 5), (70, 70), (1, 40), (3, 9), (45, 300)]
    query, k_cache, v_cache, metadata = paged_batch([17, 1], prefills, num_kv_heads, group,
                                                    dtype, seed=7, head_dim=head_dim)
    k_cache, v_cache = head_major(k_cache), head_major(v_cache)
    wide = torch.randn(query.shape[0], query.shape[1] + 1, query.shape[2]).to(dtype)
    wide[:, 1:] = query
    query = wide[:, 1:]
    assert cpu_attention.supports(query, k_cache) and not query.is_contiguous()
    out = cpu_attention.paged_attention(query, k_cache, v_cache, metadata, 0.125)
    reference = float64_attention(query, k_cache, v_cache, metadata, 0.125)
    assert out.dtype == dtype
    assert relative_error(out, reference) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(3, 3, 64), (2, 1, 40)])
def test_an_fp8_pool_matches_float64_of_its_values_with_a_strided_query(dtype, num_kv_heads,
                                                                       group, head_dim):
    query, k_pool, v_pool, scales, metadata, k_values, v_values = fp8_batch(
        [17, 1, 300], [(1, 1), (70, 70), (3, 9), (45, 300)], num_kv_heads, group, dtype,
        seed=7)
    wide = torch.randn(query.shape[0], query.shape[1] + 1, query.shape[2]).to(dtype)
    wide[:, 1:] = query
    query = wide[:, 1:]
    assert cpu_attention.supports(query, k_pool) and not query.is_contiguous()
    out = cpu_attention.paged_attention(query, k_pool, v_pool, metadata, 0.125, *scales)
    reference = float64_attention(query, k_values, v_values, metadata, 0.125)
    assert out.dtype == dtype
    assert relative_error(out, reference) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_kv_heads,group,head_dim", [(3, 3, 64), (2, 1, 40)])
@pytest.mark.parametrize("window", [1, 16, 17, 64, 500])
def test_a_sliding_window_matches_float64_over_each_window(dtype, num_kv_heads, group,
                                                            head_dim, window):
    # Whole prompts and chunks of one token, part of a tile and several tiles (whose rows'
    # windows start apart), beside decodes; windows of one key, a block, a block plus one,
    # a query tile, longer than every context.
    prefills = [(1, 1), (70, 70), (3, 9), (45, 300)]
    query, k_cache, v_cache, metadata = paged_batch([17, 1, 300], prefills, num_kv_heads,
                                                    group, dtype, seed=9, head_dim=head_dim)
    wide = torch.randn(query.shape[0], query.shape[1] + 1, query.shape[2]).to(dtype)
    wide[:, 1:] = query
    query = wide[:, 1:]
    out = cpu_attention.paged_attention(query, head_major(k_cache), head_major(v_cache),
                                        metadata, 0.125, sliding_window=window)
    reference = float64_attention(query, k_cache, v_cache, metadata, 0.125, window)
    assert relative_error(out, reference) < TOLERANCE[dtype]


def test_half_precision_and_mixed_dtypes_take_the_reference():
    query, k_cache, v_cache, metadata = paged_batch([5, 40], [(3, 9)], 2, 2, torch.float16)
    assert not cpu_attention.supports(query, k_cache)
    out = cpu_attention.paged_attention(query, k_cache, v_cache, metadata, 0.125)
    reference = float64_attention(query, k_cache, v_cache, metadata, 0.125)
    assert relative_error(out, reference) < TOLERANCE[torch.float16]
    assert not cpu_attention.supports(query.float(), k_cache)


def attend_positions(query, k_cache, v_cache, block_table, steps, scale=0.125, scales=(),
                     window=None):
    """The attention of one sequence's query tokens (``query`` ``[L, heads, head_dim]``, its
    keys in ``k_cache`` by ``block_table``), run as ``steps``: a list of steps, each a list
    of ``(first, count)`` chunks of that sequence's tokens (count 1 after the first chunk of
    a step is a decode only when it comes first), each chunk with random decodes of other
    contexts beside it; ``scales``: an FP8 pool's; ``window``: the sliding window. Returns
    the ``[L, heads, head_dim]`` outputs, each token's from the step that computed it."""
    out = torch.empty_like(query)
    for first, count, decode in steps:
        others = 3
        tables = torch.stack([block_table] * (others + 1))
        lens = [first + count] + [1 + (7 * i + first) % len(query) for i in range(others)]
        other_queries = query.new_ones(others, *query.shape[1:])
        queries = torch.cat([query[first:first + count], other_queries])
        if decode:  # this token and the others all decodes
            order = list(range(others + 1))
            starts = torch.arange(others + 2)
            num_decodes = others + 1
        else:  # the others as decodes first, then this chunk as a prefill
            order = [*range(1, others + 1), 0]
            queries = torch.cat([other_queries, query[first:first + count]])
            starts = torch.tensor([0, *range(1, others + 1), others + count])
            num_decodes = others
        metadata = AttentionMetadata(torch.empty(0, dtype=torch.long), tables[order],
                                     torch.tensor(lens)[order], starts, num_decodes,
                                     max_query_len=count)
        result = cpu_attention.paged_attention(queries, k_cache, v_cache, metadata, scale,
                                               *scales, sliding_window=window)
        out[first:first + count] = result[:count] if decode else result[others:]
    return out


@settings(max_examples=25, deadline=None)
@given(length=st.integers(1, 90), cuts=st.lists(st.integers(1, 89), max_size=4),
       decoded_tail=st.integers(0, 12), bf16=st.booleans(), fp8=st.booleans(),
       shape=st.sampled_from([(3, 3, 64), (2, 1, 40), (1, 8, 128)]),
       window=st.sampled_from([None, 1, 7, 16, 17, 40]))
def test_a_token_has_the_same_bits_decoded_or_prefilled_in_any_chunk(length, cuts,
                                                                      decoded_tail, bf16, fp8,
                                                                      shape, window):
    # Exact log-probs rest on this: a token's attention is bitwise the same whether its
    # step decodes it, prefills it inside one prompt-long chunk, or inside any chunk after
    # a cached prefix, whatever sequences share the step, and whatever its sliding window
    # (a tile reads from its first token's window; each row weights the keys before its own
    # 0). Mutating either kernel's reduction order (the decode's dot product, a tile's
    # score or value sums) fails it.
    num_kv_heads, group, head_dim = shape
    dtype = torch.bfloat16 if bf16 else torch.float32
    generator = torch.Generator().manual_seed(length)
    num_blocks = (length + 15) // 16 + 2
    k_cache, v_cache = (torch.randn(num_blocks, 16, num_kv_heads, head_dim,
                                    generator=generator).to(dtype) for _ in range(2))
    query = torch.randn(length, num_kv_heads * group, head_dim, generator=generator).to(dtype)
    block_table = torch.randperm(num_blocks, generator=generator)
    scales = ()
    if fp8:  # an FP8 pool, each KV head with its own scale
        scales = tuple(torch.rand(num_kv_heads, generator=generator) + 0.5 for _ in range(2))
        k_cache, v_cache = (fp8_pool(cache, scale)[0] for cache, scale in
                            zip((k_cache, v_cache), scales))
    attend = functools.partial(attend_positions, query, k_cache, v_cache, block_table,
                               scales=scales, window=window)
    whole = attend([(0, length, False)])
    bounds = sorted({0, *(c for c in cuts if c < length), length})
    prefill_end = max(1, length - decoded_tail)
    chunks = [(a, min(b, prefill_end) - a, False) for a, b in zip(bounds, bounds[1:])
              if a < prefill_end]
    decodes = [(t, 1, True) for t in range(prefill_end, length)]
    chunked = attend(chunks + decodes)
    every_decode = attend([(t, 1, True) for t in range(length)])
    assert torch.equal(chunked, whole)
    assert torch.equal(every_decode, whole)
