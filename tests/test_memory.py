"""The KV pool's size and the device-memory plan, pinned by their contracts.

No test restates the estimates: the plan's parts must add up to its share with the KV pool
taking the rest, only the KV pool moves with ``gpu_memory_utilization``, a share too small
is refused naming each part and the options that fix it; the pool honours ``num_kv_blocks``,
``kv_cache_memory_bytes`` and the CPU default, holds one max_model_len sequence, and its
blocks are as large as the pool the runner allocates.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, LlamaConfig

from tandem.rollout.block_manager import num_blocks_for
from tandem.rollout.config import EngineConfig
from tandem.rollout.memory import (
    CPU_KV_CACHE_BYTES,
    activation_bytes,
    graph_pool_bytes,
    kv_block_bytes,
    plan_memory,
    size_kv_cache,
)
from tandem.rollout.model_runner import ModelRunner

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
def test_block_bytes_are_the_bytes_per_block_of_the_pool_the_runner_allocates(model_dir, kind,
                                                                               dtype):
    folder = model_dir(kind)
    hf_config = AutoConfig.from_pretrained(folder)
    runner = ModelRunner(hf_config, folder, dtype, torch.device("cpu"), max_model_len=64,
                         block_size=BLOCK_SIZE, eos_token_ids={1}, seed=0)
    runner.allocate_kv_cache(7)
    assert runner.kv_cache_bytes() == 7 * kv_block_bytes(hf_config, BLOCK_SIZE, dtype)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 16 GiB CUDA device whose free memory must never be asked for."""
    def free_memory(device=None):
        raise AssertionError("the pool was sized by free memory")

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(total_memory=16 * GIB))
    monkeypatch.setattr(torch.cuda, "mem_get_info", free_memory)


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
