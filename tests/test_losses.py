"""GRPO and PPO loss pieces against direct per-element references."""

from __future__ import annotations

import statistics

import pytest
import torch

from tandem.trainers.losses import (
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


def test_importance_weights_are_truncated_and_raw_ratio_kept():
    weights, raw = importance_weights(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 0.0]), 2.0)
    assert weights.tolist() == pytest.approx([1.0, 2.0])
    assert raw[1].item() == pytest.approx(2.718281, rel=1e-5)


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
