"""GRPO and PPO loss pieces against direct per-element references."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from tandem.trainers.config import ImportanceSamplingConfig, TrainConfig
from tandem.trainers.losses import (
    behaviour_kl,
    clipped_policy_loss,
    gae,
    group_advantages,
    importance_weights,
    reduce_loss,
)


def test_group_advantages_match_a_per_group_reference():
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, 3.0, 1.0])
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    advantages = group_advantages(rewards, group_ids, scale_rewards=True)
    for group in (0, 1):
        values = rewards[group_ids == group].tolist()
        mean, std = statistics.mean(values), statistics.stdev(values)
        expected = [(v - mean) / (std + 1e-4) for v in values]
        assert advantages[group_ids == group].tolist() == pytest.approx(expected, rel=1e-5)
    unscaled = group_advantages(rewards, group_ids, scale_rewards=False)
    assert unscaled[:3].tolist() == pytest.approx([0.5, -0.5, 0.0])


def test_gae_matches_the_textbook_recursion():
    torch.manual_seed(0)
    rewards, values = torch.randn(3, 5), torch.randn(3, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]]).float()
    gamma, lam = 0.9, 0.8
    advantages, returns = gae(rewards * mask, values * mask, mask, gamma, lam)
    for row in range(3):
        length = int(mask[row].sum())
        running = 0.0
        for t in reversed(range(length)):
            next_value = values[row, t + 1].item() if t + 1 < length else 0.0
            delta = rewards[row, t].item() + gamma * next_value - values[row, t].item()
            running = delta + gamma * lam * running
            assert advantages[row, t].item() == pytest.approx(running, abs=1e-5)
            assert returns[row, t].item() == pytest.approx(running + values[row, t].item(),
                                                           abs=1e-5)
        assert advantages[row, length:].abs().sum() == 0


def test_clipping_stops_the_gradient_only_past_the_range():
    old = torch.zeros(1, 3)
    logprobs = torch.log(torch.tensor([[1.1, 1.5, 0.5]])).requires_grad_()
    advantages = torch.tensor([[1.0, 1.0, 1.0]])
    loss, was_clipped = clipped_policy_loss(logprobs, old, advantages, 0.2, 0.2,
                                            torch.ones(1, 3))
    loss.sum().backward()
    assert was_clipped.tolist() == [[0.0, 1.0, 0.0]]
    assert logprobs.grad[0, 1] == 0 and logprobs.grad[0, 0] != 0 and logprobs.grad[0, 2] != 0


# Two sequences of three slots (the second's last slot is padding), trainer vs sampler.
TRAINER = torch.tensor([[-1.0, -0.2, -1.5], [-0.5, -2.0, -9.0]])
SAMPLER = torch.tensor([[-1.0, -1.2, -2.0], [-0.9, -2.1, 0.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def reference_weights(mode: str, low: float, high: float) -> list[list[float]]:
    """The weights computed per element from their definitions."""
    rows = []
    for t_row, s_row, m_row in zip(TRAINER.tolist(), SAMPLER.tolist(), MASK.tolist()):
        token = [math.exp(t - s) if m else 1.0 for t, s, m in zip(t_row, s_row, m_row)]
        sequence = math.prod(r for r, m in zip(token, m_row) if m)
        ratios = token if mode.startswith("token") else [sequence] * 3
        if mode.endswith("truncate"):
            rows.append([min(max(r, low), high) for r in ratios])
        else:
            rows.append([r if low <= r <= high else 0.0 for r in ratios])
    return rows


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate",
                                  "sequence_mask"])
def test_importance_weights_match_their_definitions(mode):
    config = ImportanceSamplingConfig(mode=mode, clip_min=0.5, clip_max=2.0)
    weights, raw, changed = importance_weights(TRAINER, SAMPLER, MASK, config)
    expected = reference_weights(mode, 0.5, 2.0)
    assert (weights * MASK).flatten().tolist() == pytest.approx(
        (torch.tensor(expected) * MASK).flatten().tolist(), rel=1e-5)
    assert changed[MASK.bool()].tolist() == [
        float(not 0.5 <= r <= 2.0) for r in raw[MASK.bool()].tolist()]


def test_no_correction_weighs_every_token_one_and_still_reports_the_ratio():
    weights, raw, changed = importance_weights(TRAINER, SAMPLER, MASK,
                                               ImportanceSamplingConfig(mode="none"))
    assert weights.eq(1).all() and changed.eq(0).all()
    assert raw[0, 1].item() == pytest.approx(math.e, rel=1e-5)


def test_behaviour_kl_estimates_agree_with_their_definitions():
    k1, k3 = behaviour_kl(TRAINER, SAMPLER, MASK)
    deltas = [t - s for t_row, s_row, m_row in zip(TRAINER.tolist(), SAMPLER.tolist(),
                                                    MASK.tolist())
              for t, s, m in zip(t_row, s_row, m_row) if m]
    assert k1.item() == pytest.approx(statistics.mean(-d for d in deltas), rel=1e-5)
    assert k3.item() == pytest.approx(statistics.mean(math.exp(d) - d - 1 for d in deltas),
                                      rel=1e-5)


@pytest.mark.parametrize(("section", "message"), [
    ({"mode": "token_clip"}, "importance_sampling.mode"),
    ({"clip_min": 3.0, "clip_max": 2.0}, "is not a range"),
    ({"mode": "token_mask", "clip_max": None}, "set at least one"),
])
def test_bad_importance_sampling_settings_are_refused(section, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(importance_sampling=ImportanceSamplingConfig(**section))


@pytest.mark.parametrize("loss_type", ["grpo", "token", "dr_grpo"])
def test_micro_batch_losses_sum_to_the_whole_batch_loss(loss_type):
    torch.manual_seed(1)
    per_token = torch.randn(6, 4)
    mask = (torch.rand(6, 4) > 0.3).float()
    mask[:, 0] = 1
    args = (loss_type, 6, int(mask.sum()), 4)
    whole = reduce_loss(per_token, mask, *args)
    parts = reduce_loss(per_token[:2], mask[:2], *args) + reduce_loss(per_token[2:], mask[2:],
                                                                        *args)
    assert parts.item() == pytest.approx(whole.item(), rel=1e-6)
