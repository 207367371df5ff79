"""Writing checkpoints: the policy as a Hugging Face folder any engine or
``from_pretrained`` loads (or, under LoRA, the peft adapter) and the value head, into a
folder that appears under its name only once complete."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import PreTrainedTokenizerBase


def save_policy(path: Path, model: torch.nn.Module, weights: dict[str, torch.Tensor],
                tokenizer: PreTrainedTokenizerBase, lora: bool) -> None:
    """Write ``model`` (its full ``weights`` by the policy's names, ``model.``-prefixed, or
    its adapter when ``lora``) and any ``value_head.`` weights into ``path``."""
    if lora:
        model.save_pretrained(path)
    else:
        save_file({name.removeprefix("model."): tensor.contiguous()
                   for name, tensor in weights.items() if name.startswith("model.")},
                  path / "model.safetensors", metadata={"format": "pt"})
        model.config.save_pretrained(path)
        tokenizer.save_pretrained(path)
    value_head = {name.removeprefix("value_head."): tensor
                  for name, tensor in weights.items() if name.startswith("value_head.")}
    if value_head:
        save_file(value_head, path / "value_head.safetensors")


@contextmanager
def staged_folder(path: Path, is_main: bool, barrier: Callable[[], None]) -> Iterator[Path]:
    """A temporary sibling of ``path`` to write a checkpoint into, renamed to ``path`` once
    the block has completed on every rank: a run killed while saving leaves no torn
    ``path`` for a resume to load (only the stage, replaced by the next save)."""
    stage = path.with_name(f".{path.name}.partial")
    if is_main:
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir(parents=True)
    barrier()
    yield stage
    barrier()
    if is_main:
        shutil.rmtree(path, ignore_errors=True)
        stage.rename(path)
    barrier()


def checkpoints_in(output_dir: Path) -> list[Path]:
    """The complete ``checkpoint-N`` folders of ``output_dir``, oldest step first."""
    found = [p for p in output_dir.glob("checkpoint-*") if re.fullmatch(r"checkpoint-\d+", p.name)
             and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def resolve_resume(resume_from: str | None, output_dir: Path) -> Path | None:
    """The folder to resume from: ``resume_from`` itself, or for ``"latest"`` the newest
    complete checkpoint of ``output_dir`` (None when there is none yet: a fresh start).

    Raises:
        ValueError: for a folder that is not a complete checkpoint.
    """
    if resume_from is None:
        return None
    if resume_from == "latest":
        found = checkpoints_in(output_dir)
        return found[-1] if found else None
    path = Path(resume_from)
    if not (path / "trainer_state.json").exists():
        raise ValueError(f"resume_from={resume_from!r} is not a complete checkpoint (no "
                         "trainer_state.json): give a checkpoint-N folder, or 'latest'.")
    return path


def prune_checkpoints(output_dir: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints of ``output_dir``."""
    for path in checkpoints_in(output_dir)[:-keep]:
        shutil.rmtree(path)
