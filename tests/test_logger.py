"""The metrics sinks across a resume: metrics.jsonl goes on from the checkpoint's step and the
W&B run goes on under its id."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tandem.trainers.config import RolloutConfig, TrainConfig
from tandem.trainers.logger import keep_steps_up_to
from tandem.trainers.trainer import Trainer

from .test_trainer import make_config


def small_config(llama_dir: Path, output_dir: Path, **overrides) -> TrainConfig:
    rollout = RolloutConfig(prompts_per_step=1, num_generations=2, max_tokens=4,
                            engine={"num_kv_blocks": 32, "max_model_len": 64})
    return make_config(llama_dir, output_dir, 0, rollout=rollout, **overrides)


def logged(output_dir: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def test_keeping_steps_drops_later_steps_and_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": step, "loss": step / 10}) for step in (1, 2, 3)]
    path.write_text("\n".join(lines) + "\n" + '{"step": 4, "lo')
    keep_steps_up_to(path, 2)
    assert path.read_text() == lines[0] + "\n" + lines[1] + "\n"
    keep_steps_up_to(path, 0)  # a fresh start
    assert path.read_text() == ""
    keep_steps_up_to(tmp_path / "none.jsonl", 3)
    assert not (tmp_path / "none.jsonl").exists()


def test_a_resumed_run_logs_each_step_exactly_once(llama_dir, tmp_path):
    """Steps 1 to 3 logged, a checkpoint at 2, then the run dies: the resumed run drops the
    line of step 3 (lost with the run), logs it again and goes on to step 4."""
    first = Trainer(small_config(llama_dir, tmp_path, steps=3))
    for _ in range(3):
        metrics = first.train_step()
        first.logger.log(first.step, metrics)
        if first.step == 2:
            first.save_checkpoint()
    before = logged(tmp_path)
    resumed = Trainer(small_config(llama_dir, tmp_path, steps=4, resume_from="latest"))
    assert resumed.step == 2
    resumed.train()
    after = logged(tmp_path)
    assert [line["step"] for line in after] == [1, 2, 3, 4]
    assert after[:2] == before[:2]


def test_a_resumed_run_continues_its_wandb_run(llama_dir, tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    calls, real_init = [], wandb.init

    def recording_init(**kwargs):
        calls.append(kwargs)
        return real_init(**kwargs)

    monkeypatch.setattr(wandb, "init", recording_init)
    config = small_config(llama_dir, tmp_path, steps=1)
    config.logging.wandb = True
    Trainer(config).train()
    state = json.loads((tmp_path / "checkpoint-1" / "trainer_state.json").read_text())
    run_id = state["wandb_run_id"]
    resumed = Trainer(replace(config, steps=2, resume_from="latest"))
    resumed.train()
    assert "id" not in calls[0] and (calls[1]["id"], calls[1]["resume"]) == (run_id, "allow")
    assert resumed.logger.wandb_run_id == run_id
    # a run resumed within the second gets its folder name suffixed ("-1")
    assert len(list(tmp_path.glob(f"wandb/offline-run-*-{run_id}*"))) == 2
