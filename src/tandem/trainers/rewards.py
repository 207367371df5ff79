"""Reward functions: plain Python callables, several of them weighted, checked on every call.

A reward function takes TRL's shape: ``fn(prompts, completions, **columns) -> list[float]``,
with one prompt (a string or a chat conversation) and one completion text per sampled
completion, and the dataset's other columns (each a list aligned with the completions) plus
``completion_ids``. A function that raises, returns NaN or the wrong number of values stops
the run with an error naming it.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

RewardFn = Callable[..., Sequence[float]]
# A completion as TRL hands it to reward functions: text, or for conversational prompts the
# generated messages (``[{"role": "assistant", "content": ...}]``).
Completion = str | list[dict[str, Any]]


class RewardError(RuntimeError):
    """A reward function failed or returned something that is not one finite float each."""


@dataclass(slots=True)
class WeightedReward:
    """A reward function with its name and weight."""

    name: str
    fn: RewardFn
    weight: float = 1.0


def completion_text(completion: Completion) -> str:
    """A completion's text: itself, or the content of its last assistant message (an
    episode's may end with a tool's answer)."""
    if isinstance(completion, str):
        return completion
    return next((m["content"] for m in reversed(completion) if m["role"] == "assistant"), "")


def resolve_reward(name: str, task_rewards: dict[str, RewardFn]) -> RewardFn:
    """The task's reward called ``name``, or the function ``module:function`` imports.

    Raises:
        ValueError: when neither exists, naming the task's rewards.
    """
    if name in task_rewards:
        return task_rewards[name]
    module, sep, attribute = name.partition(":")
    if sep:
        try:
            return getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"reward {name!r} cannot be imported: {error}.") from error
    raise ValueError(f"unknown reward {name!r}: use one of {', '.join(task_rewards)} or "
                     "'module:function'.")


def compute_rewards(rewards: Sequence[WeightedReward], prompts: list[Any],
                    completions: list[str], columns: dict[str, list[Any]]
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each function's rewards and their weighted sum, as float32 tensors of len(completions).

    Raises:
        RewardError: naming the function that raised, returned a non-number or NaN, or the
            wrong number of values.
    """
    per_function = {r.name: _call(r, prompts, completions, columns) for r in rewards}
    total = torch.zeros(len(completions))
    for reward in rewards:
        total += reward.weight * per_function[reward.name]
    return total, per_function


def _call(reward: WeightedReward, prompts: list[Any], completions: list[str],
          columns: dict[str, list[Any]]) -> torch.Tensor:
    try:
        values = list(reward.fn(prompts=prompts, completions=completions, **columns))
    except Exception as error:
        raise RewardError(f"reward function {reward.name!r} raised "
                          f"{type(error).__name__}: {error}") from error
    if len(values) != len(completions):
        raise RewardError(f"reward function {reward.name!r} returned {len(values)} values for "
                          f"{len(completions)} completions: return one float per completion.")
    for index, value in enumerate(values):
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RewardError(f"reward function {reward.name!r} returned {value!r} for "
                              f"completion {index}: every reward must be a finite number.")
    return torch.tensor(values, dtype=torch.float32)
