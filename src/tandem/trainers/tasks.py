"""Tasks: a prompt dataset and the reward functions that score its completions.

A task yields examples (``{"prompt": str | conversation, <column>: ...}``) from a training
stream that repeats with the seed, and a held-out set that never overlaps it. Reward
functions get every column but the prompt as keyword arguments, as in TRL.

- ``arith``: small additions and subtractions generated in code; rewards ``correct`` (the
  last integer of the completion is the answer) and ``format`` (one short line ending with a
  number, as the system prompt asks).
- ``calculator``: products too large to do in one's head, with a ``calculator`` tool
  (multi-turn episodes); rewards ``correct``, ``tool_success`` and ``format``.
- ``dataset``: a ``datasets`` table (a local JSON-lines, JSON, parquet or CSV file, or a Hub
  dataset in the local cache; prompt_dataset.py) with a ``prompt`` column; its other
  columns go to the rewards. Rewards (math_rewards.py) ``correct`` (the final answer equals
  the ``answer`` column as math, by math-verify), ``hash_format`` and ``boxed_format``.
- ``gsm8k``: the ``dataset`` task on GSM8K's format (``question``, ``answer`` ending in
  ``#### N``): the question under a system prompt asking for ``#### <number>``; rewards
  ``correct`` and ``format`` (the completion ends with ``#### N``).
- ``target_token``: short text prompts; reward ``target`` is the fraction of completion
  tokens equal to a given token id (trivially learnable: used by the tests).
"""

from __future__ import annotations

import ast
import operator
import random
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .environments import Environment, ToolEnvironment
from .math_rewards import hash_format_reward, math_rewards
from .prompt_dataset import DatasetSource, load_prompts
from .rewards import Completion, RewardFn, completion_text

Example = dict[str, Any]
INTEGER = re.compile(r"-?\d+")


@dataclass(slots=True)
class Task:
    """A dataset and its rewards.

    Attributes:
        train_example: the ``index``-th training example of the stream seeded by ``seed``.
        eval_examples: the held-out examples (disjoint from every training example).
        rewards: reward functions by name.
        default_rewards: (name, weight) pairs used when the recipe names none.
        environment: for multi-turn tasks, a new environment for an example (each episode,
            each member of a group, gets its own); None for single-turn tasks.
    """

    train_example: Callable[[int, int], Example]
    eval_examples: list[Example]
    rewards: dict[str, RewardFn]
    default_rewards: list[tuple[str, float]]
    environment: Callable[[Example], Environment] | None = None


def build_task(name: str, **task_args: Any) -> Task:
    """The task called ``name`` with its keyword arguments.

    Raises:
        ValueError: for an unknown task or invalid arguments.
    """
    builders = {"arith": arith_task, "calculator": calculator_task, "dataset": dataset_task,
                "gsm8k": gsm8k_task, "target_token": target_token_task}
    if name not in builders:
        raise ValueError(f"unknown task {name!r}: use one of {', '.join(builders)}.")
    try:
        return builders[name](**task_args)
    except TypeError as error:
        raise ValueError(f"task {name!r}: {error}.") from error


def last_integer(text: str) -> int | None:
    """The last integer written in ``text`` (None when there is none)."""
    numbers = INTEGER.findall(text.replace(",", ""))
    return int(numbers[-1]) if numbers else None


# --- arith -------------------------------------------------------------------------------

ARITH_SYSTEM = "Answer in one short line that ends with the number."
SHORT_ANSWER = re.compile(r"[^\n]{0,32}?-?\d+\.?")


def arith_task(max_operand: int = 9, operations: str = "+-", eval_size: int = 64) -> Task:
    """Questions ``What is a + b?`` over operands 0..max_operand, a fifth of them held out."""
    if max_operand < 1 or not operations or set(operations) - set("+-*"):
        raise ValueError("arith needs max_operand >= 1 and operations among '+-*'")
    questions = [(a, op, b) for a in range(max_operand + 1) for op in operations
                 for b in range(max_operand + 1)]
    held_out = [q for q in questions if _held_out(q)]
    train = [q for q in questions if not _held_out(q)]

    def train_example(seed: int, index: int) -> Example:
        return _arith_example(random.Random(seed * 1_000_003 + index).choice(train))

    rng = random.Random(1234)
    eval_questions = rng.sample(held_out, min(eval_size, len(held_out)))
    return Task(train_example, [_arith_example(q) for q in eval_questions],
                {"correct": correct_reward, "format": short_answer_reward},
                [("correct", 1.0), ("format", 0.5)])


def calculator_task(max_operand: int = 999, eval_size: int = 32,
                    timeout: float = 2.0) -> Task:
    """Products ``a * b`` too large to do in one's head, with a ``calculator`` tool.

    Episodes: the model may call the tool (Hermes format, taught by the system prompt and
    one worked example, as SmolLM2's template has no tools) and then answers; rewards
    ``correct`` (the last integer of its final message), ``tool_success`` (a call answered
    without an error) and ``format`` (the final message is one short line).
    """
    if max_operand < 10:
        raise ValueError("calculator needs max_operand >= 10")

    def example(rng: random.Random) -> Example:
        a, b = rng.randint(10, max_operand), rng.randint(10, max_operand)
        return {"prompt": [*CALCULATOR_SHOT, {"role": "user", "content": f"What is {a} * {b}?"}],
                "answer": a * b}

    def train_example(seed: int, index: int) -> Example:
        return example(random.Random(seed * 1_000_003 + index))

    rng = random.Random(4321)
    return Task(train_example, [example(rng) for _ in range(eval_size)],
                {"correct": correct_reward, "format": short_answer_reward,
                 "tool_success": tool_success_reward},
                [("correct", 0.7), ("tool_success", 0.3)],
                lambda _: ToolEnvironment([calculator], timeout, CALCULATOR_SYSTEM))


def tool_success_reward(completions: list[Completion], **_: Any) -> list[float]:
    """1 when the episode called a tool and got an answer that is not an error, else 0."""
    return [float(not isinstance(c, str) and any(
        m["role"] == "tool" and not m["content"].startswith("error:") for m in c))
        for c in completions]


CALCULATOR_SYSTEM = (
    "You can use a calculator. To call it, write exactly <tool_call>{\"name\": "
    "\"calculator\", \"arguments\": {\"expression\": \"12 * 34\"}}</tool_call> and wait for "
    "its answer. Then answer in one short line that ends with the number.")


CALCULATOR_SHOT = [
    {"role": "user", "content": "What is 12 * 34?"},
    {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": '
                                     '{"expression": "12 * 34"}}</tool_call>'},
    {"role": "tool", "content": "408"},
    {"role": "assistant", "content": "12 * 34 = 408"}]


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with + - * / and parentheses.

    Args:
        expression: the expression, for example "347 * 29".
    """
    return str(_evaluate(ast.parse(expression, mode="eval").body))


ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv}


def _evaluate(node: ast.AST) -> int | float:
    """An arithmetic expression's value: integers, + - * / and unary minus, nothing else."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in ARITHMETIC:
        return ARITHMETIC[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError("only integers, + - * / and parentheses are allowed")


def _held_out(question: tuple[int, str, int]) -> bool:
    return zlib.crc32(repr(question).encode()) % 5 == 0


def _arith_example(question: tuple[int, str, int]) -> Example:
    a, op, b = question
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    return {"prompt": [{"role": "system", "content": ARITH_SYSTEM},
                       {"role": "user", "content": f"What is {a} {op} {b}?"}],
            "answer": answer}


def correct_reward(completions: list[Completion], answer: list[int], **_: Any) -> list[float]:
    """1 when the completion's last integer is the answer, else 0."""
    return [float(last_integer(completion_text(c)) == int(a))
            for c, a in zip(completions, answer)]


def short_answer_reward(completions: list[Completion], **_: Any) -> list[float]:
    """1 when the completion is one line of at most about 40 characters ending with an integer
    (and maybe a period), such as ``12`` or ``5 + 7 = 12.``, else 0."""
    return [float(SHORT_ANSWER.fullmatch(completion_text(c).strip()) is not None)
            for c in completions]


# --- dataset, gsm8k ----------------------------------------------------------------------

GSM8K_SYSTEM = ("Solve the problem step by step, then write the final answer on its own "
                "line as '#### <number>'.")


def dataset_task(path: str | dict[str, str], eval_size: int = 128,
                 system_prompt: str | None = None, verify_timeout: float = 5.0,
                 **source: Any) -> Task:
    """Prompts from a ``datasets`` table's ``prompt`` column (text, or a conversation of
    ``{role, content}`` messages), every other column passed to the rewards.

    Args:
        path, source: where the rows come from (``DatasetSource``'s fields: ``split``,
            ``subset``, ``eval_split`` or ``eval_fraction``, ``eval_seed``).
        eval_size: the most held-out examples.
        system_prompt: put before each prompt as a system message (a text prompt becomes
            the user's message).
        verify_timeout: seconds the ``correct`` reward may spend on one completion.

    Raises:
        ValueError: for a missing file or column, an unknown split or bad arguments.
        ImportError: when ``datasets`` or math-verify is not installed.
    """

    def example(row: dict[str, Any]) -> Example:
        prompt = row["prompt"]
        if system_prompt is not None:
            turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            prompt = [{"role": "system", "content": system_prompt}, *turns]
        return {**row, "prompt": prompt}

    prompts = load_prompts(DatasetSource(path, **source), ("prompt",), example, "dataset")
    return Task(prompts.train_example, prompts.eval_examples(eval_size),
                math_rewards(verify_timeout), [("correct", 1.0)])


def gsm8k_task(path: str | dict[str, str], eval_size: int = 128, verify_timeout: float = 5.0,
               **source: Any) -> Task:
    """``dataset_task`` on GSM8K's format: each ``question`` under a system prompt asking
    for ``#### <number>``, its ``answer`` what follows the solution's ``####`` (all of it
    when there is none); rewards ``correct`` and ``format`` (``hash_format``). Arguments and
    errors as ``dataset_task``'s.
    """

    def example(row: dict[str, Any]) -> Example:
        return {"prompt": [{"role": "system", "content": GSM8K_SYSTEM},
                           {"role": "user", "content": row["question"]}],
                "answer": str(row["answer"]).rpartition("####")[2].strip().replace(",", "")}

    prompts = load_prompts(DatasetSource(path, **source), ("question", "answer"), example,
                           "gsm8k")
    rewards = {**math_rewards(verify_timeout), "format": hash_format_reward}
    return Task(prompts.train_example, prompts.eval_examples(eval_size), rewards,
                [("correct", 1.0), ("format", 0.2)])


# --- target_token ------------------------------------------------------------------------

WORDS = ("the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far")


def target_token_task(token_id: int, eval_size: int = 8) -> Task:
    """Text prompts of 3 to 6 words; the reward is the share of ``token_id`` in a completion."""

    def example(rng: random.Random) -> Example:
        return {"prompt": " ".join(rng.choices(WORDS, k=rng.randint(3, 6)))}

    def train_example(seed: int, index: int) -> Example:
        return example(random.Random(seed * 1_000_003 + index))

    def target_reward(completion_ids: list[list[int]], **_: Any) -> list[float]:
        return [sum(t == token_id for t in ids) / max(len(ids), 1) for ids in completion_ids]

    rng = random.Random(-1)
    return Task(train_example, [example(rng) for _ in range(eval_size)],
                {"target": target_reward}, [("target", 1.0)])
