"""Schemathesis, the fuzzer operators point at OpenAPI servers, against ``tandem serve``'s own
schema (/openapi.json): its CLI (``st run``), authenticated, every check it has, bounded in
examples per operation (``SCHEMATHESIS_MAX_EXAMPLES``, default 30) and in time.

Every check runs but ``positive_data_acceptance``: the server's limits (``--max-tokens``,
``--max-n``, ``--max-logprobs``, the vocabulary, the longest prompt) are runtime values the
schema cannot state, so a schema-valid request past one is refused with a 400 that names
the limit, by design. The ``timeout`` extension is left out of generated bodies
(tests/schemathesis_hooks.py says why).

The server runs as a trainer's does: its engine-control routes served under a control key
of their own, which the fuzzer does not hold. It holds the inference key, as any client
would, so every control operation (/sleep, /release_kv_cache_memory, /pause, ...) must be
refused (403, as the schema says) and can no longer leave the engine asleep or paused for
everyone: after the run the engine is awake and unpaused, its weights intact, it answers a
plain completion and holds no KV block (Schemathesis warns that those operations answered
only 401/403: that is the point). The weight-transfer routes are not served (no
--enable-weight-transfer), so they are not in the schema; tests/test_server_control.py and
tests/test_weight_transfer_security.py pin what the control key opens.

Run with ``-s`` to see Schemathesis's own summary (requests and status codes).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import httpx
import pytest

from .test_server import (
    API_KEY,
    AUTH,
    CONTROL_OPTIONS,
    MODEL,
    running_server,
    wait_until_idle,
)

pytest.importorskip("schemathesis")

HERE = str(Path(__file__).parent)
MAX_EXAMPLES = int(os.environ.get("SCHEMATHESIS_MAX_EXAMPLES", "30"))


def schemathesis_command(url: str, report: Path) -> list[str]:
    """``st run`` over the server's schema, every check, bounded, with a JSON report."""
    st = shutil.which("st", path=str(Path(sys.executable).parent)) or "st"
    return [st, "run", f"{url}/openapi.json", "--checks", "all",
            "--exclude-checks", "positive_data_acceptance",
            "-H", f"Authorization: Bearer {API_KEY}",
            "--max-examples", str(MAX_EXAMPLES), "--seed", "0", "--workers", "2",
            "--request-timeout", "30", "--no-shrink",
            "--report", "ndjson", "--report-ndjson-path", str(report)]


def status_counts(report: Path) -> Counter:
    """How many of the run's requests got each status code (from its NDJSON events)."""
    counts: Counter = Counter()
    for line in report.read_text().splitlines():
        scenario = json.loads(line).get("ScenarioFinished")
        if scenario is None:
            continue
        for interaction in scenario["recorder"].get("interactions", {}).values():
            if interaction.get("response") is not None:
                counts[interaction["response"]["status_code"]] += 1
    return counts


def test_schemathesis_finds_no_server_error_or_schema_violation(llama_dir, tmp_path):
    engine_options = {"num_kv_blocks": 64, "max_model_len": 256, "max_num_seqs": 16}
    with running_server(llama_dir, engine_options, max_tokens=32, max_n=4,
                        **CONTROL_OPTIONS) as (url, engine):
        run = subprocess.run(schemathesis_command(url, tmp_path / "events.ndjson"),
                             capture_output=True, text=True, timeout=900,
                             env=os.environ | {"NO_COLOR": "1", "PYTHONPATH": HERE,
                                               "SCHEMATHESIS_HOOKS": "schemathesis_hooks",
                                               "TANDEM_SERVED_MODEL": MODEL})
        print(run.stdout[-6000:])
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
        statuses = status_counts(tmp_path / "events.ndjson")
        print(f"{sum(statuses.values())} requests, by status: {dict(sorted(statuses.items()))}")
        assert not [status for status in statuses if status >= 500]
        assert statuses[403] > 0  # the control operations, refused to the inference key
        wait_until_idle(engine)
        assert not engine.is_sleeping and not engine.weights_stale
        assert httpx.get(f"{url}/is_paused", headers=AUTH).json() == {"is_paused": False}
        response = httpx.post(f"{url}/v1/completions", json={
            "model": MODEL, "prompt": "Hello", "max_tokens": 3}, headers=AUTH, timeout=30)
        assert response.status_code == 200
        assert len(response.json()["choices"][0]["text"]) >= 0
        wait_until_idle(engine)
        assert engine.stats()["kv_blocks_used"] == 0
