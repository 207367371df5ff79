"""Reward functions: weighting, checks, and the tasks' own rewards."""

from __future__ import annotations

import pytest
import torch

from tandem.trainers.rewards import RewardError, WeightedReward, compute_rewards, resolve_reward
from tandem.trainers.tasks import arith_task, build_task, correct_reward, short_answer_reward


def test_weighted_sum_of_reward_functions():
    rewards = [WeightedReward("a", lambda completions, **_: [1.0, 0.0], 1.0),
               WeightedReward("b", lambda completions, **_: [0.5, 1.0], 2.0)]
    total, per_function = compute_rewards(rewards, ["p", "q"], ["x", "y"], {})
    assert torch.equal(total, torch.tensor([2.0, 2.0]))
    assert torch.equal(per_function["b"], torch.tensor([0.5, 1.0]))


def test_reward_functions_get_the_dataset_columns():
    seen = {}

    def reward(prompts, completions, answer, **_):
        seen.update(prompts=prompts, answer=answer)
        return [0.0] * len(completions)

    compute_rewards([WeightedReward("r", reward)], ["p"], ["c"], {"answer": [3]})
    assert seen == {"prompts": ["p"], "answer": [3]}


def test_unknown_reward_names_the_choices():
    with pytest.raises(ValueError, match="unknown reward 'corect': use one of correct, format"):
        resolve_reward("corect", arith_task().rewards)
    assert resolve_reward("tandem.trainers.tasks:last_integer", {}).__name__ == "last_integer"


def test_a_non_number_reward_is_refused():
    with pytest.raises(RewardError, match="'r' returned 'good'"):
        compute_rewards([WeightedReward("r", lambda completions, **_: ["good"])], ["p"], ["c"],
                        {})


def test_arith_rewards_score_the_answer_and_the_format():
    completions = ["8", "3 + 5 = 8.", "9", "The answer is 8 apples", "3 + 5 = 8\nAnd 8 + 1 = 9",
                   "To add three and five we start from three and count up five: 8"]
    assert correct_reward(completions, [8] * 6) == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    assert short_answer_reward(completions) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


def test_arith_held_out_questions_never_appear_in_training():
    task = arith_task()
    held_out = {str(e["prompt"]) for e in task.eval_examples}
    train = {str(task.train_example(0, i)["prompt"]) for i in range(2000)}
    assert held_out and not held_out & train
    assert task.train_example(3, 17) == task.train_example(3, 17)


def test_unknown_task_and_bad_task_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown task 'math': use one of arith"):
        build_task("math")
    with pytest.raises(ValueError, match="does not exist"):
        build_task("gsm8k", path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="task 'arith'"):
        build_task("arith", max_operands=3)
