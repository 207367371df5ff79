"""GRPO and PPO: what each computes before a step's backward passes, and each micro-batch's loss.

Both share the loop in ``trainer.py``: ``prepare`` sees the whole step (rewards, and the
no-grad scores it asks for) and returns per-row or per-token targets; ``loss`` turns one
micro-batch's log-probs (with gradient) into its share of the step's loss and its metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .loss_config import GRPOLossConfig, ImportanceSamplingConfig, PPOConfig
from .losses import (
    behaviour_kl,
    clipped_policy_loss,
    clipped_value_loss,
    gae,
    group_advantages,
    importance_weights,
    k3_kl,
    masked_mean,
    ppo_token_rewards,
    reduce_loss,
    whiten,
)

# (with_values, use_reference) -> (logprobs [B, C], values [B, C] or None), no gradient.
ScoreFn = Callable[[bool, bool], tuple[torch.Tensor, torch.Tensor | None]]


@dataclass(slots=True)
class StepTargets:
    """What a step's micro-batches need besides their own log-probs.

    Attributes:
        advantages: ``[B, 1]`` (GRPO) or ``[B, C]`` (PPO).
        ref_logprobs: the reference model's log-probs ``[B, C]`` when the loss has a KL term.
        old_values: PPO's values at sampling time ``[B, C]``.
        returns: PPO's value targets ``[B, C]``.
    """

    advantages: torch.Tensor
    ref_logprobs: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None


@dataclass(slots=True)
class MicroBatch:
    """One micro-batch's rows: log-probs with gradient and the step's data for those rows."""

    rows: slice
    logprobs: torch.Tensor
    values: torch.Tensor | None
    sampler_logprobs: torch.Tensor
    mask: torch.Tensor
    num_rows: int
    num_tokens: int
    max_tokens: int


def policy_terms(micro: MicroBatch, advantages: torch.Tensor, epsilon_low: float,
                 epsilon_high: float, correction: ImportanceSamplingConfig
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The importance-weighted clipped surrogate per token (old log-probs: this pass's,
    detached, as each rollout batch gets one update) and its ratio, clipping and
    sampler-vs-trainer metrics (verl's rollout-correction ones among them)."""
    old_logprobs = micro.logprobs.detach()
    weights, raw, changed = importance_weights(old_logprobs, micro.sampler_logprobs,
                                               micro.mask, correction)
    per_token, was_clipped = clipped_policy_loss(micro.logprobs, old_logprobs, advantages,
                                                 epsilon_low, epsilon_high, weights)
    mask = micro.mask.bool()
    diff = (old_logprobs - micro.sampler_logprobs).abs()[mask]
    kl_k1, kl_k3 = behaviour_kl(old_logprobs, micro.sampler_logprobs, micro.mask)
    changed_key = "is_masked_fraction" if correction.mode.endswith("mask") else \
        "is_truncated_fraction"
    return per_token, {
        "is_ratio_min": raw[mask].min(), "is_ratio_max": raw[mask].max(),
        "is_ratio_mean": raw[mask].mean(), changed_key: masked_mean(changed, micro.mask),
        "behaviour_kl_k1": kl_k1, "behaviour_kl_k3": kl_k3,
        "sampler_logprob_diff_max": diff.max(), "sampler_logprob_diff_mean": diff.mean(),
        "sampler_logprob_exact_fraction": (diff == 0).float().mean(),
        "clip_fraction": masked_mean(was_clipped, micro.mask)}


class GRPO:
    """Group-relative advantages, the clipped surrogate, an optional k3 KL to the reference."""

    uses_values = False

    def __init__(self, config: GRPOLossConfig, correction: ImportanceSamplingConfig) -> None:
        self.config, self.correction = config, correction

    @property
    def needs_reference(self) -> bool:
        """True when the loss has a KL term."""
        return self.config.beta > 0

    def prepare(self, rewards: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor,
                score: ScoreFn) -> StepTargets:
        """Per-completion advantages (and reference log-probs when ``beta > 0``)."""
        advantages = group_advantages(rewards, group_ids, self.config.scale_rewards)
        ref_logprobs = score(False, True)[0] if self.needs_reference else None
        return StepTargets(advantages.unsqueeze(1), ref_logprobs)

    def loss(self, micro: MicroBatch, targets: StepTargets
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This micro-batch's share of the GRPO loss and its metrics."""
        config = self.config
        per_token, metrics = policy_terms(
            micro, targets.advantages[micro.rows], config.epsilon,
            config.epsilon if config.epsilon_high is None else config.epsilon_high,
            self.correction)
        if targets.ref_logprobs is not None:
            kl = k3_kl(micro.logprobs, targets.ref_logprobs[micro.rows])
            per_token = per_token + config.beta * kl
            metrics["kl"] = masked_mean(kl.detach(), micro.mask)
        loss = reduce_loss(per_token, micro.mask, config.loss_type, micro.num_rows,
                           micro.num_tokens, micro.max_tokens)
        return loss, metrics


class PPO:
    """A value head, GAE over per-token KL-penalised rewards, clipped policy and value losses."""

    uses_values = True
    needs_reference = True

    def __init__(self, config: PPOConfig, correction: ImportanceSamplingConfig) -> None:
        self.config, self.correction = config, correction

    def prepare(self, rewards: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor,
                score: ScoreFn) -> StepTargets:
        """Old values, reference log-probs, per-token rewards and their GAE advantages."""
        config = self.config
        old_logprobs, old_values = score(True, False)
        ref_logprobs = score(False, True)[0]
        token_rewards = ppo_token_rewards(rewards, old_logprobs, ref_logprobs, mask,
                                          config.kl_coef)
        advantages, returns = gae(token_rewards, old_values * mask, mask, config.gamma,
                                  config.lam)
        if config.whiten_advantages:
            advantages = whiten(advantages, mask)
        return StepTargets(advantages, ref_logprobs, old_values, returns)

    def loss(self, micro: MicroBatch, targets: StepTargets
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This micro-batch's share of the PPO loss (token mean) and its metrics."""
        config = self.config
        policy, metrics = policy_terms(micro, targets.advantages[micro.rows], config.cliprange,
                                       config.cliprange, self.correction)
        value = clipped_value_loss(micro.values, targets.old_values[micro.rows],
                                   targets.returns[micro.rows], config.cliprange_value)
        per_token = policy + config.vf_coef * value
        metrics["value_loss"] = masked_mean(value.detach(), micro.mask)
        metrics["kl"] = masked_mean(micro.logprobs.detach() - targets.ref_logprobs[micro.rows],
                                    micro.mask)
        loss = reduce_loss(per_token, micro.mask, "token", micro.num_rows, micro.num_tokens,
                           micro.max_tokens)
        return loss, metrics


def combine_metrics(parts: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Micro-batch metrics merged: ``*_min`` by min, ``*_max`` by max, the rest by mean."""
    combined = {}
    for key in parts[0]:
        values = torch.stack([part[key].float() for part in parts])
        if key.endswith("_min"):
            combined[key] = float(values.min())
        elif key.endswith("_max"):
            combined[key] = float(values.max())
        else:
            combined[key] = float(values.mean())
    return combined
