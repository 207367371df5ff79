"""The GPU check runs end to end at toy sizes on a CPU (``gpu_check.sh --smoke``), each of
its sections lets go of its engines before the next starts, and the parts that need more
devices than there are are recorded skipped."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = {"kernels", "tokens", "sync_free", "memory", "lifecycle", "updates", "ipc",
            "receive_decode", "bandwidth", "sliding", "families", "decode", "nano_bench",
            "server", "grpo", "structured", "exact", "moe", "moe_graphs", "fp8_kv", "quantized",
            "resources", "qwen3_8b", "tensor_parallel", "devices"}
SYNC_FREE_CONFIGS = ["dense, greedy", "min_tokens", "penalties", "top-p/top-k", "seeded",
                     "unseeded", "log-probs, top 5", "MoE, fused Triton experts",
                     "routing replay", "FP8 KV", "int8 weights"]


def benchmark_modules(*names: str) -> list[ModuleType]:
    """The GPU check's modules, imported from ``benchmarks/``."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return [importlib.import_module(name) for name in names]
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.fixture(scope="module")
def smoke_rows(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    """The rows of one smoke run of the launcher, as a user runs it (no wheels folder)."""
    out = tmp_path_factory.mktemp("gpu_check")
    env = os.environ | {"CHECK_TIMEOUT": "1500", "WHEELS": str(out / "no-wheels")}
    run = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), str(out),
                          "--smoke"], env=env, capture_output=True, text=True, timeout=1600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return rows, out


def test_smoke_run_records_every_section_without_failures(smoke_rows):
    rows, out = smoke_rows
    assert {row["section"] for row in rows} >= SECTIONS
    failed = [row for row in rows if row["name"] in ("failed", "skipped")]
    assert not failed, failed
    assert [row for row in rows if row.get("ok") is False] == []
    assert [row["equal_sequences"] for row in rows
            if row["name"].startswith("greedy tokens, TP=2")] == ["2/2", "2/2"]
    assert (out / "table.md").read_text().startswith("| section |")
    assert not (out / "tracebacks.txt").exists()


def test_smoke_run_writes_at_most_eight_files_two_folders_deep(smoke_rows):
    _, out = smoke_rows
    files = [path for path in out.rglob("*") if path.is_file()]
    assert len(files) <= 8, files
    assert all(len(path.relative_to(out).parts) <= 3 for path in files)


def test_every_section_leaves_no_engine_alive(smoke_rows):
    rows, _ = smoke_rows
    between = {row["section"]: row for row in rows if row["name"] == "between"}
    assert set(between) == SECTIONS
    assert all(row["engines_alive"] == 0 and row["held_gib"] == 0 for row in between.values())


def test_smoke_run_checks_every_sync_free_configuration_and_the_new_sections(smoke_rows):
    rows, _ = smoke_rows
    sync_free = [row for row in rows if row["section"] == "sync_free" and row["name"] != "between"]
    assert [row["name"] for row in sync_free] == SYNC_FREE_CONFIGS
    assert all(row["launches"] == 2 and "error" not in row for row in sync_free)
    checked = {(row["section"], row["name"]): row for row in rows if "ok" in row}
    assert checked["moe_graphs", "greedy tokens, graphs = eager (float32)"]["ok"]
    received = checked["receive_decode", "decode tok/s during full updates over none"]
    assert received["ok"] and received["updates"] == 2 and received["all_equal"]
    assert checked["devices", "engine on cuda:1 = on cuda:0"]["ok"]
    assert checked["devices", "NCCL update during generation = fresh engine"]["ok"]


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="runs every part on two GPUs")
def test_the_multi_device_parts_are_recorded_skipped_on_one_device(tmp_path):
    common, devices = benchmark_modules("gpu_check_common", "gpu_check_devices")
    rec = common.Recorder(tmp_path, 600, smoke=False)  # CUDA's device, with none or one GPU
    devices.check_devices(rec, tmp_path / "never-read", tmp_path)
    rows = [json.loads(line) for line in rec.path.read_text().splitlines()]
    assert rows == [{"section": "devices", "name": "skipped", "part": part, "reason": "one device"}
                    for part in devices.PARTS]


def test_a_section_that_keeps_its_engine_is_reported(tmp_path, llama_dir):
    gpu_check, common = benchmark_modules("gpu_check", "gpu_check_common")
    run_section, Recorder = gpu_check.run_section, common.Recorder
    live_engines, make_llm = common.live_engines, common.make_llm
    rec = Recorder(tmp_path, 600, smoke=True)
    kept = []
    run_section(rec, "releases", 0, lambda: make_llm(rec, llama_dir).generate([[3, 4]]),
                baseline=0)
    run_section(rec, "keeps", 0, lambda: kept.append(make_llm(rec, llama_dir)), baseline=0)
    rows = {row["section"]: row for row in map(json.loads, rec.path.read_text().splitlines())}
    assert rows["releases"]["engines_alive"] == 0 and rows["releases"]["ok"]
    assert rows["keeps"]["engines_alive"] == 1 and not rows["keeps"]["ok"]
    engines = live_engines()
    kept.clear()
    assert live_engines() == engines - 1
