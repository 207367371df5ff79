"""Writing checkpoints: the policy as a Hugging Face folder any engine or
``from_pretrained`` loads (or, under LoRA, the peft adapter), the value head and the trainer
state, into a folder that appears under its name only once complete.

Test seam: ``TANDEM_CHECKPOINT_FAULT=STEP:MARKER`` stops the save of checkpoint STEP halfway
(see ``pause_for_fault``), so a test can kill a real run in the middle of a save.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import PreTrainedTokenizerBase

FAULT_ENV = "TANDEM_CHECKPOINT_FAULT"


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
    ``path`` for a resume to load (only the stage, replaced by the next save of that step
    and removed by ``prune_checkpoints`` after any complete save)."""
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


def save_trainer_state(stage: Path, step: int, rank: int, run_state: dict[str, Any] | None,
                       optimizer: torch.optim.Optimizer,
                       scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """Write the rest of checkpoint ``step`` into ``stage`` after the policy: rank 0's
    ``trainer_state.json`` (``{"step": step, **run_state}``; ``run_state`` is None on the
    other ranks) and this rank's optimizer, schedule and RNG state."""
    pause_for_fault(step)
    if run_state is not None:
        (stage / "trainer_state.json").write_text(
            json.dumps({"step": step, **run_state}, indent=1, default=str))
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "rng": torch.get_rng_state()}, stage / f"optimizer-rank{rank}.pt")


def load_trainer_state(path: Path, rank: int, optimizer: torch.optim.Optimizer,
                       scheduler: torch.optim.lr_scheduler.LRScheduler
                       ) -> tuple[int, str | None]:
    """Restore this rank's optimizer, schedule and RNG state from checkpoint ``path``
    (tensors and plain containers only: ``weights_only``).

    Returns:
        The checkpoint's step and the W&B run id it was saved with (None without W&B, or
        for a checkpoint older than the id's field).
    """
    state = json.loads((path / "trainer_state.json").read_text())
    saved = torch.load(path / f"optimizer-rank{rank}.pt", weights_only=True)
    optimizer.load_state_dict(saved["optimizer"])
    scheduler.load_state_dict(saved["scheduler"])
    torch.set_rng_state(saved["rng"])
    return state["step"], state.get("wandb_run_id")


def pause_for_fault(step: int) -> None:
    """Test seam (fault injection; does nothing unless ``TANDEM_CHECKPOINT_FAULT`` is set).

    With ``TANDEM_CHECKPOINT_FAULT=STEP:MARKER`` the save of checkpoint ``STEP`` stops here,
    its policy files written and its trainer state not, creates the file ``MARKER`` and
    waits to be killed: tests/test_checkpoints.py SIGKILLs a real ``tandem train`` there.
    """
    fault = os.environ.get(FAULT_ENV)
    if fault is None:
        return
    fault_step, marker = fault.split(":", 1)
    if int(fault_step) != step:
        return
    Path(marker).touch()
    while True:
        time.sleep(1)


def prune_checkpoints(output_dir: Path, keep: int) -> None:
    """Delete the stages that saves killed midway left in ``output_dir`` and all but the
    newest ``keep`` complete checkpoints (``keep=0``: all of them stay)."""
    for stage in output_dir.glob(".checkpoint-*.partial"):
        shutil.rmtree(stage, ignore_errors=True)
    for path in checkpoints_in(output_dir)[:-keep] if keep else []:
        shutil.rmtree(path)
