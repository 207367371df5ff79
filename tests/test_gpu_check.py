"""The GPU check script runs end to end at toy sizes on a CPU (``--smoke``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_run_records_every_section_without_failures(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), str(tmp_path),
                    "--smoke"], check=True, capture_output=True, timeout=600)
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert {row["section"] for row in rows} >= {"kernels", "bandwidth", "decode", "nano_bench",
                                                "tensor_parallel"}
    assert [row["equal_sequences"] for row in rows
            if row["name"].startswith("greedy tokens, TP=2")] == ["2/2", "2/2"]
    assert not [row for row in rows if row["name"] in ("failed", "skipped")]
    assert all(row["ok"] for row in rows if "ok" in row)
    assert (tmp_path / "table.md").read_text().startswith("| section |")
