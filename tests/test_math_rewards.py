"""Math rewards: the final answer (after ``####``, else the last ``\\boxed{}``) scored as math,
text and conversational completions alike, and the answer-format rewards."""

from __future__ import annotations

import pytest

pytest.importorskip("math_verify")

from tandem.trainers.math_rewards import (  # noqa: E402
    boxed_format_reward,
    final_answer,
    hash_format_reward,
    math_rewards,
)


@pytest.fixture(scope="module")
def correct():
    return math_rewards(timeout=5.0)["correct"]


def test_final_answer_is_what_follows_the_last_hash_marker():
    assert final_answer("3 + 4 = 7\n#### 7") == " 7"
    assert final_answer("#### 6\nno, #### 7") == " 7"
    assert final_answer(r"so \boxed{7}") == r"so \boxed{7}"


def test_correct_reads_the_hash_answer_not_the_numbers_before_it(correct):
    completions = ["48 / 2 = 24, and 48 + 24 = 72.\n#### 72", "72 clips.\n#### 24",
                   "The total is 1,000 apples.\n#### 1,000", "It is 1000.\n#### 1000.0"]
    assert correct(completions, answer=["72", "72", "1000", "1000"]) == [1.0, 0.0, 1.0, 1.0]


def test_correct_compares_boxed_answers_as_math(correct):
    completions = [r"Half: $\boxed{0.5}$", r"\boxed{\frac{1}{2}}", r"\boxed{1/3}",
                   r"First 0.5, so \boxed{2}", r"$\boxed{\sqrt{18}}$"]
    answers = [r"\frac{1}{2}", "0.5", r"\frac{1}{2}", r"\frac{1}{2}", r"3\sqrt{2}"]
    assert correct(completions, answer=answers) == [1.0, 1.0, 0.0, 0.0, 1.0]


def test_rewards_score_text_and_conversational_completions_alike(correct):
    texts = [r"\boxed{0.25}", "#### 9", "nothing"]
    messages = [[{"role": "assistant", "content": text}] for text in texts]
    for completions in (texts, messages):
        assert correct(completions, answer=[r"\frac{1}{4}", 9, "1"]) == [1.0, 1.0, 0.0]
        assert boxed_format_reward(completions) == [1.0, 0.0, 0.0]
        assert hash_format_reward(completions) == [0.0, 1.0, 0.0]


def test_hash_format_wants_the_marker_on_the_last_line():
    completions = ["#### 72", "Done.\n#### 1,000.", "#### 72\nMore text", "#### 1.5", "72"]
    assert hash_format_reward(completions) == [1.0, 1.0, 0.0, 1.0, 0.0]
