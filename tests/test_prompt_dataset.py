"""Prompt datasets from local files through ``datasets``: formats, columns, held-out sets that
never meet training, and a training stream that repeats with the seed."""

from __future__ import annotations

import csv
import json
import random
import subprocess
import sys
from collections import Counter

import pytest

from tandem.trainers.prompt_dataset import DatasetSource, load_prompts

pytestmark = pytest.mark.usefixtures("datasets_cache")
ROWS = [{"prompt": f"What is {a} + {b}?", "answer": a + b}
        for a, b in random.Random(7).sample([(a, b) for a in range(20) for b in range(20)], 41)]


def write(tmp_path, suffix: str, rows: list[dict]) -> str:
    path = tmp_path / f"rows{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif suffix == ".csv":
        with path.open("w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def load(path, **source):
    return load_prompts(DatasetSource(path, **source), ("prompt",), dict, "dataset")


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".parquet"])
def test_each_file_format_yields_every_row_with_its_columns(tmp_path, suffix):
    prompts = load(write(tmp_path, suffix, ROWS), eval_fraction=0.0)
    rows = [prompts.train_example(0, i) for i in range(len(ROWS))]
    assert sorted(rows, key=str) == sorted(ROWS, key=str)
    assert prompts.eval_examples(8) == []


def test_conversation_prompts_keep_their_messages(tmp_path):
    conversation = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "What is 2 + 2?"}]
    prompts = load(write(tmp_path, ".jsonl", [{"prompt": conversation, "answer": 4}]),
                   eval_fraction=0.0)
    assert prompts.train_example(0, 0) == {"prompt": conversation, "answer": 4}


def test_a_missing_prompt_column_names_the_columns_found(tmp_path):
    path = write(tmp_path, ".jsonl", [{"question": "Why?", "answer": "1"}])
    with pytest.raises(ValueError, match="no 'prompt' column; its columns are question, answer"):
        load(path)


@pytest.mark.parametrize("path, message", [
    ("missing.jsonl", "missing.jsonl does not exist"),
    ({"train": "a.jsonl", "test": "b.csv"}, "does not exist"),
    ("nobody/no-such-dataset", "neither a local .jsonl/.json/.parquet/.csv file nor a dataset "
                               "in the local Hugging Face cache"),
])
def test_missing_files_and_uncached_hub_names_are_refused(path, message):
    with pytest.raises(ValueError, match=message):
        load(path)


def test_files_of_two_kinds_and_unknown_splits_are_refused(tmp_path):
    jsonl, parquet = write(tmp_path, ".jsonl", ROWS), write(tmp_path, ".parquet", ROWS)
    with pytest.raises(ValueError, match="must all be one of"):
        load({"train": jsonl, "test": parquet})
    with pytest.raises(ValueError, match="no split 'test'; its splits are train"):
        load(jsonl, eval_split="test")
    with pytest.raises(ValueError, match="hold out one way, not both"):
        DatasetSource(jsonl, eval_split="test", eval_fraction=0.1)
    with pytest.raises(ValueError, match=r"eval_fraction=1.0 is invalid"):
        DatasetSource(jsonl, eval_fraction=1.0)


def test_an_eval_split_comes_from_its_own_file(tmp_path):
    train = write(tmp_path, ".jsonl", ROWS[:30])
    (tmp_path / "test").mkdir()
    test = write(tmp_path / "test", ".jsonl", ROWS[30:])
    prompts = load({"train": train, "test": test}, eval_split="test")
    assert prompts.eval_examples(100) == ROWS[30:]
    assert {prompts.train_example(0, i)["prompt"] for i in range(30)} == \
        {row["prompt"] for row in ROWS[:30]}


def test_held_out_share_never_meets_training_even_for_repeated_prompts(tmp_path):
    rows = ROWS + ROWS[:10]  # ten prompts twice: both copies fall on one side
    prompts = load(write(tmp_path, ".jsonl", rows), eval_fraction=0.3)
    held_out = {row["prompt"] for row in prompts.eval_examples(len(rows))}
    train = {prompts.train_example(0, i)["prompt"] for i in range(-200, 200)}
    assert held_out and not held_out & train
    assert held_out | train == {row["prompt"] for row in rows}
    assert 0.15 < len(prompts.eval_examples(len(rows))) / len(rows) < 0.45
    other = load(write(tmp_path, ".jsonl", rows), eval_fraction=0.3, eval_seed=1)
    assert {row["prompt"] for row in other.eval_examples(len(rows))} != held_out


def test_training_stream_repeats_with_the_seed_and_visits_each_row_once_an_epoch(tmp_path):
    prompts = load(write(tmp_path, ".jsonl", ROWS), eval_fraction=0.0)
    size = len(ROWS)
    for epoch in (-1, 0, 3):
        seen = Counter(prompts.train_example(5, epoch * size + i)["prompt"] for i in range(size))
        assert set(seen.values()) == {1} and len(seen) == size
    stream = [prompts.train_example(5, i) for i in range(2 * size)]
    again = load(write(tmp_path, ".jsonl", ROWS), eval_fraction=0.0)
    assert [again.train_example(5, i) for i in range(2 * size)] == stream
    assert [prompts.train_example(6, i) for i in range(size)] != stream[:size]
    assert stream[:size] != stream[size:]  # each epoch its own order


def test_importing_the_tasks_loads_neither_datasets_nor_math_verify():
    code = ("import sys, tandem.trainers.tasks, tandem.rollout; "
            "print(sorted({'datasets', 'math_verify'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]"
