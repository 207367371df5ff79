"""Every Triton kernel compiles ahead of time for sm_80 (A100) and sm_90 (H100, H200) at the
engine's shapes and dtypes, within each GPU's shared memory per block.

Triton compiles for a target without a device (``triton.compile`` down to PTX, then a cubin
from its bundled ptxas), so this runs in CPU-only CI and catches what the interpreter cannot:
compile errors and shared memory overflows. It runs ``triton_compile_worker.py`` in a
subprocess without ``TRITON_INTERPRET`` (conftest switches the interpreter on in this
process, and under it ``@triton.jit`` gives functions ``triton.compile`` refuses), with its
own Triton cache. The worker records the launches from the launchers themselves, so the
constexprs (block sizes), pointer dtypes and ``num_warps`` compiled are exactly what the
launchers pass, for head dims 16 and 32 (the tiny test models, float32) and 64 (SmolLM2, in
float32, bfloat16 and float16), with KV blocks of 16 tokens (the default).

Registers per thread and spills are not checked: Triton's figures for them (``n_regs``,
``n_spills``) come from the driver when it loads the cubin, so they wait for a device.
(ptxas reports them too, in the log ``TRITON_DUMP_PTXAS_LOG=1`` prints.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

WORKER = Path(__file__).with_name("triton_compile_worker.py")
TARGETS = ("sm_80", "sm_90")
# The opt-in maximum of shared memory per block: A100 (sm_80), H100 and H200 (sm_90).
SHARED_MEMORY_LIMIT = {"sm_80": 163 * 1024, "sm_90": 227 * 1024}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The worker's results: every kernel launch compiled for every target."""
    triton_home = tmp_path_factory.mktemp("triton")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env.update(TRITON_HOME=str(triton_home), TRITON_CACHE_DIR=str(triton_home / "cache"))
    results = triton_home / "compiled.json"
    run = subprocess.run([sys.executable, str(WORKER), str(results)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"the worker failed:\n{run.stderr[-4000:]}"
    return json.loads(results.read_text())


def _describe(record: dict[str, Any]) -> str:
    return (f"{record['kernel']} for {record['target']} ({record['geometry']}; "
            f"{record['constexprs']}; {record['pointers']})")


def test_every_kernel_compiles_for_sm80_and_sm90(compiled):
    failures = [f"{_describe(record)}: {record['error']}" for record in compiled["compiled"]
                if record["error"] is not None]
    assert not failures, "\n\n".join(failures)
    kernels = {record["kernel"] for record in compiled["compiled"]}
    assert {(kernel, target) for kernel in kernels for target in TARGETS} == {
        (record["kernel"], record["target"]) for record in compiled["compiled"]}


def test_every_jit_function_is_launched_or_called_by_a_launched_kernel(compiled):
    assert compiled["unlaunched"] == []
    kernels = {record["kernel"] for record in compiled["compiled"]}
    assert {"_store_kv_kernel", "_decode_kernel", "_merge_splits_kernel", "_prefill_kernel",
            "_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel"} <= kernels


def test_every_kernel_fits_the_shared_memory_of_a100_and_h100(compiled):
    over = [f"{_describe(record)}: {record['shared']} bytes of shared memory, over "
            f"{SHARED_MEMORY_LIMIT[record['target']]}" for record in compiled["compiled"]
            if record["error"] is None
            and record["shared"] > SHARED_MEMORY_LIMIT[record["target"]]]
    assert not over, "\n".join(over)
