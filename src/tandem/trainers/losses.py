"""The policy-gradient pieces GRPO and PPO share, and each one's own advantages.

Every function works on ``[B, C]`` tensors of completion slots with a float ``mask`` (1 on
real tokens), so a micro-batch and a whole batch are computed the same way.
"""

from __future__ import annotations

import math

import torch

from .loss_config import ImportanceSamplingConfig


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor,
                     scale_rewards: bool) -> torch.Tensor:
    """GRPO's advantages: each reward minus its group's mean, divided by the group's std
    (plus 1e-4) when ``scale_rewards``; one value per completion."""
    num_groups = int(group_ids.max()) + 1
    counts = torch.bincount(group_ids, minlength=num_groups).float()
    means = rewards.new_zeros(num_groups).index_add_(0, group_ids, rewards) / counts
    advantages = rewards - means[group_ids]
    if not scale_rewards:
        return advantages
    variances = rewards.new_zeros(num_groups).index_add_(0, group_ids, advantages ** 2)
    stds = (variances / (counts - 1).clamp(min=1)).sqrt()
    return advantages / (stds[group_ids] + 1e-4)


def importance_weights(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                       mask: torch.Tensor, config: ImportanceSamplingConfig
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The off-policy correction ``π_train / π_sampler`` of each token, all detached.

    Returns the weights (per token, or one per sequence repeated over its tokens: the
    product of its tokens' ratios), the raw ratio, and a float mask of the tokens whose
    weight the mode changed: truncated into ``[clip_min, clip_max]``, or for the ``*_mask``
    modes, zeroed because the ratio left that range (TRL's ``vllm_importance_sampling_mode``).
    """
    log_ratio = (old_logprobs.detach() - sampler_logprobs) * mask
    if config.mode.startswith("sequence"):
        log_ratio = log_ratio.sum(dim=1, keepdim=True).expand_as(mask)
    raw = torch.exp(log_ratio.clamp(max=80.0))  # a sequence's product stays finite
    if config.mode == "none":
        return torch.ones_like(raw), raw, torch.zeros_like(raw)
    low = -math.inf if config.clip_min is None else config.clip_min
    high = math.inf if config.clip_max is None else config.clip_max
    outside = (raw < low) | (raw > high)
    if config.mode.endswith("truncate"):
        return raw.clamp(min=low, max=high), raw, outside.float()
    return raw.masked_fill(outside, 0.0), raw, outside.float()


def behaviour_kl(old_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
                 mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Estimates of KL(π_sampler ‖ π_train) over the sampled tokens: k1 (the mean log-ratio)
    and k3 (``r - log r - 1`` with ``r = π_train / π_sampler``, never negative)."""
    delta = (old_logprobs.detach() - sampler_logprobs) * mask
    return masked_mean(-delta, mask), masked_mean(torch.exp(delta) - delta - 1, mask)


def clipped_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                        advantages: torch.Tensor, epsilon_low: float, epsilon_high: float,
                        is_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token, times the importance weights, and a float mask of
    the tokens where clipping took effect.

    ``advantages`` is ``[B, C]`` or ``[B, 1]`` (one per completion).
    """
    ratio = torch.exp(logprobs - old_logprobs.detach())
    clipped = ratio.clamp(1 - epsilon_low, 1 + epsilon_high)
    loss = -torch.minimum(ratio * advantages, clipped * advantages) * is_weights
    was_clipped = ((ratio < 1 - epsilon_low) & (advantages < 0)) | \
                  ((ratio > 1 + epsilon_high) & (advantages > 0))
    return loss, was_clipped.float()


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """The per-token KL estimate ``exp(ref - logp) - (ref - logp) - 1`` (Schulman's k3)."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1


def reduce_loss(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str,
                num_rows: int, num_tokens: int, max_tokens: int) -> torch.Tensor:
    """A micro-batch's share of the batch loss, so that summing micro-batches gives it exactly.

    ``num_rows``/``num_tokens`` are the whole batch's; ``loss_type`` is ``"grpo"`` (mean per
    completion, then over completions), ``"token"`` (mean over tokens) or ``"dr_grpo"``
    (sum over tokens / (completions × max_tokens)).
    """
    masked = per_token * mask
    if loss_type == "grpo":
        return (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum() / num_rows
    if loss_type == "token":
        return masked.sum() / max(num_tokens, 1)
    return masked.sum() / (num_rows * max_tokens)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean of ``values`` over the tokens of ``mask``."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


def ppo_token_rewards(scores: torch.Tensor, old_logprobs: torch.Tensor,
                      ref_logprobs: torch.Tensor, mask: torch.Tensor,
                      kl_coef: float) -> torch.Tensor:
    """PPO's per-token rewards: ``-kl_coef · (logp - ref)`` on every token, plus the
    completion's score on its last token."""
    rewards = -kl_coef * (old_logprobs - ref_logprobs) * mask
    last = (mask.sum(dim=1).long() - 1).clamp(min=0)
    rewards[torch.arange(len(scores), device=scores.device), last] += scores
    return rewards


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimates and returns ``[B, C]`` (zero past each completion)."""
    advantages = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(rewards.shape[0])
    next_advantage = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantages[:, t] = (delta + gamma * lam * next_advantage) * mask[:, t]
        next_value = values[:, t] * mask[:, t]
        next_advantage = advantages[:, t]
    return advantages, (advantages + values) * mask


def whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values`` normalised to mean 0 and std 1 over the tokens of ``mask``."""
    mean = masked_mean(values, mask)
    std = masked_mean((values - mean) ** 2, mask).sqrt()
    return (values - mean) / (std + 1e-8) * mask


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       cliprange: float) -> torch.Tensor:
    """PPO's per-token value loss ``½ max((V - R)², (clip(V) - R)²)``."""
    clipped = old_values + (values - old_values).clamp(-cliprange, cliprange)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
