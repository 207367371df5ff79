"""Task rewards take completions as text or as TRL's generated messages (episodes' too)."""

from __future__ import annotations

import pytest

from tandem.trainers.tasks import (
    build_task,
    calculator,
    correct_reward,
    hash_format_reward,
    short_answer_reward,
)


def test_rewards_score_text_and_conversational_completions_alike():
    texts = ["12", "It is 12.", "#### 7"]
    messages = [[{"role": "assistant", "content": text}] for text in texts]
    for completions in (texts, messages):
        assert correct_reward(completions, answer=[12, 12, 8]) == [1.0, 1.0, 0.0]
        assert short_answer_reward(completions) == [1.0, 1.0, 1.0]
        assert hash_format_reward(completions) == [0.0, 0.0, 1.0]


def test_calculator_evaluates_arithmetic_only():
    assert calculator("347 * 29") == "10063" and calculator("(2 + 3) * -4") == "-20"
    for unsafe in ("2 ** 10", "__import__('os')", "x", "[1] * 3"):
        with pytest.raises((ValueError, SyntaxError)):
            calculator(unsafe)


def test_calculator_episodes_reward_a_successful_call_and_the_final_answer():
    task = build_task("calculator")
    example = task.train_example(0, 3)
    a, b = map(int, example["prompt"][-1]["content"][len("What is "):-1].split(" * "))
    environment = task.environment(example)
    messages = environment.reset(example)
    assert messages[0]["role"] == "system" and messages[-1]["content"].endswith("?")
    call = {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": '
                                            f'{{"expression": "{a} * {b}"}}}}</tool_call>'}
    step = environment.step(messages + [call])
    assert step.messages == [{"role": "tool", "content": str(a * b)}] and not step.done
    answer = {"role": "assistant", "content": f"{a} * {b} = {a * b}"}
    episode = [call, *step.messages, answer]
    failed = [call, {"role": "tool", "content": "error: no"}, answer]
    assert task.rewards["tool_success"]([episode, failed, [answer]]) == [1.0, 0.0, 0.0]
    assert task.rewards["correct"]([episode, [call, *step.messages]],
                                   answer=[a * b, a * b]) == [1.0, 0.0]
