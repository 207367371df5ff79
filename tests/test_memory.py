"""The device-memory plan: a fixed share of total memory, split part by part."""

from __future__ import annotations

import pytest

from tandem.rollout.memory import plan_memory

GIB = 1 << 30


def test_share_of_total_memory_pays_weights_staging_activations_then_kv():
    plan = plan_memory(total_bytes=80 * GIB, utilization=0.25, weight_bytes=2 * GIB,
                       activations=1 * GIB)
    assert plan.budget_bytes == 20 * GIB
    assert (plan.weight_bytes, plan.staging_bytes, plan.activation_bytes) == (
        2 * GIB, 2 * GIB, 1 * GIB)
    assert plan.kv_cache_bytes == 15 * GIB
    assert plan.as_stats()["memory_kv_cache_bytes"] == 15 * GIB


def test_share_too_small_names_each_part_and_the_fix():
    with pytest.raises(ValueError, match="weights take 2.00 GiB.*raise gpu_memory_utilization"):
        plan_memory(total_bytes=80 * GIB, utilization=0.05, weight_bytes=2 * GIB,
                    activations=1 * GIB)
