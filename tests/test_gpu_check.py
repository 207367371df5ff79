"""The GPU check runs end to end at toy sizes on a CPU (``gpu_check.sh --smoke``), and each
of its sections lets go of its engines before the next starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = {"kernels", "tokens", "memory", "lifecycle", "updates", "ipc", "bandwidth", "decode",
            "nano_bench", "server", "grpo", "structured", "exact", "moe", "fp8_kv", "quantized",
            "resources", "qwen3_8b", "tensor_parallel"}


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


def test_a_section_that_keeps_its_engine_is_reported(tmp_path, llama_dir):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from gpu_check import run_section
        from gpu_check_common import Recorder, live_engines, make_llm
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
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
