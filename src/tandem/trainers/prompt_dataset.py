"""Prompt datasets read with Hugging Face ``datasets``: a local JSON-lines, JSON, parquet or
CSV file, or a Hub dataset already in the local cache.

``load_prompts`` reads the training split and a held-out set (another split, or a seeded
share of the training split's prompts) and checks the columns. ``PromptDataset`` serves the
training stream epoch by epoch, each epoch a permutation drawn from the seed, so a run
repeats its prompts exactly and sees every row once an epoch. ``datasets`` is imported
inside ``load_prompts``: importing this module needs it not.
"""

from __future__ import annotations

import functools
import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from datasets import Dataset, DatasetDict

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
KINDS = "/".join(FILE_BUILDERS)
Row = dict[str, Any]


@dataclass(slots=True)
class DatasetSource:
    """Where a task's prompts come from (task arguments of the dataset-backed tasks).

    Attributes:
        path: a local ``.jsonl``/``.json``/``.parquet``/``.csv`` file, a mapping of split
            name to such files, or a Hub dataset name (``openai/gsm8k``) found in the local
            cache (or a local dataset folder).
        split: the training split (a single file's split is ``train``).
        subset: the Hub dataset's configuration (``main`` for GSM8K).
        eval_split: the held-out split; None: hold out ``eval_fraction`` of ``split``.
        eval_fraction: the share of ``split``'s prompts held out, by a hash of each prompt
            salted with ``eval_seed`` (a repeated prompt is never on both sides); default 0.1
            without ``eval_split``, 0 for none.
        eval_seed: salts the held-out hash (another seed, another held-out set).
    """

    path: str | dict[str, str]
    split: str = "train"
    subset: str | None = None
    eval_split: str | None = None
    eval_fraction: float | None = None
    eval_seed: int = 0

    def __post_init__(self) -> None:
        if self.eval_split is not None and self.eval_fraction is not None:
            raise ValueError(f"eval_split={self.eval_split!r} and eval_fraction="
                             f"{self.eval_fraction!r}: hold out one way, not both.")
        if self.eval_fraction is not None and not 0 <= self.eval_fraction < 1:
            raise ValueError(f"eval_fraction={self.eval_fraction!r} is invalid: it must be in "
                             "[0, 1).")


@dataclass(slots=True)
class PromptDataset:
    """A training table and a held-out table whose rows ``to_example`` turns into examples.

    Attributes:
        train: the training rows.
        held_out: the held-out rows (no prompt of theirs is a training prompt when they are
            a share of the training split).
        to_example: a row as the task's example (``{"prompt": ..., <column>: ...}``).
    """

    train: Dataset
    held_out: Dataset
    to_example: Callable[[Row], dict[str, Any]]

    def train_example(self, seed: int, index: int) -> dict[str, Any]:
        """The ``index``-th example of the stream seeded by ``seed``: epoch ``index // len``
        is one permutation of the rows (negative indices are epochs of their own)."""
        size = len(self.train)
        order = _epoch_order(size, seed, index // size)
        return self.to_example(self.train[order[index % size]])

    def eval_examples(self, size: int) -> list[dict[str, Any]]:
        """The first ``size`` held-out examples."""
        return [self.to_example(self.held_out[i]) for i in range(min(size, len(self.held_out)))]


def load_prompts(source: DatasetSource, required: tuple[str, ...],
                 to_example: Callable[[Row], dict[str, Any]], task: str) -> PromptDataset:
    """The training and held-out rows of ``source``; ``required[0]`` is the prompt's column.

    Raises:
        ValueError: naming ``task``, for a missing file, a dataset not in the cache, an unknown
            split, a missing column (naming the columns found) or no training rows left.
    """
    splits = _load_splits(source, task)
    train = _split(splits, source.split, task)
    missing = [column for column in required if column not in train.column_names]
    if missing:
        raise ValueError(f"{task}: the dataset has no {', '.join(map(repr, missing))} column; "
                         f"its columns are {', '.join(train.column_names)}.")
    if source.eval_split is not None:
        held_out = _split(splits, source.eval_split, task)
    else:
        fraction = 0.1 if source.eval_fraction is None else source.eval_fraction
        is_held_out = [_hash_share(source.eval_seed, prompt) < fraction
                       for prompt in train[required[0]]]
        held_out = train.select([i for i, out in enumerate(is_held_out) if out],
                                keep_in_memory=True)
        train = train.select([i for i, out in enumerate(is_held_out) if not out],
                             keep_in_memory=True)
    if len(train) == 0:
        raise ValueError(f"{task}: no training rows are left: lower eval_fraction or add rows.")
    return PromptDataset(train, held_out, to_example)


def _load_splits(source: DatasetSource, task: str) -> DatasetDict:
    import datasets

    files = source.path if isinstance(source.path, dict) else {"train": source.path}
    builder = _file_builder(source.path, files, task)
    if builder is not None:
        return datasets.load_dataset(builder, data_files={
            split: str(Path(file).expanduser()) for split, file in files.items()})
    try:
        return datasets.load_dataset(source.path, source.subset)
    except (ConnectionError, FileNotFoundError) as error:
        raise ValueError(f"{task}: {source.path!r} is neither a local {KINDS} file nor a "
                         f"dataset in the local Hugging Face cache: {error}") from error


def _file_builder(path: str | dict[str, str], files: dict[str, str], task: str) -> str | None:
    """The ``datasets`` builder of local files (``json``...); None for a Hub name or a folder."""
    suffixes = {Path(file).suffix for file in files.values()}
    if isinstance(path, str) and not suffixes <= FILE_BUILDERS.keys():
        return None
    missing = [file for file in files.values() if not Path(file).expanduser().is_file()]
    if missing:
        raise ValueError(f"{task}: {', '.join(missing)} does not exist: point task_args.path at "
                         f"a {KINDS} file, or at a Hub dataset in the local cache.")
    if len(suffixes) != 1 or not suffixes <= FILE_BUILDERS.keys():
        raise ValueError(f"{task}: task_args.path's files must all be one of {KINDS}, got "
                         f"{', '.join(sorted(suffixes))}.")
    return FILE_BUILDERS[suffixes.pop()]


def _split(splits: DatasetDict, name: str, task: str) -> Dataset:
    if name not in splits:
        raise ValueError(f"{task}: the dataset has no split {name!r}; its splits are "
                         f"{', '.join(splits)}.")
    return splits[name]


def _hash_share(seed: int, prompt: Any) -> float:
    """Where ``prompt`` falls in [0, 1): stable across runs, machines and row order."""
    return zlib.crc32(f"{seed}\0{prompt!r}".encode()) / 2**32


@functools.lru_cache(maxsize=8)
def _epoch_order(size: int, seed: int, epoch: int) -> tuple[int, ...]:
    """Epoch ``epoch``'s permutation of ``size`` rows; cached as a step reads many rows of
    one or two epochs (the steps' stream and the extra prompts')."""
    order = list(range(size))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return tuple(order)
