"""Tasks: rewards over text and TRL's generated messages (episodes' too), the calculator's
episodes, and the dataset-backed tasks with the shipped recipes and their data."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tandem.trainers.config import load_config
from tandem.trainers.rewards import WeightedReward, compute_rewards
from tandem.trainers.tasks import (
    GSM8K_SYSTEM,
    build_task,
    calculator,
    correct_reward,
    short_answer_reward,
)

ROOT = Path(__file__).parents[1]
CALCULATION = re.compile(r"<<([^=]+)=([^>]+)>>(-?\d+(?:\.\d+)?)")


def test_rewards_score_text_and_conversational_completions_alike():
    texts = ["12", "It is 12.", "#### 7"]
    messages = [[{"role": "assistant", "content": text}] for text in texts]
    for completions in (texts, messages):
        assert correct_reward(completions, answer=[12, 12, 8]) == [1.0, 1.0, 0.0]
        assert short_answer_reward(completions) == [1.0, 1.0, 1.0]


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


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def score(task, rewards: list[str], example: dict, completions: list[str]) -> dict[str, list]:
    """Each named reward of ``task`` on ``completions`` of ``example``, called as the trainer
    calls them (every column but the prompt as a keyword argument)."""
    columns = {key: [value] * len(completions) for key, value in example.items()
               if key != "prompt"}
    _, per_function = compute_rewards(
        [WeightedReward(name, task.rewards[name]) for name in rewards],
        [example["prompt"]] * len(completions), completions, columns)
    return {name: values.tolist() for name, values in per_function.items()}


@pytest.mark.usefixtures("datasets_cache")
def test_dataset_task_passes_every_other_column_to_the_rewards(tmp_path):
    rows = [{"prompt": f"What is {n} / 4?", "answer": f"\\frac{{{n}}}{{4}}", "level": n % 3}
            for n in range(1, 21)]
    task = build_task("dataset", path=write_jsonl(tmp_path / "m.jsonl", rows),
                      eval_fraction=0.25, system_prompt="Box the answer.")
    task.rewards["level"] = lambda completions, level, **_: [float(x) for x in level]
    example = task.train_example(0, 0)
    n = int(example["prompt"][-1]["content"].split()[2])
    assert example["prompt"][0] == {"role": "system", "content": "Box the answer."}
    assert example["level"] == n % 3 and task.default_rewards == [("correct", 1.0)]
    scores = score(task, ["correct", "boxed_format", "level"], example,
                   [f"\\boxed{{{n / 4}}}", f"\\boxed{{{n + 1}/4}}", f"{n}/4"])
    assert scores == {"correct": [1.0, 0.0, 1.0], "boxed_format": [1.0, 1.0, 0.0],
                      "level": [float(n % 3)] * 3}


@pytest.mark.usefixtures("datasets_cache")
def test_gsm8k_task_asks_for_the_hash_answer_and_extracts_it(tmp_path):
    rows = [{"question": f"Tom has {n} apples and buys {n}. How many now?",
             "answer": f"{n}+{n} = <<{n}+{n}={2 * n}>>{2 * n}\n#### {2 * n:,}"}
            for n in range(600, 620)]
    task = build_task("gsm8k", path=write_jsonl(tmp_path / "g.jsonl", rows))
    example = task.train_example(1, 3)
    n = int(example["prompt"][1]["content"].split()[2])
    assert example == {"prompt": [{"role": "system", "content": GSM8K_SYSTEM},
                                  {"role": "user", "content": rows[n - 600]["question"]}],
                       "answer": str(2 * n)}
    right, wrong = f"{n} + {n} = {2 * n:,}\n#### {2 * n:,}", f"{n} + {n} = {2 * n}\n#### {n}"
    assert score(task, ["correct", "format"], example, [right, wrong, str(2 * n)]) == \
        {"correct": [1.0, 0.0, 1.0], "format": [1.0, 1.0, 0.0]}


@pytest.mark.usefixtures("datasets_cache")
@pytest.mark.parametrize("recipe, right, wrong", [
    ("grpo_gsm8k_mini.yaml", "#### {answer}", "#### {answer}1"),
    ("grpo_math_boxed.yaml", "So the answer is $\\boxed{{{answer}}}$.",
     "So the answer is $\\boxed{{{answer} + 1}}$."),
])
def test_shipped_dataset_recipes_score_a_right_and_a_wrong_answer(monkeypatch, recipe, right,
                                                                  wrong):
    monkeypatch.chdir(ROOT)  # the recipes name their data relative to the repository
    config = load_config(ROOT / "recipes" / recipe)
    task = build_task(config.task, **config.task_args)
    held_out = task.eval_examples
    assert len(held_out) >= config.eval_size * 3 // 4
    assert not {str(e["prompt"]) for e in held_out} & \
        {str(task.train_example(config.seed, i)["prompt"]) for i in range(200)}
    rewards = [reward.name for reward in config.rewards]
    for example in (task.train_example(config.seed, 0), held_out[0]):
        completions = [right.format(answer=example["answer"]),
                       wrong.format(answer=example["answer"])]
        assert score(task, rewards, example, completions) == {rewards[0]: [1.0, 0.0],
                                                              rewards[1]: [1.0, 1.0]}


def test_gsm8k_mini_worked_solutions_add_up():
    lines = (ROOT / "recipes/data/gsm8k_mini.jsonl").read_text().splitlines()
    assert 40 <= len(lines) <= 80
    for record in map(json.loads, lines):
        solution, _, answer = record["answer"].rpartition("\n#### ")
        calculations = CALCULATION.findall(solution)
        assert calculations, record["question"]
        for expression, value, written in calculations:
            assert float(calculator(expression)) == float(value) and value == written, expression
        assert float(answer) == float(calculations[-1][1]), record["question"]
