"""The device-memory plan: a fixed share of total memory, split part by part."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from tandem.rollout.memory import GRAPH_OVERHEAD_BYTES, graph_pool_bytes, plan_memory

GIB = 1 << 30


def test_share_of_total_memory_pays_weights_staging_activations_graphs_then_kv():
    plan = plan_memory(total_bytes=80 * GIB, utilization=0.25, weight_bytes=2 * GIB,
                       activations=1 * GIB, graphs=GIB // 2)
    assert plan.budget_bytes == 20 * GIB
    assert (plan.weight_bytes, plan.staging_bytes, plan.activation_bytes, plan.graph_bytes) == (
        2 * GIB, 2 * GIB, 1 * GIB, GIB // 2)
    assert plan.kv_cache_bytes == 14.5 * GIB
    assert plan.as_stats()["memory_graph_bytes"] == GIB // 2


def test_share_too_small_names_each_part_and_the_fix():
    with pytest.raises(ValueError, match="weights take 2.00 GiB.*raise gpu_memory_utilization"):
        plan_memory(total_bytes=80 * GIB, utilization=0.05, weight_bytes=2 * GIB,
                    activations=1 * GIB, graphs=0)


def test_graph_pool_is_sized_by_the_largest_batch_and_nothing_without_graphs(model_dir):
    config = AutoConfig.from_pretrained(model_dir("llama"))
    per_token = 4 * (4 * config.hidden_size + 3 * config.intermediate_size)
    assert graph_pool_bytes(config, []) == 0
    assert graph_pool_bytes(config, [1, 2, 4, 8]) == 8 * per_token + 4 * GRAPH_OVERHEAD_BYTES
