"""Paged attention kernels, every backend, against attention from its definition in float64;
over an FP8 pool, against float64 attention over the values it holds, dequantized; under a
sliding window, against float64 attention over each query's window alone."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import TORCH_OPS, AttentionMetadata, CascadeLayout, block_runs, pool_layout
from tandem.kernels.fp8_kv import FP8_MAX, quantize
from tandem.kernels.testing import TOLERANCE, kernel_backends, relative_error
from tandem.rollout.core.block_manager import num_blocks_for

# On a CPU the Triton kernels run in Triton's interpreter (conftest switches it on).
BACKENDS = kernel_backends(torch.device("cpu"))
BLOCK_SIZE = 16
HEAD_DIM = 32
# Sliding windows: one key, a block, a block plus one, shorter than most contexts, longer
# than every context.
WINDOWS = [1, BLOCK_SIZE, BLOCK_SIZE + 1, 30, 100]
# Decodes and prefills of different lengths: contexts of one token, a block, a block plus
# one, several blocks; a whole prompt, chunks after earlier keys, a chunk ending on a block
# boundary, a chunk longer than a query tile.
WINDOW_DECODES = [1, 16, 17, 40]
WINDOW_PREFILLS = [(19, 19), (5, 37), (32, 48), (40, 70)]


def shuffled_block_tables(context_lens: list[int], num_blocks: int,
                          generator: torch.Generator) -> torch.Tensor:
    """Each sequence's blocks drawn from a shuffled pool, padded with block 0."""
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = []
    for context_len in context_lens:
        count = num_blocks_for(context_len, BLOCK_SIZE)
        tables.append(order[:count])
        order = order[count + 1:]  # skip one: a sequence's blocks are not a contiguous run
    width = max(len(table) for table in tables)
    return torch.tensor([table + [0] * (width - len(table)) for table in tables])


def paged_batch(decode_lens: list[int], prefills: list[tuple[int, int]], num_kv_heads: int,
                group: int, dtype: torch.dtype, seed: int = 0, head_dim: int = HEAD_DIM):
    """A random pool and a step of decodes (context lengths) then prefills (query, context)."""
    generator = torch.Generator().manual_seed(seed)
    context_lens = decode_lens + [context for _, context in prefills]
    query_lens = [1] * len(decode_lens) + [query for query, _ in prefills]
    num_blocks = sum(num_blocks_for(c, BLOCK_SIZE) + 1 for c in context_lens) + 3
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=generator).to(dtype)
    v_cache = torch.randn(cache_shape, generator=generator).to(dtype)
    query = torch.randn(sum(query_lens), num_kv_heads * group, head_dim,
                        generator=generator).to(dtype)
    cu_seqlens_q = torch.tensor([0] + query_lens).cumsum(0)
    metadata = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long),
        block_tables=shuffled_block_tables(context_lens, num_blocks, generator),
        context_lens=torch.tensor(context_lens), cu_seqlens_q=cu_seqlens_q,
        num_decodes=len(decode_lens), max_query_len=max(query_lens))
    return query, k_cache, v_cache, metadata


def float64_attention(query, k_cache, v_cache, metadata, scale, window=None) -> torch.Tensor:
    """Each query token's softmax over its sequence's keys, token by token, in float64; with
    a ``window`` W, over the keys q - W < k <= q of the token at position q alone."""
    out = torch.empty(query.shape, dtype=torch.float64)
    group = query.shape[1] // k_cache.shape[2]
    starts = metadata.cu_seqlens_q.tolist()
    for s, context_len in enumerate(metadata.context_lens.tolist()):
        blocks = metadata.block_tables[s].tolist()
        slots = [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                 for p in range(context_len)]
        keys, values = (cache.flatten(0, 1)[slots].double().repeat_interleave(group, dim=1)
                        for cache in (k_cache, v_cache))
        first_position = context_len - (starts[s + 1] - starts[s])
        for i, t in enumerate(range(starts[s], starts[s + 1])):
            visible = first_position + i + 1
            first = max(0, visible - window) if window else 0
            scores = torch.einsum("hd,khd->hk", query[t].double(), keys[first:visible]) * scale
            out[t] = torch.einsum("hk,khd->hd", scores.softmax(-1), values[first:visible])
    return out


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` stored as the engine stores its pool (``pool_layout``), same logical view."""
    storage, order = pool_layout(cache.shape)
    return cache.permute(2, 0, 1, 3).contiguous().view(storage).permute(order)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", TOLERANCE, ids=str)
@pytest.mark.parametrize("num_kv_heads,group", [(2, 1), (2, 3), (1, 8)])
def test_mixed_decode_and_prefill_step_matches_float64(backend, dtype, num_kv_heads, group):
    # Decode contexts 1, one block, a block plus one; prefills: a whole prompt, a chunk whose
    # earlier keys are already in the pool, and a chunk ending on a block boundary.
    query, k_cache, v_cache, metadata = paged_batch(
        [1, 16, 17], [(19, 19), (5, 37), (32, 48)], num_kv_heads, group, dtype)
    reference = float64_attention(query, k_cache, v_cache, metadata, 0.125)
    for k_pool, v_pool in ((k_cache, v_cache), (head_major(k_cache), head_major(v_cache))):
        out = BACKENDS[backend].paged_attention(query, k_pool, v_pool, metadata, 0.125)
        assert out.dtype == dtype
        assert relative_error(out, reference) < TOLERANCE[dtype]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", WINDOWS)
def test_a_sliding_window_step_matches_float64_over_each_window(backend, window):
    # (bfloat16 under a window: tests/test_cpu_attention.py, the kernels that convert it.)
    query, k_cache, v_cache, metadata = paged_batch(WINDOW_DECODES, WINDOW_PREFILLS, 2, 3,
                                                    torch.float32)
    reference = float64_attention(query, k_cache, v_cache, metadata, 0.125, window)
    out = BACKENDS[backend].paged_attention(query, head_major(k_cache), head_major(v_cache),
                                            metadata, 0.125, sliding_window=window)
    assert relative_error(out, reference) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("window", [1, BLOCK_SIZE + 1, 30])
def test_the_batch_invariant_attention_holds_a_sliding_window(window):
    from tandem.kernels.triton_attention import batch_invariant_attention

    query, k_cache, v_cache, metadata = paged_batch(WINDOW_DECODES, WINDOW_PREFILLS, 2, 3,
                                                    torch.float32, seed=4)
    reference = float64_attention(query, k_cache, v_cache, metadata, 0.125, window)
    out = batch_invariant_attention(query, head_major(k_cache), head_major(v_cache), metadata,
                                    0.125, sliding_window=window)
    assert relative_error(out, reference) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [1, BLOCK_SIZE, BLOCK_SIZE + 1])
def test_the_blocks_before_a_window_are_never_read(backend, window):
    # Every block wholly before the first key any query of its sequence sees holds NaN: a
    # kernel that read one, even to weight it 0, would return NaN. (Block 0 pads the block
    # tables, which the torch decode reads masked, so it keeps its values.)
    query, k_cache, v_cache, metadata = paged_batch(WINDOW_DECODES, WINDOW_PREFILLS, 2, 3,
                                                    torch.float32, seed=5)
    reference = float64_attention(query, k_cache, v_cache, metadata, 0.125, window)
    query_lens, unread = metadata.cu_seqlens_q.diff().tolist(), []
    for s, context_len in enumerate(metadata.context_lens.tolist()):
        first_key = max(0, context_len - query_lens[s] - window + 1)
        unread += metadata.block_tables[s, :first_key // BLOCK_SIZE].tolist()
    unread = [block for block in unread if block != 0]
    assert unread
    for cache in (k_cache, v_cache):
        cache[unread] = float("nan")
    out = BACKENDS[backend].paged_attention(query, head_major(k_cache), head_major(v_cache),
                                            metadata, 0.125, sliding_window=window)
    assert relative_error(out, reference) < TOLERANCE[torch.float32]


def cascade_batch(dtype: torch.dtype) -> tuple:
    """Seven decodes: four sharing three blocks, two sharing one, one alone; as a plain
    batch and with the ``CascadeLayout`` that groups them."""
    generator = torch.Generator().manual_seed(3)
    num_kv_heads, group = 2, 3
    cache_shape = (40, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    k_cache, v_cache = (head_major(torch.randn(cache_shape, generator=generator).to(dtype))
                        for _ in range(2))
    shared_a, shared_b = [7, 2, 30], [11]
    tables = [shared_a + [3], shared_a + [4, 5], shared_a + [6], shared_a + [8],
              shared_b + [12], shared_b + [13, 14], [20, 21]]
    context_lens = [49, 70, 64, 60, 17, 40, 20]
    metadata = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long), block_tables=padded(tables),
        context_lens=torch.tensor(context_lens), cu_seqlens_q=torch.arange(8),
        num_decodes=7)
    skipped = [3, 3, 3, 3, 1, 1, 0]
    layout = CascadeLayout(
        own=block_runs(padded([t[n:] for t, n in zip(tables, skipped)]),
                       torch.tensor([c - n * BLOCK_SIZE for c, n in zip(context_lens, skipped)]),
                       BLOCK_SIZE),
        shared=block_runs(padded([shared_a, shared_b, []]),
                          torch.tensor([3 * BLOCK_SIZE, BLOCK_SIZE, 0]), BLOCK_SIZE),
        members=torch.tensor([[0, 1, 2, 3], [4, 5, 4, 4], [6, 6, 6, 6]]),
        member_slots=torch.tensor([0, 1, 2, 3, 4, 5, 8]))
    query = torch.randn(7, num_kv_heads * group, HEAD_DIM, generator=generator).to(dtype)
    return query, k_cache, v_cache, metadata, layout


def padded(rows: list[list[int]]) -> torch.Tensor:
    width = max(map(len, rows))
    return torch.tensor([row + [0] * (width - len(row)) for row in rows])


@pytest.mark.parametrize("dtype", TOLERANCE, ids=str)
def test_cascade_over_shared_blocks_matches_float64(dtype):
    query, k_cache, v_cache, metadata, layout = cascade_batch(dtype)
    reference = float64_attention(query, k_cache, v_cache, metadata, 0.125)
    metadata.cascade = layout
    out = TORCH_OPS.paged_attention(query, k_cache, v_cache, metadata, 0.125)
    assert out.dtype == dtype
    assert relative_error(out, reference) < TOLERANCE[dtype]


@pytest.mark.parametrize("window", [20, 64, 100])
def test_the_cascade_holds_a_sliding_window(window):
    # A window inside every context, inside some, and longer than every one (the cascade
    # proper, the window a no-op).
    query, k_cache, v_cache, metadata, layout = cascade_batch(torch.float32)
    reference = float64_attention(query, k_cache, v_cache, metadata, 0.125, window)
    metadata.cascade = layout
    out = TORCH_OPS.paged_attention(query, k_cache, v_cache, metadata, 0.125,
                                    sliding_window=window)
    assert relative_error(out, reference) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", TOLERANCE, ids=str)
@pytest.mark.parametrize("num_splits", [1, 3, 16])
def test_split_decode_matches_float64(dtype, num_splits):
    from tandem.kernels.triton_attention import paged_decode_attention

    query, k_cache, v_cache, metadata = paged_batch([1, 64, 150], [], 2, 3, dtype, seed=1)
    out = paged_decode_attention(query, k_cache, v_cache, metadata.block_tables,
                                 metadata.context_lens, 0.2, num_splits=num_splits)
    reference = float64_attention(query, k_cache, v_cache, metadata, 0.2)
    assert relative_error(out, reference) < TOLERANCE[dtype]


@pytest.mark.parametrize("num_splits", [1, 3, 16])
def test_split_decode_splits_its_window_alone(num_splits):
    # A window shorter than two of the contexts, split among as many programs as the whole.
    from tandem.kernels.triton_attention import paged_decode_attention

    query, k_cache, v_cache, metadata = paged_batch([1, 64, 150], [], 2, 3, torch.float32,
                                                    seed=1)
    out = paged_decode_attention(query, k_cache, v_cache, metadata.block_tables,
                                 metadata.context_lens, 0.2, num_splits=num_splits,
                                 sliding_window=BLOCK_SIZE + 1)
    reference = float64_attention(query, k_cache, v_cache, metadata, 0.2, BLOCK_SIZE + 1)
    assert relative_error(out, reference) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_of_an_empty_context_is_zero(num_splits):
    from tandem.kernels.triton_attention import paged_decode_attention

    query, k_cache, v_cache, metadata = paged_batch([20, 20], [], 2, 2, torch.float32)
    context_lens = torch.tensor([20, 0])
    out = paged_decode_attention(query, k_cache, v_cache, metadata.block_tables, context_lens,
                                 0.2, num_splits=num_splits)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    reference = float64_attention(query, k_cache, v_cache, metadata, 0.2)
    assert relative_error(out[:1], reference[:1]) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", TOLERANCE, ids=str)
def test_store_kv_writes_each_slot_and_skips_padding(backend, dtype):
    generator = torch.Generator().manual_seed(2)
    k_cache = torch.randn(6, BLOCK_SIZE, 3, HEAD_DIM, generator=generator).to(dtype)
    v_cache = torch.randn(6, BLOCK_SIZE, 3, HEAD_DIM, generator=generator).to(dtype)
    slot_mapping = torch.tensor([17, -1, 0, 95, 40, -1, 16])
    key = torch.randn(7, 3, HEAD_DIM, generator=generator).to(dtype)
    value = torch.randn(7, 3, HEAD_DIM, generator=generator).to(dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    written = slot_mapping >= 0
    expected_k.view(-1, 3, HEAD_DIM)[slot_mapping[written]] = key[written]
    expected_v.view(-1, 3, HEAD_DIM)[slot_mapping[written]] = value[written]
    BACKENDS[backend].store_kv(key, value, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def fp8_pool(cache: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``cache`` ``[blocks, block_size, kv_heads, head_dim]`` stored in FP8 by ``scale``, and
    what it holds, dequantized in float64 (the values every kernel must attend over)."""
    stored = quantize(cache.flatten(0, 1), scale).view(cache.shape)
    return stored, stored.double() * scale.double()[:, None]


def fp8_batch(decode_lens, prefills, num_kv_heads, group, dtype, seed=0):
    """``paged_batch`` with its pool stored in FP8 (head-major, as the engine's) by scales
    that differ per KV head, and its float64 dequantized values."""
    query, k_cache, v_cache, metadata = paged_batch(decode_lens, prefills, num_kv_heads, group,
                                                    dtype, seed)
    generator = torch.Generator().manual_seed(seed + 100)
    k_scale, v_scale = (torch.rand(num_kv_heads, generator=generator) + 0.25 for _ in range(2))
    # Keys spread over e4m3's range, a few beyond 448 (saturated), some below 2^-6.
    k_cache = k_cache * torch.exp2(torch.randint(-8, 9, k_cache.shape, generator=generator))
    (k_pool, k_values), (v_pool, v_values) = fp8_pool(k_cache, k_scale), fp8_pool(v_cache, v_scale)
    return query, head_major(k_pool), head_major(v_pool), (k_scale, v_scale), metadata, \
        k_values, v_values


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_kv_heads,group", [(2, 3), (1, 8)])
def test_an_fp8_pool_is_attended_as_float64_attends_its_dequantized_values(
        backend, dtype, num_kv_heads, group):
    query, k_pool, v_pool, scales, metadata, k_values, v_values = fp8_batch(
        [1, 16, 17], [(19, 19), (5, 37), (32, 48)], num_kv_heads, group, dtype)
    assert (k_values.abs() == FP8_MAX * scales[0].double()[:, None]).any()  # saturated
    reference = float64_attention(query, k_values, v_values, metadata, 0.125)
    out = BACKENDS[backend].paged_attention(query, k_pool, v_pool, metadata, 0.125, *scales)
    assert out.dtype == dtype
    assert relative_error(out, reference) < TOLERANCE[dtype]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sliding_window_over_an_fp8_pool_matches_float64_of_its_values(backend):
    query, k_pool, v_pool, scales, metadata, k_values, v_values = fp8_batch(
        WINDOW_DECODES, WINDOW_PREFILLS, 2, 3, torch.float32)
    reference = float64_attention(query, k_values, v_values, metadata, 0.125, BLOCK_SIZE + 1)
    out = BACKENDS[backend].paged_attention(query, k_pool, v_pool, metadata, 0.125, *scales,
                                            sliding_window=BLOCK_SIZE + 1)
    assert relative_error(out, reference) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("num_splits", [1, 3])
def test_the_split_decode_and_batch_invariant_attention_read_an_fp8_pool(num_splits):
    from tandem.kernels.triton_attention import batch_invariant_attention, paged_decode_attention

    query, k_pool, v_pool, scales, metadata, k_values, v_values = fp8_batch(
        [1, 64, 150], [(5, 37)], 2, 3, torch.float32, seed=1)
    reference = float64_attention(query, k_values, v_values, metadata, 0.2)
    decodes = paged_decode_attention(query[:3], k_pool, v_pool, metadata.block_tables[:3],
                                     metadata.context_lens[:3], 0.2, num_splits=num_splits,
                                     k_scale=scales[0], v_scale=scales[1])
    assert relative_error(decodes, reference[:3]) < TOLERANCE[torch.float32]
    every = batch_invariant_attention(query, k_pool, v_pool, metadata, 0.2, *scales)
    assert relative_error(every, reference) < TOLERANCE[torch.float32]


def test_the_cascade_reads_an_fp8_pool():
    query, k_cache, v_cache, metadata, layout = cascade_batch(torch.float32)
    scales = torch.tensor([0.5, 2.0]), torch.tensor([0.25, 1.5])
    (k_pool, k_values), (v_pool, v_values) = (fp8_pool(cache, scale) for cache, scale in
                                              zip((k_cache, v_cache), scales))
    reference = float64_attention(query, k_values, v_values, metadata, 0.125)
    metadata.cascade = layout
    out = TORCH_OPS.paged_attention(query, head_major(k_pool), head_major(v_pool), metadata,
                                    0.125, *scales)
    assert relative_error(out, reference) < TOLERANCE[torch.float32]
