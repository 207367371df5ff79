"""Attention sinks (GPT-OSS) and logit soft-capping (Gemma 2) in every attention backend,
against attention from its definition in float64 (the scaled scores soft-capped, masked
causal and to the window, each head's sink one more column of the softmax, dropped after
it): decodes and prefill chunks after a cached prefix in one step, GQA, with and without a
sliding window, bfloat16, an FP8 pool, the torch cascade, Triton's split decode; a token's
bits alone or in any batch (the batch-invariant kernels); the training twin's forward (the
engine's bits) and backward (autograd through the float64 reference, the sinks' gradient
included); the model's attention passes a layer's sinks and cap to its kernels."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.kernels import TORCH_OPS, AttentionMetadata, select_kernels
from tandem.kernels.differentiable import training_ops
from tandem.kernels.testing import TOLERANCE, relative_error
from tandem.rollout import LLM, SamplingParams

from .test_attention import (
    BACKENDS,
    BLOCK_SIZE,
    WINDOW_DECODES,
    WINDOW_PREFILLS,
    cascade_batch,
    fp8_batch,
    head_major,
    paged_batch,
)

CPU = torch.device("cpu")
SCALE = 0.125
# Scores here are about N(0, 0.7): a cap of 1.5 bends most of them.
SOFTCAP = 1.5
# Each feature alone, and both.
FEATURES = {"sinks": (True, None), "softcap": (False, SOFTCAP), "both": (True, SOFTCAP)}
WINDOWS = [None, BLOCK_SIZE + 1]


def random_sinks(num_heads: int, seed: int = 0, dtype: torch.dtype = torch.float32):
    """One sink logit per head, spread around the scores' range (some dominate a row)."""
    generator = torch.Generator().manual_seed(seed + 50)
    return (torch.randn(num_heads, generator=generator) * 2).to(dtype)


def float64_rows(query, keys, values, first_position, scale, window=None, sinks=None,
                 softcap=None) -> torch.Tensor:
    """Attention of ``query`` ``[q, heads, head_dim]`` (positions ``first_position`` on)
    over one sequence's ``keys``/``values`` ``[k, kv_heads, head_dim]`` (positions 0 on),
    as transformers' eager attention writes it, in float64: the scaled scores soft-capped,
    masked (causal, within the window), each head's sink one more column, softmax, that
    column dropped. Differentiable."""
    group = query.shape[1] // keys.shape[1]
    keys, values = (t.double().repeat_interleave(group, 1) for t in (keys, values))
    scores = torch.einsum("qhd,khd->hqk", query.double(), keys) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    query_pos = torch.arange(first_position, first_position + query.shape[0])[:, None]
    key_pos = torch.arange(keys.shape[0])[None, :]
    visible = key_pos <= query_pos
    if window is not None:
        visible &= key_pos > query_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        column = sinks.double()[:, None, None].expand(-1, query.shape[0], 1)
        scores = torch.cat([scores, column], dim=-1)
    probs = scores.softmax(-1)[..., :keys.shape[0]]
    return torch.einsum("hqk,khd->qhd", probs, values)


def float64_paged(query, k_cache, v_cache, metadata, scale, window=None, sinks=None,
                  softcap=None) -> torch.Tensor:
    """``float64_rows`` of each sequence of a paged step, its keys read by its block table
    (``k_cache``/``v_cache`` ``[blocks, BLOCK_SIZE, kv_heads, head_dim]``)."""
    out = torch.empty(query.shape, dtype=torch.float64)
    starts = metadata.cu_seqlens_q.tolist()
    for s, context_len in enumerate(metadata.context_lens.tolist()):
        blocks = metadata.block_tables[s].tolist()
        slots = [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                 for p in range(context_len)]
        keys, values = (cache.flatten(0, 1)[slots] for cache in (k_cache, v_cache))
        rows = slice(starts[s], starts[s + 1])
        out[rows] = float64_rows(query[rows], keys, values,
                                 context_len - (rows.stop - rows.start), scale, window, sinks,
                                 softcap)
    return out


def features(name: str, num_heads: int, seed: int = 0, dtype: torch.dtype = torch.float32):
    """The keyword arguments of feature set ``name`` (``FEATURES``)."""
    with_sinks, softcap = FEATURES[name]
    return dict(sinks=random_sinks(num_heads, seed, dtype) if with_sinks else None,
                softcap=softcap)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("feature", FEATURES)
def test_a_mixed_step_matches_float64(backend, window, feature):
    # Decodes of one token, a block, a block plus one, several blocks; a whole prompt and
    # chunks after a cached prefix; GQA (2 KV heads of 3 query heads).
    query, k_cache, v_cache, metadata = paged_batch(WINDOW_DECODES, WINDOW_PREFILLS, 2, 3,
                                                    torch.float32, seed=11)
    kwargs = features(feature, query.shape[1])
    reference = float64_paged(query, k_cache, v_cache, metadata, SCALE, window, **kwargs)
    plain = float64_paged(query, k_cache, v_cache, metadata, SCALE, window)
    assert relative_error(plain, reference) > 0.02  # not vacuous
    out = BACKENDS[backend].paged_attention(query, head_major(k_cache), head_major(v_cache),
                                            metadata, SCALE, sliding_window=window, **kwargs)
    assert relative_error(out, reference) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_kv_heads,group", [(2, 1), (1, 8)])
def test_bfloat16_queries_and_sinks_match_float64(backend, num_kv_heads, group):
    query, k_cache, v_cache, metadata = paged_batch([1, 17], [(19, 19), (5, 37)], num_kv_heads,
                                                    group, torch.bfloat16, seed=12)
    kwargs = features("both", query.shape[1], dtype=torch.bfloat16)
    reference = float64_paged(query, k_cache, v_cache, metadata, SCALE, **kwargs)
    out = BACKENDS[backend].paged_attention(query, head_major(k_cache), head_major(v_cache),
                                            metadata, SCALE, **kwargs)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, reference) < TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", WINDOWS)
def test_an_fp8_pool_matches_float64_of_its_values(backend, window):
    # The key scale folds into the scores before the cap: the cap sees the true scores.
    query, k_pool, v_pool, scales, metadata, k_values, v_values = fp8_batch(
        WINDOW_DECODES, WINDOW_PREFILLS, 2, 3, torch.float32, seed=13)
    kwargs = features("both", query.shape[1])
    reference = float64_paged(query, k_values, v_values, metadata, SCALE, window, **kwargs)
    out = BACKENDS[backend].paged_attention(query, k_pool, v_pool, metadata, SCALE, *scales,
                                            sliding_window=window, **kwargs)
    assert relative_error(out, reference) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_decode_of_an_empty_context_with_a_sink_is_zero(backend):
    # Graph padding (context 0): the sink alone in the softmax weights no value.
    query, k_cache, v_cache, metadata = paged_batch([20, 20], [], 2, 2, torch.float32)
    kwargs = features("both", query.shape[1])
    reference = float64_paged(query, k_cache, v_cache, metadata, SCALE, **kwargs)[:1]
    metadata.context_lens = torch.tensor([20, 0])
    out = BACKENDS[backend].paged_attention(query, k_cache, v_cache, metadata, SCALE, **kwargs)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert relative_error(out[:1], reference) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("window", [None, 20, 64])
def test_the_cascade_counts_each_decodes_sink_once(window):
    # The shared blocks' scores and each decode's own join one softmax with one sink.
    query, k_cache, v_cache, metadata, layout = cascade_batch(torch.float32)
    kwargs = features("both", query.shape[1])
    reference = float64_paged(query, k_cache, v_cache, metadata, SCALE, window, **kwargs)
    metadata.cascade = layout
    out = TORCH_OPS.paged_attention(query, k_cache, v_cache, metadata, SCALE,
                                    sliding_window=window, **kwargs)
    assert relative_error(out, reference) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("num_splits", [1, 3, 16])
@pytest.mark.parametrize("window", WINDOWS)
def test_the_split_decode_counts_the_sink_once(num_splits, window):
    # Contexts of 0 (padding: zeros), one key, shorter and longer than the splits' keys.
    from tandem.kernels.triton_attention import paged_decode_attention

    query, k_cache, v_cache, metadata = paged_batch([1, 1, 64, 150], [], 2, 3, torch.float32,
                                                    seed=14)
    kwargs = features("both", query.shape[1])
    context_lens = torch.tensor([0, 1, 64, 150])
    out = paged_decode_attention(query, k_cache, v_cache, metadata.block_tables, context_lens,
                                 SCALE, num_splits=num_splits, sliding_window=window, **kwargs)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    reference = float64_paged(query, k_cache, v_cache, metadata, SCALE, window, **kwargs)
    assert relative_error(out[1:], reference[1:]) < TOLERANCE[torch.float32]


def batch_invariant(backend: str):
    """The engine's batch-invariant attention of ``backend`` (exact log-probs)."""
    return select_kernels(backend, CPU, exact=True).paged_attention


def one_sequence_step(query, prefix, block_table, others):
    """Metadata and queries of a step: ``others`` decodes (contexts) then ``query``'s tokens
    as one chunk after ``prefix`` cached tokens of the sequence of ``block_table``."""
    num_others, count = len(others), query.shape[0]
    tables = torch.stack([block_table] * (num_others + 1))
    filler = torch.ones(num_others, *query.shape[1:], dtype=query.dtype)
    metadata = AttentionMetadata(
        torch.empty(0, dtype=torch.long), tables, torch.tensor([*others, prefix + count]),
        torch.tensor([*range(num_others + 1), num_others + count]), num_others,
        max_query_len=count)
    return torch.cat([filler, query]), metadata


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@settings(max_examples=12, deadline=None)
@given(length=st.integers(2, 40), cut=st.integers(1, 39), position=st.integers(0, 39),
       window=st.sampled_from([None, 1, 7, 17]), feature=st.sampled_from(list(FEATURES)),
       bf16=st.booleans(), others=st.lists(st.integers(1, 40), max_size=3))
def test_a_tokens_bits_never_depend_on_its_batch_or_chunk(backend, length, cut, position,
                                                          window, feature, bf16, others):
    # Exact log-probs: a token's attention, sink and cap included, has the same bits as a
    # decode alone, inside the whole prompt, or inside a chunk after a cached prefix
    # beside other sequences' decodes.
    cut, position = min(cut, length - 1), min(position, length - 1)
    dtype = torch.bfloat16 if bf16 else torch.float32
    generator = torch.Generator().manual_seed(length)
    num_blocks = 3  # 48 slots: every context here (40 at most)
    k_cache, v_cache = (torch.randn(num_blocks, BLOCK_SIZE, 2, 32, generator=generator)
                        .to(dtype) for _ in range(2))
    query = torch.randn(length, 6, 32, generator=generator).to(dtype)
    block_table = torch.randperm(num_blocks, generator=generator)
    attend = batch_invariant(backend)
    kwargs = dict(sliding_window=window, **features(feature, 6, dtype=dtype))

    def run(first: int, count: int, beside: list[int]) -> torch.Tensor:
        queries, metadata = one_sequence_step(query[first:first + count], first, block_table,
                                              beside)
        return attend(queries, k_cache, v_cache, metadata, SCALE, **kwargs)[len(beside):]

    whole = run(0, length, [])
    assert torch.equal(run(cut, length - cut, others), whole[cut:])
    assert torch.equal(run(position, 1, others), whole[position:position + 1])


def stream(lengths: list[int], group: int, seed: int):
    """A trainer's flat stream of sequences of ``lengths``: float32 q, k, v that require
    grad (2 KV heads of ``group`` query heads) and its metadata."""
    generator = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    q, k, v = (torch.randn(tokens, heads, 16, generator=generator).requires_grad_()
               for heads in (2 * group, 2, 2))
    metadata = AttentionMetadata(torch.empty(0, dtype=torch.long), torch.empty(0),
                                 torch.tensor(lengths), torch.tensor([0, *lengths]).cumsum(0),
                                 0, max_query_len=max(lengths))
    return q, k, v, metadata


def float64_stream(query, key, value, cu_seqlens, window=None, sinks=None, softcap=None):
    """``float64_rows`` of each sequence of a flat stream over its own keys."""
    bounds = cu_seqlens.tolist()
    return torch.cat([float64_rows(query[a:b], key[a:b], value[a:b], 0, SCALE, window, sinks,
                                   softcap) for a, b in zip(bounds, bounds[1:])])


def engine_attention(kernels, q, k, v, lengths, **kwargs) -> torch.Tensor:
    """The engine's attention of the stream: its K/V stored into a pool of 4-token blocks
    (each sequence's its own), every sequence a prefill."""
    tables, slots, block = [], [], 0
    for length in lengths:
        count = -(-length // 4)
        tables.append(list(range(block, block + count)))
        slots += [block * 4 + t for t in range(length)]
        block += count
    k_pool, v_pool = (torch.zeros(block, 4, *t.shape[1:]) for t in (k, v))
    kernels.store_kv(k.detach(), v.detach(), k_pool, v_pool, torch.tensor(slots))
    width = max(map(len, tables))
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0)
    metadata = AttentionMetadata(
        torch.tensor(slots), torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        torch.tensor(lengths), cu_seqlens, 0, max_query_len=max(lengths))
    return kernels.paged_attention(q.detach(), k_pool, v_pool, metadata, SCALE, **kwargs)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("feature", FEATURES)
def test_the_training_twin_has_the_engines_bits_and_autograds_gradients(backend, window,
                                                                        feature):
    lengths, group = [7, 1, 20], 3
    kernels = select_kernels(backend, CPU, exact=True)
    q, k, v, metadata = stream(lengths, group, seed=15)
    kwargs = features(feature, 2 * group)
    if kwargs["sinks"] is not None:
        kwargs["sinks"] = torch.nn.Parameter(kwargs["sinks"])
    out = training_ops(kernels).causal_attention(q, k, v, metadata, SCALE,
                                                 sliding_window=window, **kwargs)
    assert torch.equal(out, engine_attention(kernels, q, k, v, lengths, sliding_window=window,
                                             **kwargs))
    # The gradients of q, k, v and the sinks against autograd through the float64 reference.
    trained = [t for t in (q, k, v, kwargs["sinks"]) if t is not None]
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(16))
    grads = torch.autograd.grad(out, trained, grad)
    doubles = [t.detach().double().requires_grad_() for t in trained]
    reference = float64_stream(*doubles[:3], metadata.cu_seqlens_q, window,
                               *doubles[3:], softcap=kwargs["softcap"])
    expected = torch.autograd.grad(reference, doubles, grad.double())
    for found, wanted in zip(grads, expected):
        assert relative_error(found, wanted) < 1e-5


def prompt_logprobs(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """Every prompt token's log-prob (after the first), flat."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return torch.tensor([logprob for output in outputs for entry in output.prompt_logprobs[1:]
                         for logprob in entry.values()])


def test_the_models_attention_passes_a_layers_sinks_and_cap(llama_dir):
    # A model whose layers have sinks (a parameter, as GPT-OSS's) and a cap attends with
    # them in the engine's paged attention: the C kernels agree with the torch reference,
    # and differ from the plain model.
    prompts = [[(7 * j) % 200 + 3 for j in range(30)], [5, 9, 2]]
    engines = {backend: LLM(str(llama_dir), attention_backend=backend, block_size=4)
               for backend in ("cpu", "torch")}
    plain = prompt_logprobs(engines["cpu"], prompts)
    for llm in engines.values():
        for index, layer in enumerate(llm.engine.runner.model.attention_layers()):
            layer.sinks = torch.nn.Parameter(random_sinks(layer.num_heads, index))
            layer.logit_softcap = SOFTCAP
    found = prompt_logprobs(engines["cpu"], prompts)
    assert not torch.allclose(found, plain, atol=1e-3)
    assert torch.allclose(found, prompt_logprobs(engines["torch"], prompts), atol=1e-5)
