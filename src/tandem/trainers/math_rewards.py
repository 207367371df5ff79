"""Rewards for math answers: ``correct`` compares a completion's final answer with the
``answer`` column as math (math-verify, each comparison bounded in time: see
math_verifier.py), ``hash_format`` and ``boxed_format`` check the answer's form.

The final answer is what follows a completion's last ``#### `` (GSM8K's marker), else the
whole completion, in which math-verify takes the last ``\\boxed{}``, else the stated answer or
the last expression. ``1,000`` is 1000, and ``0.5``, ``1/2`` and ``\\frac{1}{2}`` are one
number, so reworded right answers score 1 where a string match would score 0.
"""

from __future__ import annotations

import re
from typing import Any

from .math_verifier import MathVerifier
from .rewards import Completion, RewardFn, completion_text

HASH_ANSWER = re.compile(r"####\s*-?[\d,]+(?:\.\d+)?\.?\s*$")
BOXED = re.compile(r"\\boxed\s*\{")


def final_answer(text: str) -> str:
    """The part of a completion that states its answer: after its last ``####``, else all."""
    _, marker, after = text.rpartition("####")
    return after if marker else text


def math_answer_reward(verifier: MathVerifier) -> RewardFn:
    """The ``correct`` reward: 1 when a completion's final answer is its ``answer`` (LaTeX
    or a number) as math, else 0 (also when checking it outruns ``verifier.timeout``)."""

    def correct(completions: list[Completion], answer: list[Any], **_: Any) -> list[float]:
        return verifier.scores([str(gold) for gold in answer],
                               [final_answer(completion_text(c)) for c in completions])

    return correct


def math_rewards(timeout: float = 5.0) -> dict[str, RewardFn]:
    """The math tasks' rewards by name, ``correct`` checked within ``timeout`` seconds each.

    Raises:
        ImportError: when math-verify is not installed.
    """
    return {"correct": math_answer_reward(MathVerifier(timeout)),
            "hash_format": hash_format_reward, "boxed_format": boxed_format_reward}


def hash_format_reward(completions: list[Completion], **_: Any) -> list[float]:
    """1 when the completion ends with a ``#### <number>`` line, else 0."""
    return [float(HASH_ANSWER.search(completion_text(c)) is not None) for c in completions]


def boxed_format_reward(completions: list[Completion], **_: Any) -> list[float]:
    """1 when the completion puts an answer in ``\\boxed{...}``, else 0."""
    return [float(BOXED.search(completion_text(c)) is not None) for c in completions]
