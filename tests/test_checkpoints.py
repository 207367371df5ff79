"""Checkpoints that survive a kill: a real ``tandem train`` SIGKILLed in the middle of a save
resumes from the last complete checkpoint and repeats the lost step exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tandem.trainers.checkpoints import FAULT_ENV, checkpoints_in, prune_checkpoints

ROOT = Path(__file__).resolve().parent.parent
# PPO (its value loss is not 0 on-policy, as GRPO's is) on a reward that spreads in every
# group; lr large enough that step 1 changes step 2's rollouts.
TRAIN = ("task=target_token", "task_args={token_id: 0}", "algorithm=ppo", "steps=2",
         "rewards=[{name: 'tests.test_checkpoints:mean_token_reward'}]", "optim.lr=0.01",
         "checkpoint_every=1", "rollout.prompts_per_step=1", "rollout.num_generations=2",
         "rollout.max_tokens=4", "rollout.engine={num_kv_blocks: 32, max_model_len: 64}",
         "logging.wandb=false", "logging.progress_bar=false")
TIMEOUT_S = 120


def mean_token_reward(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """The completion's mean token id over 1000: a reward whose groups always spread."""
    return [sum(ids) / max(len(ids), 1) / 1000 for ids in completion_ids]


def start_train(model: Path, output_dir: Path, log: Path, *overrides: str,
                fault: str | None = None) -> subprocess.Popen:
    """``tandem train`` on the tiny model in a subprocess, its output into ``log``."""
    env = {key: value for key, value in os.environ.items() if key != FAULT_ENV}
    env["OMP_NUM_THREADS"] = "2"
    if fault is not None:
        env[FAULT_ENV] = fault
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", "train", f"model={model}",
             f"output_dir={output_dir}", *TRAIN, *overrides],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_for(marker: Path, process: subprocess.Popen, log: Path) -> None:
    """Wait until ``process`` creates ``marker``; fail with its output if it ends first."""
    deadline = time.monotonic() + TIMEOUT_S
    while not marker.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the run never reached the fault point:\n{log.read_text()}")
        time.sleep(0.05)


def metrics(output_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_run_killed_while_saving_resumes_from_the_last_complete_checkpoint(llama_dir,
                                                                             tmp_path):
    """The killed run's step 2 ran uninterrupted before its save began, so its logged
    metrics are the reference the resumed run's step 2 must repeat."""
    output_dir, marker, log = tmp_path / "run", tmp_path / "saving-2", tmp_path / "train.log"
    killed = start_train(llama_dir, output_dir, log, fault=f"2:{marker}")
    try:
        wait_for(marker, killed, log)
        killed.send_signal(signal.SIGKILL)
        killed.wait(TIMEOUT_S)
    finally:
        if killed.poll() is None:
            killed.kill()
    stage = output_dir / ".checkpoint-2.partial"
    assert (stage / "model.safetensors").exists() and not (stage / "trainer_state.json").exists()
    assert [p.name for p in checkpoints_in(output_dir)] == ["checkpoint-1"]
    interrupted = metrics(output_dir)
    assert [m["step"] for m in interrupted] == [1, 2]

    resumed_run = start_train(llama_dir, output_dir, log, "resume_from=latest")
    assert resumed_run.wait(TIMEOUT_S) == 0, log.read_text()
    printed = log.read_text()
    assert "step 2:" in printed and "step 1:" not in printed  # it went on from checkpoint-1
    resumed = metrics(output_dir)
    assert [m["step"] for m in resumed] == [1, 2] and resumed[0] == interrupted[0]
    for key in ("loss", "grad_norm", "kl"):
        assert resumed[1][key] == pytest.approx(interrupted[1][key], rel=1e-5, abs=1e-7), key
    assert resumed[1]["reward"] == interrupted[1]["reward"]
    assert [p.name for p in checkpoints_in(output_dir)] == ["checkpoint-1", "checkpoint-2"]
    assert (output_dir / "checkpoint-2" / "trainer_state.json").exists()
    assert not stage.exists()


def test_a_complete_save_removes_the_stages_of_killed_saves(tmp_path):
    for name in ("checkpoint-1", "checkpoint-2", ".checkpoint-3.partial", ".checkpoint-7.partial"):
        (tmp_path / name).mkdir()
    prune_checkpoints(tmp_path, keep=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "checkpoint-2"]
    prune_checkpoints(tmp_path, keep=1)
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-2"]
