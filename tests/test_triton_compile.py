"""Every Triton kernel compiles ahead of time for sm_80 (A100) and sm_90 (H100, H200) at the
engine's shapes and dtypes, within each GPU's shared memory per block, without register
spills.

Triton compiles for a target without a device (``triton.compile`` down to PTX, then a cubin
from its bundled ptxas), so this runs in CPU-only CI and catches what the interpreter cannot:
compile errors, shared memory overflows and register spills. It runs
``triton_compile_worker.py`` in a subprocess without ``TRITON_INTERPRET`` (conftest switches
the interpreter on in this process, and under it ``@triton.jit`` gives functions
``triton.compile`` refuses), with its own Triton cache. The worker records the launches from
the launchers themselves, so the constexprs (block sizes), pointer dtypes and ``num_warps``
compiled are exactly what the launchers pass, for head dims 16 and 32 (the tiny test models,
float32), 64 (SmolLM2, in float32, bfloat16 and float16) and 128 (Qwen3-0.6B and Qwen3-8B in
bfloat16, Llama 3 8B in float16), with KV blocks of 16 tokens (the default) and, for
Qwen3-8B, also of 32; and with an FP8 KV pool (``kv_cache_dtype="fp8"``) for sm_90 only,
Triton converting float8_e4m3fn from sm_89 on. Each attention launch is also recorded under
sliding windows, whose argument Triton must never specialise on (one binary for every
window, none included), and with attention sinks and a logit soft cap (binaries of their
own: without them both are None constexprs).

Registers per thread, spill stores and loads and the stack frame of each cubin are ptxas's,
from its verbose log for the very cubin Triton built: what Triton's ``n_regs`` and
``n_spills`` report once a device's driver loads it. A spill moves a value out of the
registers into local memory (device memory, cached in L1) and back.
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
DECODE_KERNELS = ("_decode_kernel", "_merge_splits_kernel")
# The engine's KV block sizes compiled: the default and vLLM's other usual one.
BLOCK_SIZES = (16, 32)


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
            "_rms_norm_kernel", "_rotary_kernel", "_silu_and_mul_kernel",
            "_gelu_tanh_and_mul_kernel"} <= kernels


def test_the_8_bit_matmul_compiles_int8_for_both_targets_and_fp8_for_sm90(compiled):
    # quantization: int8 codes on A100 and H100, fp8 e4m3 where it converts (sm_89+)
    weights = {(record["pointers"]["weight"], record["target"]) for record in compiled["compiled"]
               if record["kernel"] == "_linear_kernel" and record["error"] is None}
    assert {("*i8", "sm_80"), ("*i8", "sm_90"), ("*fp8e4nv", "sm_90")} <= weights
    assert ("*fp8e4nv", "sm_80") not in weights


def test_every_kernel_fits_the_shared_memory_of_a100_and_h100(compiled):
    over = [f"{_describe(record)}: {record['shared']} bytes of shared memory, over "
            f"{SHARED_MEMORY_LIMIT[record['target']]}" for record in compiled["compiled"]
            if record["error"] is None
            and record["shared"] > SHARED_MEMORY_LIMIT[record["target"]]]
    assert not over, "\n".join(over)


def _spills(record: dict[str, Any]) -> int:
    return record["spill_stores"] + record["spill_loads"]


def _resources(records: list[dict[str, Any]]) -> str:
    """One line per record: what it is, then ptxas's registers, spills and stack frame."""
    return "\n".join(
        f"{_describe(record)}: {record['registers']} registers, {record['spill_stores']} "
        f"bytes of spill stores, {record['spill_loads']} of spill loads, "
        f"{record['stack_frame']} bytes of stack frame" for record in records)


def test_every_compiled_kernel_has_ptxas_figures(compiled):
    for record in compiled["compiled"]:
        if record["error"] is None:
            assert 0 < record["registers"] <= 255, _describe(record)
            assert min(record["spill_stores"], record["spill_loads"],
                       record["stack_frame"]) >= 0, _describe(record)


def test_decode_attention_never_spills_at_the_engines_block_sizes(compiled):
    decodes = [record for record in compiled["compiled"]
               if record["kernel"] in DECODE_KERNELS and record["error"] is None]
    covered = {(record["pointers"]["query"], record["constexprs"]["BLOCK_D"],
                record["constexprs"]["BLOCK_SIZE"]) for record in decodes
               if record["kernel"] == "_decode_kernel" and record["target"] == "sm_90"}
    assert {("*bf16", 128, block_size) for block_size in BLOCK_SIZES} <= covered
    spilling = [record for record in decodes if _spills(record)]
    assert not spilling, (f"decode attention spills:\n{_resources(spilling)}\n\n"
                          f"every decode launch:\n{_resources(decodes)}")


def test_no_kernel_spills(compiled):
    # The float32 prefill spilled a 6 KB stack frame over 64 x 64 tiles at head dim 64, until
    # float32 took smaller tiles (triton_attention._prefill_tile).
    assert any(record["kernel"] == "_prefill_kernel" and record["pointers"]["query"] == "*fp32"
               for record in compiled["compiled"])
    spilling = [record for record in compiled["compiled"]
                if record["error"] is None and _spills(record)]
    assert not spilling, f"kernels that spill:\n{_resources(spilling)}"


def test_the_fp8_kv_kernels_compile_for_sm90_and_triton_still_refuses_sm80(compiled):
    # The engine refuses an FP8 pool below sm_89 (fp8_kv.MIN_CUDA_CAPABILITY) because of the
    # second assertion: when a Triton converts float8_e4m3fn on sm_80, it fails, and the
    # refusal can go.
    fp8 = [record for record in compiled["compiled"]
           if record["pointers"].get("k_cache") == "*fp8e4nv"]
    assert {record["kernel"] for record in fp8} == {"_store_kv_kernel", "_decode_kernel",
                                                    "_prefill_kernel"}
    assert {record["target"] for record in fp8} == {"sm_90"}
    assert all(record["pointers"]["k_scale"] == "*fp32" for record in fp8)
    assert {record["pointers"]["query"] for record in fp8
            if record["kernel"] != "_store_kv_kernel"} == {"*bf16", "*fp16", "*fp32"}
    assert "fp8e4nv not supported in this architecture" in compiled["fp8_on_sm80"]


def test_a_sliding_window_runs_the_binary_of_none(compiled):
    # The window is a plain int argument (never specialised: 1 would be a constant, 4096 a
    # multiple of 16), so every window of every layer, and none, share one binary per
    # launch, and capturing a model's graphs compiles nothing more.
    assert compiled["sliding_windows"] == {
        kernel: ["i32"] for kernel in ("_decode_kernel", "_prefill_kernel")}


def test_sinks_and_a_softcap_compile_the_decode_and_prefill_for_both_targets(compiled):
    # Binaries of their own (a sinks pointer and a float cap where the others have None
    # constexprs), within the same limits (test_no_kernel_spills covers them too); the merge
    # of the splits is the one binary it always was.
    featured = [record for record in compiled["compiled"] if "sinks" in record["pointers"]]
    assert {(record["kernel"], record["target"]) for record in featured} == {
        (kernel, target) for kernel in ("_decode_kernel", "_prefill_kernel")
        for target in TARGETS}
    assert all(record["error"] is None and "softcap_log2" not in record["constexprs"]
               for record in featured)
    assert {record["pointers"]["sinks"] for record in featured} == {"*fp32", "*bf16", "*fp16"}
    plain = [record for record in compiled["compiled"] if record["kernel"] == "_prefill_kernel"
             and "sinks" not in record["pointers"]]
    assert plain and all(record["constexprs"]["softcap_log2"] is None
                         and record["constexprs"]["sinks"] is None for record in plain)
