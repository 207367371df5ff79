"""The KV pool's size and the device-memory plan, pinned by their contracts.

No test restates the estimates: the plan's parts must add up to its share with the KV pool
taking the rest, only the KV pool moves with ``gpu_memory_utilization``, a share too small
is refused naming each part and the options that fix it; the pool honours ``num_kv_blocks``,
``kv_cache_memory_bytes`` and the CPU default, holds one max_model_len sequence, and its
blocks are as large as the pool the runner allocates.

On a faked CUDA device (torch's total and free memory patched, nothing else): for models
and options drawn by hypothesis, what the engine holds by the plan (weights, their staging
copy, activations, decode graphs and the KV pool it allocates) stays within
``gpu_memory_utilization`` x the device's total whatever is free, and a share that cannot
hold one max_model_len sequence is refused naming the options that fix it; an engine started
on the fake device (its runner built on the CPU) holds what it planned.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, LlamaConfig

from tandem.kernels.fp8_kv import FP8
from tandem.rollout import engine as engine_module
from tandem.rollout.config import EngineConfig, WorkerConfig
from tandem.rollout.core.block_manager import num_blocks_for
from tandem.rollout.core.scheduler import MAX_SCORED_TOKENS
from tandem.rollout.engine import LLMEngine
from tandem.rollout.worker.cuda_graphs import graph_batch_sizes
from tandem.rollout.worker.memory import (
    CPU_KV_CACHE_BYTES,
    activation_bytes,
    graph_pool_bytes,
    kv_block_bytes,
    plan_memory,
    size_kv_cache,
)
from tandem.rollout.worker.model_runner import ModelRunner

GIB = 1 << 30
CONFIG = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
BLOCK_SIZE = 16


def fixed_parts(plan) -> tuple[int, int, int, int]:
    return plan.weight_bytes, plan.staging_bytes, plan.activation_bytes, plan.graph_bytes


@settings(max_examples=300, deadline=None)
@given(total=st.integers(GIB, 200 * GIB), utilization=st.floats(0.01, 1.0),
       weights=st.integers(0, 16 * GIB), activations=st.integers(0, 8 * GIB),
       graphs=st.integers(0, GIB))
def test_plan_parts_add_up_to_the_share_and_the_kv_pool_gets_the_rest(
        total, utilization, weights, activations, graphs):
    share = plan_memory(total, utilization, 0, 0, 0).budget_bytes
    try:
        plan = plan_memory(total, utilization, weights, activations, graphs)
    except ValueError:
        assert share <= sum((weights, weights, activations, graphs))  # nothing was left
        return
    assert plan.budget_bytes == share <= total
    assert fixed_parts(plan) == (weights, weights, activations, graphs)  # staging: one copy
    assert plan.kv_cache_bytes > 0
    assert sum(fixed_parts(plan)) + plan.kv_cache_bytes == plan.budget_bytes


def test_only_the_kv_pool_shrinks_as_utilization_falls():
    plans = [plan_memory(80 * GIB, utilization, 2 * GIB, GIB, GIB // 2)
             for utilization in (0.9, 0.6, 0.3, 0.1)]
    for larger, smaller in zip(plans, plans[1:]):
        assert fixed_parts(smaller) == fixed_parts(larger)
        assert 0 < smaller.kv_cache_bytes < larger.kv_cache_bytes
        assert (larger.kv_cache_bytes - smaller.kv_cache_bytes
                == larger.budget_bytes - smaller.budget_bytes)


def test_fixed_parts_filling_the_whole_share_leave_nothing_and_are_refused():
    fixed = 2 * 3 * GIB + GIB + GIB // 2  # weights, their staging copy, activations, graphs
    with pytest.raises(ValueError, match="leaving nothing for the KV pool"):
        plan_memory(fixed, 1.0, 3 * GIB, GIB, GIB // 2)
    assert plan_memory(fixed + 1, 1.0, 3 * GIB, GIB, GIB // 2).kv_cache_bytes == 1


def test_share_too_small_names_each_part_and_the_options_that_fix_it():
    with pytest.raises(ValueError) as error:
        plan_memory(total_bytes=80 * GIB, utilization=0.05, weight_bytes=2 * GIB,
                    activations=GIB, graphs=GIB // 2)
    for fragment in ("gpu_memory_utilization=0.05 gives this engine 4.00 GiB",
                     "weights take 2.00 GiB", "staging a weight update 2.00 GiB",
                     "activations 1.00 GiB", "decode graphs 0.50 GiB", "nothing for the KV pool",
                     "raise gpu_memory_utilization", "max_num_batched_tokens", "max_num_seqs",
                     "enforce_eager=True"):
        assert fragment in str(error.value)


def test_plan_stats_name_every_part():
    plan = plan_memory(80 * GIB, 0.5, 2 * GIB, GIB, GIB // 2)
    assert plan.as_stats() == {
        "memory_budget_bytes": plan.budget_bytes, "memory_weight_bytes": 2 * GIB,
        "memory_staging_bytes": 2 * GIB, "memory_activation_bytes": GIB,
        "memory_graph_bytes": GIB // 2, "memory_kv_cache_bytes": plan.kv_cache_bytes}


def test_graph_pool_is_nothing_without_graphs_and_grows_with_the_largest_batch_and_count():
    assert graph_pool_bytes(CONFIG, []) == 0
    assert 0 < graph_pool_bytes(CONFIG, [8]) < graph_pool_bytes(CONFIG, [4, 8])
    assert graph_pool_bytes(CONFIG, [1, 2, 4, 8]) == graph_pool_bytes(CONFIG, [5, 6, 7, 8])
    assert graph_pool_bytes(CONFIG, [1, 2, 4, 8]) < graph_pool_bytes(CONFIG, [1, 2, 4, 16])


def test_activation_estimate_holds_the_hidden_states_and_logits_and_grows_with_the_step():
    # A step materialises at least every token's float32 hidden state and every sampled
    # sequence's float32 logits.
    for tokens, seqs in ((1, 1), (17, 3), (8192, 256)):
        estimate = activation_bytes(CONFIG, tokens, seqs)
        assert estimate >= 4 * (tokens * CONFIG.hidden_size + seqs * CONFIG.vocab_size)
        assert activation_bytes(CONFIG, tokens + 1, seqs) > estimate
        assert activation_bytes(CONFIG, tokens, seqs + 1) > estimate
        # and the float32 logits and log-probs of the prompt positions a step may score
        assert estimate >= 4 * 2 * MAX_SCORED_TOKENS * CONFIG.vocab_size


def cpu_config(**options) -> EngineConfig:
    return EngineConfig(model="unused", device="cpu", block_size=BLOCK_SIZE, **options)


def test_num_kv_blocks_is_taken_as_given_before_any_byte_budget():
    size = size_kv_cache(cpu_config(num_kv_blocks=40, kv_cache_memory_bytes=1), CONFIG,
                         torch.float32, max_model_len=64, weight_bytes=0, graph_sizes=[])
    assert (size.num_blocks, size.plan) == (40, None)


@pytest.mark.parametrize("options,budget", [({"kv_cache_memory_bytes": 10_000_000}, 10_000_000),
                                            ({}, CPU_KV_CACHE_BYTES)], ids=["bytes", "cpu"])
def test_byte_budget_buys_as_many_whole_blocks_as_fit(options, budget):
    size = size_kv_cache(cpu_config(**options), CONFIG, torch.float32, max_model_len=64,
                         weight_bytes=0, graph_sizes=[])
    assert size.plan is None
    assert size.num_blocks * size.block_bytes <= budget < (size.num_blocks + 1) * size.block_bytes


@pytest.mark.parametrize("max_model_len", [96, 97], ids=["block boundary", "block plus one"])
def test_pool_smaller_than_one_max_model_len_sequence_is_refused_naming_the_options(
        max_model_len):
    needed = num_blocks_for(max_model_len, BLOCK_SIZE)
    size = size_kv_cache(cpu_config(num_kv_blocks=needed), CONFIG, torch.float32,
                         max_model_len, weight_bytes=0, graph_sizes=[])
    assert size.num_blocks == needed
    too_small = (cpu_config(num_kv_blocks=needed - 1),
                 cpu_config(kv_cache_memory_bytes=(needed - 1) * size.block_bytes))
    for config in too_small:
        with pytest.raises(ValueError) as error:
            size_kv_cache(config, CONFIG, torch.float32, max_model_len, weight_bytes=0,
                          graph_sizes=[])
        for option in (f"max_model_len={max_model_len}", "num_kv_blocks", "kv_cache_memory_bytes",
                       "gpu_memory_utilization", "lower max_model_len"):
            assert option in str(error.value)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])  # qwen3: head_dim beyond hidden / heads
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_block_bytes_are_the_bytes_per_block_of_the_pool_the_runner_allocates(model_dir, kind,
                                                                               dtype,
                                                                               kv_cache_dtype):
    folder = model_dir(kind)
    hf_config = AutoConfig.from_pretrained(folder)
    config = WorkerConfig(str(folder), str(dtype).removeprefix("torch."), "cpu",
                          max_model_len=64, block_size=BLOCK_SIZE, eos_token_ids=(1,),
                          kv_cache_dtype=kv_cache_dtype)
    runner = ModelRunner(config, hf_config)
    runner.allocate_kv_cache(7)
    kv_dtype = FP8 if kv_cache_dtype == "fp8" else dtype
    assert runner.kv_cache.dtype == kv_dtype
    assert runner.kv_cache_bytes() == 7 * kv_block_bytes(hf_config, BLOCK_SIZE, kv_dtype)


def test_the_same_bytes_hold_twice_bfloat16s_blocks_and_four_times_float32s_in_fp8():
    blocks = {dtype: size_kv_cache(cpu_config(kv_cache_memory_bytes=GIB), CONFIG, dtype,
                                   max_model_len=64, weight_bytes=0, graph_sizes=[]).num_blocks
              for dtype in (torch.float32, torch.bfloat16, FP8)}
    assert blocks[FP8] == 2 * blocks[torch.bfloat16] == 4 * blocks[torch.float32]
    # one byte an element: layers x K and V x KV heads x head size x block size
    assert kv_block_bytes(CONFIG, BLOCK_SIZE, FP8) == 2 * 2 * 2 * 16 * BLOCK_SIZE


@contextmanager
def fake_cuda_device(total_bytes: int, free_bytes: int) -> Iterator[None]:
    """torch reports a CUDA device of ``total_bytes``, ``free_bytes`` of them free (a
    colocated trainer holds the rest), as ``get_device_properties`` and ``mem_get_info``."""
    properties = SimpleNamespace(total_memory=total_bytes)
    with mock.patch.object(torch.cuda, "get_device_properties", lambda device=None: properties), \
            mock.patch.object(torch.cuda, "mem_get_info",
                              lambda device=None: (free_bytes, total_bytes)):
        yield


@pytest.fixture
def fake_cuda() -> Iterator[None]:
    """A 16 GiB CUDA device, a quarter of it free."""
    with fake_cuda_device(16 * GIB, 4 * GIB):
        yield


def cuda_size(utilization: float | None, graph_sizes: list[int]):
    config = EngineConfig(model="unused", device="cuda", block_size=BLOCK_SIZE,
                          gpu_memory_utilization=utilization)
    return size_kv_cache(config, CONFIG, torch.bfloat16, max_model_len=512, weight_bytes=GIB,
                         graph_sizes=graph_sizes)


def test_cuda_pool_is_what_the_plan_of_total_memory_leaves(fake_cuda):
    size = cuda_size(0.5, [1, 2, 4, 8])
    defaults = EngineConfig(model="unused", device="cuda")
    activations = activation_bytes(CONFIG, defaults.max_num_batched_tokens,
                                   defaults.max_num_seqs)
    graphs = graph_pool_bytes(CONFIG, [1, 2, 4, 8])
    assert size.plan == plan_memory(16 * GIB, 0.5, GIB, activations, graphs)
    kv_bytes = size.plan.kv_cache_bytes
    assert size.num_blocks * size.block_bytes <= kv_bytes < (size.num_blocks + 1) * size.block_bytes


def test_cuda_utilization_defaults_to_nine_tenths_and_less_of_it_shrinks_the_pool(fake_cuda):
    assert cuda_size(None, []).plan == cuda_size(0.9, []).plan
    blocks = [cuda_size(utilization, []).num_blocks for utilization in (0.9, 0.5, 0.2)]
    assert blocks[0] > blocks[1] > blocks[2]


@st.composite
def decoders(draw: st.DrawFn) -> LlamaConfig:
    """A decoder from tiny to 70B-sized: grouped KV heads, a head dim of its own (as Qwen3's)."""
    kv_heads = draw(st.sampled_from([1, 2, 4, 8, 16]))
    hidden = 128 * draw(st.integers(1, 64))
    return LlamaConfig(
        vocab_size=draw(st.integers(256, 262_144)), hidden_size=hidden,
        intermediate_size=draw(st.integers(hidden, 4 * hidden)),
        num_hidden_layers=draw(st.integers(1, 80)),
        num_attention_heads=kv_heads * draw(st.sampled_from([1, 2, 4, 8])),
        num_key_value_heads=kv_heads, head_dim=draw(st.sampled_from([64, 96, 128, 256])),
        tie_word_embeddings=False)


def parameter_count(config: LlamaConfig) -> int:
    """The parameters of a Llama-shaped decoder with untied embeddings."""
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    attention = config.hidden_size * (2 * q_size + 2 * kv_size)
    mlp = 3 * config.hidden_size * config.intermediate_size
    layer = attention + mlp + 2 * config.hidden_size
    return config.num_hidden_layers * layer + (2 * config.vocab_size + 1) * config.hidden_size


@settings(max_examples=300, deadline=None)
@given(hf_config=decoders(), dtype=st.sampled_from([torch.bfloat16, torch.float16,
                                                   torch.float32]),
       total=st.integers(4 * GIB, 192 * GIB), free_permille=st.integers(0, 1000),
       utilization=st.floats(0.05, 1.0), block_size=st.integers(1, 256),
       max_num_seqs=st.integers(1, 1024), max_num_batched_tokens=st.integers(1, 65_536),
       enforce_eager=st.booleans(), max_model_len=st.integers(1, 1 << 20))
def test_cuda_plan_keeps_the_engines_share_within_utilization_of_total_or_refuses_to_start(
        hf_config, dtype, total, free_permille, utilization, block_size, max_num_seqs,
        max_num_batched_tokens, enforce_eager, max_model_len):
    config = EngineConfig(model="unused", device="cuda", block_size=block_size,
                          gpu_memory_utilization=utilization, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens,
                          enforce_eager=enforce_eager)
    weights = parameter_count(hf_config) * dtype.itemsize
    graph_sizes = [] if enforce_eager else graph_batch_sizes(max_num_seqs)
    fixed = (2 * weights + activation_bytes(hf_config, max_num_batched_tokens, max_num_seqs)
             + graph_pool_bytes(hf_config, graph_sizes))  # weights, their staging copy
    one_sequence = (num_blocks_for(max_model_len, block_size)
                    * kv_block_bytes(hf_config, block_size, dtype))
    sizes = []
    for free in (total * free_permille // 1000, total):  # what is free must change nothing
        with fake_cuda_device(total, free):
            try:
                sizes.append(size_kv_cache(config, hf_config, dtype, max_model_len, weights,
                                           graph_sizes))
            except ValueError as error:
                assert fixed + one_sequence > utilization * total  # nothing smaller fits
                assert "gpu_memory_utilization" in str(error)
                assert "lower max_model_len" in str(error) or "nothing for the KV pool" in str(
                    error)
                return
    assert sizes[0] == sizes[1]
    pool = sizes[0].num_blocks * sizes[0].block_bytes
    assert one_sequence <= pool
    assert fixed + pool <= utilization * total


@pytest.mark.parametrize("too_long_by", [BLOCK_SIZE, 1], ids=["a block", "a token"])
def test_cuda_share_one_block_short_of_a_max_model_len_sequence_is_refused_naming_the_fix(
        too_long_by):
    qwen3_8b = LlamaConfig(vocab_size=151_936, hidden_size=4096, intermediate_size=12_288,
                           num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                           head_dim=128, tie_word_embeddings=False)
    weights = parameter_count(qwen3_8b) * 2

    def size(max_model_len: int):
        config = EngineConfig(model="unused", device="cuda", block_size=BLOCK_SIZE,
                              gpu_memory_utilization=0.9, max_model_len=max_model_len)
        return size_kv_cache(config, qwen3_8b, torch.bfloat16, max_model_len, weights,
                             graph_sizes=graph_batch_sizes(config.max_num_seqs))

    with fake_cuda_device(80 * GIB, 80 * GIB):  # an 80 GiB A100 or H100
        fitting = size(1).num_blocks * BLOCK_SIZE  # the longest sequence the pool holds
        assert size(fitting).num_blocks * BLOCK_SIZE == fitting
        too_long = fitting + too_long_by
        with pytest.raises(ValueError) as error:
            size(too_long)
    for fragment in (f"max_model_len={too_long}", "raise num_kv_blocks",
                     "gpu_memory_utilization", "lower max_model_len"):
        assert fragment in str(error.value)


def cpu_runner_for_cuda(config: WorkerConfig, hf_config, size: int, spmd: bool) -> ModelRunner:
    """The runner a CUDA engine would build, on the CPU: the decode graph sizes it would
    capture (not captured: no device) with the reference kernels."""
    runner = ModelRunner(replace(config, device="cpu", attention_backend="torch"), hf_config)
    runner.graph_sizes = graph_batch_sizes(config.max_num_seqs)
    runner.capture_graphs = lambda: None
    return runner


def held_parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the storages under the model's parameters, each counted once."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                for p in model.parameters()}
    return sum(storages.values())


@pytest.mark.parametrize("utilization", [0.05, 0.3])
def test_engine_on_a_cuda_device_holds_what_it_planned_within_its_share(
        model_dir, monkeypatch, utilization):
    total = 2 * GIB
    monkeypatch.setattr(engine_module, "make_runner", cpu_runner_for_cuda)
    config = EngineConfig(model=str(model_dir("llama")), device="cuda", block_size=BLOCK_SIZE,
                          gpu_memory_utilization=utilization, max_num_seqs=64)
    with fake_cuda_device(total, total // 4):
        engine = LLMEngine(config)
    plan, runner = engine.memory_plan, engine.runner
    hf_config = runner.model.config
    assert plan.weight_bytes == plan.staging_bytes == held_parameter_bytes(runner.model)
    assert plan.activation_bytes == activation_bytes(hf_config, config.max_num_batched_tokens,
                                                     config.max_num_seqs)
    assert plan.graph_bytes == graph_pool_bytes(hf_config, graph_batch_sizes(64)) > 0
    block = kv_block_bytes(hf_config, BLOCK_SIZE, runner.dtype)
    held = sum(fixed_parts(plan)) + runner.kv_cache_bytes()
    assert utilization * total - block < held <= utilization * total
    assert engine.num_kv_blocks * BLOCK_SIZE >= engine.max_model_len


def test_engine_on_a_cuda_device_one_block_short_of_max_model_len_refuses_to_start(
        model_dir, monkeypatch):
    monkeypatch.setattr(engine_module, "make_runner", cpu_runner_for_cuda)
    config = EngineConfig(model=str(model_dir("llama")), device="cuda", block_size=BLOCK_SIZE,
                          gpu_memory_utilization=0.5, max_num_seqs=64, max_model_len=512)
    with fake_cuda_device(2 * GIB, 2 * GIB):
        engine = LLMEngine(config)
    block = kv_block_bytes(engine.runner.model.config, BLOCK_SIZE, engine.runner.dtype)
    fixed = sum(fixed_parts(engine.memory_plan))
    short = 2 * (fixed + (num_blocks_for(512, BLOCK_SIZE) - 1) * block)  # utilization 0.5
    with fake_cuda_device(short, short), pytest.raises(ValueError) as error:
        LLMEngine(config)
    for fragment in ("max_model_len=512", "gpu_memory_utilization", "lower max_model_len"):
        assert fragment in str(error.value)


def test_a_quantized_engine_plans_the_8_bit_weights_it_holds_and_float_staging(
        model_dir, monkeypatch):
    # The plan's weights are what the runner holds (8-bit projections, their scales, the
    # rest in the model's dtype); staging is a full update as the trainer sends it, in the
    # model's dtype; the KV pool gets what the smaller weights leave.
    monkeypatch.setattr(engine_module, "make_runner", cpu_runner_for_cuda)
    pools = {}
    for quantization in (None, "int8"):
        config = EngineConfig(model=str(model_dir("llama")), device="cuda", block_size=BLOCK_SIZE,
                              gpu_memory_utilization=0.3, max_num_seqs=64,
                              quantization=quantization)
        with fake_cuda_device(2 * GIB, 2 * GIB):
            engine = LLMEngine(config)
        plan, model = engine.memory_plan, engine.runner.model
        scales = sum(layer.weight_scale.numel() * 4 for layer in model.quantized_layers()
                     if layer.weight_scale is not None)
        assert plan.weight_bytes == held_parameter_bytes(model) + scales
        assert plan.staging_bytes == sum(p.numel() * 4 for p in model.parameters())
        pools[quantization] = plan.kv_cache_bytes
    projections = sum(layer.weight.numel() for layer in model.quantized_layers())
    channels = sum(layer.out_features for layer in model.quantized_layers())
    assert pools["int8"] - pools[None] == 3 * projections - 4 * channels
