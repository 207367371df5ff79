"""The loss sections of a recipe: ``grpo``, ``ppo`` and ``importance_sampling`` (the
off-policy correction both algorithms share)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class GRPOLossConfig:
    """GRPO's loss (the recipe's ``grpo`` section).

    Attributes:
        epsilon: lower clip range of the ratio (``1 - epsilon``).
        epsilon_high: upper clip range (``1 + epsilon_high``); None means ``epsilon``.
        beta: weight of the KL to the reference model (0: no reference model is kept).
        scale_rewards: divide a group's advantages by its reward std (off in Dr.GRPO).
        loss_type: ``"grpo"`` (mean over each completion, then over completions),
            ``"dr_grpo"`` (sum over tokens divided by completions × max_tokens) or
            ``"token"`` (mean over all tokens of the batch).
    """

    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    scale_rewards: bool = True
    loss_type: str = "grpo"


@dataclass(slots=True)
class PPOConfig:
    """PPO's value head, advantages and loss.

    Attributes:
        gamma: discount.
        lam: GAE's lambda.
        kl_coef: per-token KL penalty to the reference model in the reward.
        cliprange: the ratio's clip range.
        cliprange_value: the value's clip range around the old value.
        vf_coef: weight of the value loss.
        whiten_advantages: normalise advantages over the batch.
    """

    gamma: float = 1.0
    lam: float = 0.95
    kl_coef: float = 0.05
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    whiten_advantages: bool = True


IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate",
                             "sequence_mask", "none")


@dataclass(slots=True)
class ImportanceSamplingConfig:
    """The off-policy correction of GRPO's and PPO's loss (the recipe's
    ``importance_sampling`` section; TRL's ``vllm_importance_sampling_*`` shapes): each token's
    loss is weighted by the ratio of the trainer's probability to the engine's (the
    behaviour policy's processed log-probs, whatever weight version sampled them).

    Attributes:
        mode: ``token_truncate`` (each token's ratio, clamped into the range),
            ``token_mask`` (tokens whose ratio leaves the range get no gradient),
            ``sequence_truncate`` / ``sequence_mask`` (the same with one ratio per sequence:
            the product of its tokens'), or ``none``.
        clip_min: the range's lower end (None: unbounded).
        clip_max: the range's upper end (None: unbounded).
    """

    mode: str = "token_truncate"
    clip_min: float | None = None
    clip_max: float | None = 2.0


def check_importance_sampling(config: ImportanceSamplingConfig) -> None:
    """Refuse an empty range, or a masking mode without one (the mode itself is checked
    with the other fields' choices).

    Raises:
        ValueError: naming ``importance_sampling.<field>`` and the fix.
    """
    low, high = config.clip_min, config.clip_max
    if (low is not None and low < 0) or (high is not None and high <= 0) or \
            (low is not None and high is not None and low >= high):
        raise ValueError(f"importance_sampling.clip_min={low!r}, clip_max={high!r} is not a "
                         "range: use 0 <= clip_min < clip_max (either may be null).")
    if config.mode.endswith("mask") and low is None and high is None:
        raise ValueError(f"importance_sampling.mode={config.mode!r} masks tokens outside "
                         "[clip_min, clip_max]: set at least one of them.")
