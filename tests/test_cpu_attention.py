"""The compiled CPU decode attention against attention from its definition in float64, on
the inputs the engine gives it: strided query views, a head-major pool, long contexts."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import cpu_attention
from tandem.kernels.testing import TOLERANCE, relative_error

from .test_attention import float64_attention, head_major, paged_batch

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


def test_half_precision_and_mixed_dtypes_take_the_reference():
    query, k_cache, v_cache, metadata = paged_batch([5, 40], [(3, 9)], 2, 2, torch.float16)
    assert not cpu_attention.supports(query, k_cache)
    out = cpu_attention.paged_attention(query, k_cache, v_cache, metadata, 0.125)
    reference = float64_attention(query, k_cache, v_cache, metadata, 0.125)
    assert relative_error(out, reference) < TOLERANCE[torch.float16]
    assert not cpu_attention.supports(query.float(), k_cache)
