"""Data-parallel GRPO under torchrun (2 processes, gloo): every rank's engine in step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("distributed_worker.py")


def two_rank_run(llama_dir, tmp_path, mode: str, engine: str = "",
                 extra: tuple[str, ...] = ()) -> list[list[dict]]:
    """Two GRPO steps under torchrun (2 processes, gloo); each step's records of both ranks
    (see distributed_worker.py). ``engine`` adds options to the engine's, ``extra`` more
    overrides."""
    out = tmp_path / "records.json"
    overrides = [f"model={llama_dir}", "task=target_token", "task_args={token_id: 100}",
                 "steps=2", f"distributed={mode}", f"output_dir={tmp_path}",
                 "rollout.prompts_per_step=4", "rollout.num_generations=4",
                 "rollout.max_tokens=6",
                 f"rollout.engine={{num_kv_blocks: 64, max_model_len: 128, device: cpu{engine}}}",
                 "optim.lr=1e-2", "logging.wandb=false", "logging.progress_bar=false", *extra]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                          "2", "--standalone", str(WORKER), str(out), *overrides],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_every_rank_engine_gets_the_same_weights_each_step(llama_dir, tmp_path, mode):
    records = two_rank_run(llama_dir, tmp_path, mode)
    assert len(records) == 2
    for step, ranks in enumerate(records, start=1):
        assert [r["version"] for r in ranks] == [step, step]
        assert ranks[0]["checksum"] == ranks[1]["checksum"]
        assert ranks[0]["trainer_checksum"] == ranks[1]["trainer_checksum"]
    assert records[0][0]["checksum"] != records[1][0]["checksum"]
