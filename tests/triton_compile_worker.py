"""Run by test_triton_compile.py, without ``TRITON_INTERPRET``: compile every Tandem Triton
kernel ahead of time for sm_80 and sm_90 and write the results as JSON.

The launches compiled are the launchers' own. For each model geometry one engine step
(Llama's and Gemma's norms, rotary, ``store_kv``, decode and prefill attention, the split
decode and its merge, each attention also under a sliding window, ``silu_and_mul`` and
``gelu_tanh_and_mul``, exact log-probs' batch-invariant attention and matmul, and the matmul
of 8-bit weights, int8 for every target and fp8 for sm_90) runs on meta
tensors with every ``@triton.jit`` function of the kernel modules replaced by a recorder, so
the constexprs, pointer dtypes, ``num_warps`` and integer specialisations are exactly what
the engine would launch. Each distinct launch is then
specialised as Triton's launcher does (``native_specialize_impl``) and compiled with
``triton.compile`` for each target, down to PTX and a cubin (ptxas, no driver needed).

Registers per thread, spills and the stack frame come from ptxas's verbose log: Triton's
ptxas (the one it bundles) is run again with ``-v`` on the PTX Triton generated, with
Triton's flags, and must rebuild Triton's cubin byte for byte, so the figures are those of
the binary the engine would load. (Triton's own ``n_regs`` and ``n_spills`` come from the
driver when it loads the cubin, so they need a device; its ``TRITON_DUMP_PTXAS_LOG=1``
prints the log to stdout, unattributed when kernels compile in parallel.)

The FP8 KV cache's kernels (a ``float8_e4m3fn`` pool with its scales) are compiled for sm_90
only: Triton 3.6 converts float8_e4m3fn from sm_89 on, and the engine refuses an FP8 pool
below (``fp8_kv.MIN_CUDA_CAPABILITY``). One FP8 store is also compiled for sm_80, to record
that Triton still refuses it there.

Output: ``{"compiled": [{kernel, target, geometry, constexprs, pointers, shared, registers,
spill_stores, spill_loads, stack_frame, error}], "unlaunched": [jit functions neither
launched nor called by a launched kernel], "fp8_on_sm80": the error of an FP8 store compiled
for sm_80, or None, "sliding_windows": {kernel: [the kinds its sliding_window argument
specialised to, over every launch]}}``; sizes in bytes, registers per thread, the figures
None where ``error`` says why.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton.compiler.errors import CompilationError
from triton.runtime.jit import JITFunction

from tandem.kernels import (
    AttentionMetadata,
    pool_layout,
    triton_attention,
    triton_layers,
    triton_linear,
    triton_moe,
)
from tandem.kernels.fp8_kv import FP8

TARGETS = {"sm_80": GPUTarget("cuda", 80, 32), "sm_90": GPUTarget("cuda", 90, 32)}
KERNEL_MODULES = (triton_attention, triton_layers, triton_linear, triton_moe)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEFAULT_BLOCK_SIZE = 16  # EngineConfig.block_size's default
NUM_DECODES, PREFILL_LEN = 3, 21
MAX_POSITION = 512
# The sliding windows launched beside none (0): Mistral's, one key (an int Triton would
# otherwise specialise as a constant), and one not a multiple of 16.
SLIDING_WINDOWS = (4096, 1, 17)
# Each attention also launched with attention sinks (GPT-OSS's, in the model's dtype) and
# Gemma 2's logit soft cap at once: each kernel's most code (each alone takes a branch of it).
SOFTCAP = 50.0
QUANTIZED_CODES = (torch.int8, torch.float8_e4m3fn)
# fp8 e4m3 converts on compute capability 8.9 and newer only (the engine refuses it below,
# dispatch.check_quantized): its launches compile for sm_90 alone.
FP8_TARGETS = ("sm_90",)


@dataclass(frozen=True, slots=True)
class Geometry:
    """The shape of a model as its kernels see it, with its dtype and KV block size."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    dtype: torch.dtype
    qk_norm: bool = False
    block_size: int = DEFAULT_BLOCK_SIZE
    fp8_kv: bool = False  # a float8_e4m3fn pool (kv_cache_dtype="fp8"): sm_90 only


# tests/conftest.py's SMALL (head_dim 16; its qwen3 sets head_dim 32, with q/k norms).
TINY = dict(num_heads=4, num_kv_heads=2, hidden_size=64, intermediate_size=128)
SMOLLM2 = dict(num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576,
               intermediate_size=1536)
# Head dim 128, as most models from 1B up: Qwen3-0.6B and Qwen3-8B (with q/k norms),
# Llama 3 8B.
QWEN3_0_6B = dict(num_heads=16, num_kv_heads=8, head_dim=128, hidden_size=1024,
                  intermediate_size=3072, qk_norm=True)
QWEN3_8B = dict(num_heads=32, num_kv_heads=8, head_dim=128, hidden_size=4096,
                intermediate_size=12288, qk_norm=True)
LLAMA3_8B = dict(num_heads=32, num_kv_heads=8, head_dim=128, hidden_size=4096,
                 intermediate_size=14336)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# The tiny models run in float32 (their checkpoints' dtype), SmolLM2 in any dtype, the head
# dim 128 models in their checkpoints' bfloat16 (with 16- and 32-token KV blocks) or float16.
GEOMETRIES = (
    Geometry("tiny llama float32", head_dim=16, dtype=torch.float32, **TINY),
    Geometry("tiny qwen3 float32", head_dim=32, dtype=torch.float32, qk_norm=True, **TINY),
    *(Geometry(f"smollm2-135m {_dtype_name(dtype)}", dtype=dtype, **SMOLLM2)
      for dtype in DTYPES),
    Geometry("qwen3-0.6b bfloat16", dtype=torch.bfloat16, **QWEN3_0_6B),
    Geometry("qwen3-8b bfloat16", dtype=torch.bfloat16, **QWEN3_8B),
    Geometry("qwen3-8b bfloat16 32-token blocks", dtype=torch.bfloat16, block_size=32,
             **QWEN3_8B),
    Geometry("llama-3-8b float16", dtype=torch.float16, **LLAMA3_8B),
    # kv_cache_dtype="fp8": the head dim 128 models in bfloat16 and float16, SmolLM2 in float32
    Geometry("qwen3-8b bfloat16 fp8 KV", dtype=torch.bfloat16, fp8_kv=True, **QWEN3_8B),
    Geometry("llama-3-8b float16 fp8 KV", dtype=torch.float16, fp8_kv=True, **LLAMA3_8B),
    Geometry("smollm2-135m float32 fp8 KV", dtype=torch.float32, fp8_kv=True, **SMOLLM2),
)


@dataclass(slots=True)
class Launch:
    """One ``kernel[grid](*args, **kwargs)`` call a launcher made."""

    kernel: JITFunction
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    geometry: Geometry


class LaunchRecorder:
    """Stands in for a ``JITFunction``: ``recorder[grid](...)`` records the call instead."""

    def __init__(self, kernel: JITFunction, geometry: Geometry, launches: list[Launch]) -> None:
        self.kernel = kernel
        self.geometry = geometry
        self.launches = launches

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def record(*args: Any, **kwargs: Any) -> None:
            self.launches.append(Launch(self.kernel, args, kwargs, self.geometry))
        return record


def jit_functions(module: ModuleType) -> dict[str, JITFunction]:
    """The ``@triton.jit`` functions defined in ``module``, by name."""
    return {name: value for name, value in vars(module).items()
            if isinstance(value, JITFunction)}


@contextmanager
def recording(geometry: Geometry, launches: list[Launch]) -> Iterator[None]:
    """Replace every jit function of the kernel modules by a recorder, then restore them."""
    originals = [(module, jit_functions(module)) for module in KERNEL_MODULES]
    for module, kernels in originals:
        for name, kernel in kernels.items():
            setattr(module, name, LaunchRecorder(kernel, geometry, launches))
    try:
        yield
    finally:
        for module, kernels in originals:
            for name, kernel in kernels.items():
                setattr(module, name, kernel)


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def _metadata(num_tokens: int) -> AttentionMetadata:
    """``NUM_DECODES`` decodes then one prefill chunk of ``PREFILL_LEN`` tokens."""
    num_seqs, max_blocks = NUM_DECODES + 1, 8
    return AttentionMetadata(
        slot_mapping=_meta(num_tokens, dtype=torch.long),
        block_tables=_meta(num_seqs, max_blocks, dtype=torch.long),
        context_lens=_meta(num_seqs, dtype=torch.long),
        cu_seqlens_q=_meta(num_seqs + 1, dtype=torch.long), num_decodes=NUM_DECODES,
        max_query_len=PREFILL_LEN)


def _kv_pool(geometry: Geometry, num_blocks: int = 64) -> tuple[torch.Tensor, ...]:
    """Layer 0's K and V pools, laid out as the model runner allocates them, and their
    scales (FP8 pools only; else None)."""
    storage, order = pool_layout((2, 2, num_blocks, geometry.block_size,
                                  geometry.num_kv_heads, geometry.head_dim))
    pool = _meta(*storage, dtype=FP8 if geometry.fp8_kv else geometry.dtype).permute(order)
    scales = _meta(2, 2, geometry.num_kv_heads, dtype=torch.float32) if geometry.fp8_kv \
        else None
    return pool[0, 0], pool[1, 0], *((None, None) if scales is None else scales[:, 0])


def run_step(geometry: Geometry) -> None:
    """Call every Triton kernel function as one decoder layer of ``geometry`` does."""
    g, dtype = geometry, geometry.dtype
    tokens = NUM_DECODES + PREFILL_LEN
    hidden = _meta(tokens, g.hidden_size, dtype=dtype)
    weight = _meta(g.hidden_size, dtype=dtype)
    for norm in (triton_layers.rms_norm, triton_layers.gemma_rms_norm):  # Llama's, Gemma's
        norm(hidden, weight, 1e-6)
        norm(hidden, weight, 1e-6, residual=hidden)
    q = _meta(tokens, g.num_heads * g.head_dim, dtype=dtype).view(tokens, g.num_heads, -1)
    k = _meta(tokens, g.num_kv_heads * g.head_dim, dtype=dtype).view(tokens, g.num_kv_heads, -1)
    v = torch.empty_like(k)
    if g.qk_norm:
        q = triton_layers.rms_norm(q, _meta(g.head_dim, dtype=dtype), 1e-6)
        k = triton_layers.rms_norm(k, _meta(g.head_dim, dtype=dtype), 1e-6)
    tables = _meta(MAX_POSITION, g.head_dim, dtype=torch.float32)
    triton_layers.rotary_embedding(_meta(tokens, dtype=torch.long), q, k, tables, tables)
    k_cache, v_cache, k_scale, v_scale = _kv_pool(g)
    metadata = _metadata(tokens)
    triton_attention.store_kv(k, v, k_cache, v_cache, metadata.slot_mapping, k_scale, v_scale)
    scale = g.head_dim ** -0.5
    for window in (None, *SLIDING_WINDOWS):
        triton_attention.paged_attention(q, k_cache, v_cache, metadata, scale, k_scale,
                                         v_scale, sliding_window=window)
        triton_attention.paged_decode_attention(  # the split path and its merge
            q[:NUM_DECODES], k_cache, v_cache, metadata.block_tables[:NUM_DECODES],
            metadata.context_lens[:NUM_DECODES], scale, num_splits=4, k_scale=k_scale,
            v_scale=v_scale, sliding_window=window)
    logits = dict(sinks=_meta(g.num_heads, dtype=dtype), softcap=SOFTCAP)
    triton_attention.paged_attention(q, k_cache, v_cache, metadata, scale, k_scale, v_scale,
                                     **logits)
    triton_attention.paged_decode_attention(
        q[:NUM_DECODES], k_cache, v_cache, metadata.block_tables[:NUM_DECODES],
        metadata.context_lens[:NUM_DECODES], scale, num_splits=4, k_scale=k_scale,
        v_scale=v_scale, **logits)
    gate = _meta(tokens, g.intermediate_size, dtype=dtype)
    triton_layers.silu_and_mul(gate, torch.empty_like(gate))
    triton_layers.gelu_tanh_and_mul(gate, torch.empty_like(gate))  # Gemma's MLP
    # exact_logprobs: every query through the prefill kernel, every projection through the
    # fixed-tile matmul (with a bias, as Qwen2's q/k/v).
    for window in (None, *SLIDING_WINDOWS):
        triton_attention.batch_invariant_attention(q, k_cache, v_cache, metadata, scale,
                                                   k_scale, v_scale, sliding_window=window)
    triton_linear.linear(hidden, _meta(g.intermediate_size, g.hidden_size, dtype=dtype))
    triton_linear.linear(hidden, _meta(g.num_heads * g.head_dim, g.hidden_size, dtype=dtype),
                         _meta(g.num_heads * g.head_dim, dtype=dtype))
    # 8-bit weights (quantization): their codes and float32 scales, int8 and fp8 e4m3
    for codes in QUANTIZED_CODES:
        triton_linear.linear(hidden, _meta(g.intermediate_size, g.hidden_size, dtype=codes),
                             None, _meta(g.intermediate_size, dtype=torch.float32))
    # a mixture of experts' grouped matmuls (8 experts, top 2), gate/up then down
    rows = triton_moe.max_pairs(tokens, 2, 8, triton_linear.TILES[dtype][0])
    token_of_row = _meta(rows, dtype=torch.long)
    block_expert = _meta(rows // triton_linear.TILES[dtype][0], dtype=torch.long)
    triton_moe.grouped_linear(hidden, token_of_row, block_expert,
                              _meta(8, 2 * g.intermediate_size, g.hidden_size, dtype=dtype))
    triton_moe.grouped_linear(_meta(rows, g.intermediate_size, dtype=dtype), token_of_row,
                              block_expert, _meta(8, g.hidden_size, g.intermediate_size,
                                                  dtype=dtype))


def record_launches(geometries: tuple[Geometry, ...] = GEOMETRIES) -> list[Launch]:
    """Every kernel launch one step of each geometry makes."""
    launches: list[Launch] = []
    for geometry in geometries:
        with recording(geometry, launches):
            run_step(geometry)
    return launches


@dataclass(frozen=True, slots=True)
class CompileJob:
    """One launch specialised for one target: what ``triton.compile`` takes."""

    kernel: JITFunction
    target: str
    signature: dict[str, str]
    constexprs: dict[str, Any]
    attrs: dict[tuple[int, ...], Any]
    options: dict[str, Any]

    def key(self) -> str:
        """Equal for two jobs that compile the same binary."""
        return repr((self.kernel.__name__, self.target, sorted(self.signature.items()),
                     sorted(self.constexprs.items()), sorted(self.attrs.items()),
                     sorted(self.options.items())))


def specialise(launch: Launch, target: str) -> CompileJob:
    """``launch`` as Triton's launcher would compile it for ``target``."""
    kernel, backend = launch.kernel, make_backend(TARGETS[target])
    arguments = {name: value for name, value in launch.kwargs.items()
                 if name in kernel.arg_names}
    options = {name: value for name, value in launch.kwargs.items() if name not in arguments}
    bound = kernel.signature.bind(*launch.args, **arguments)
    bound.apply_defaults()
    signature, constexprs, attrs = {}, {}, {}
    for index, (param, (name, value)) in enumerate(zip(kernel.params, bound.arguments.items())):
        if param.is_constexpr:
            signature[name], constexprs[name] = "constexpr", value
            continue
        kind, attr = native_specialize_impl(backend, value, param.is_const,
                                            not param.do_not_specialize,
                                            not param.do_not_specialize_on_alignment)
        signature[name] = kind
        if kind == "constexpr":
            constexprs[name] = attr
        elif isinstance(attr, str) and attr:
            attrs[(index,)] = backend.parse_attr(attr)
    return CompileJob(kernel, target, signature, constexprs, attrs, options)


RESOURCES = ("registers", "spill_stores", "spill_loads", "stack_frame")
PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")
PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                         r"(\d+) bytes spill loads")


def compile_job(job: CompileJob) -> dict[str, Any]:
    """Compile ``job``; its shared memory and ptxas's figures (``RESOURCES``), or the
    error that stopped it."""
    failed = {"shared": None, **dict.fromkeys(RESOURCES)}
    source = ASTSource(job.kernel, job.signature, job.constexprs, job.attrs)
    try:
        compiled = triton.compile(source, target=TARGETS[job.target], options=job.options)
    except Exception as error:  # noqa: BLE001 - every failure is a finding to report
        return {**failed, "error": error_text(error)}
    if "cubin" not in compiled.asm:
        return {**failed, "error": "no cubin was produced"}
    try:
        resources = ptxas_resources(compiled.asm["ptx"], compiled.asm["cubin"], job)
    except ValueError as error:
        return {**failed, "error": str(error)}
    return {"shared": compiled.metadata.shared, **resources, "error": None}


def ptxas_resources(ptx: str, cubin: bytes, job: CompileJob) -> dict[str, int]:
    """Registers per thread and the spill stores, spill loads and stack frame in bytes of
    the one kernel in ``ptx``, from the verbose log of Triton's ptxas run with Triton's
    flags (as ``make_cubin`` runs it, with fused multiply-adds and line info).

    Raises:
        ValueError: when ptxas fails, builds another cubin than Triton's ``cubin`` (its
            figures would not be that binary's), or logs other than one kernel's figures.
    """
    capability = TARGETS[job.target].arch
    with tempfile.TemporaryDirectory() as folder:
        source, binary = Path(folder, "kernel.ptx"), Path(folder, "kernel.cubin")
        source.write_text(ptx)
        run = subprocess.run([get_ptxas(capability).path, "-lineinfo", "-v",
                              f"--gpu-name={sm_arch_from_capability(capability)}",
                              str(source), "-o", str(binary)], capture_output=True, text=True)
        if run.returncode != 0:
            raise ValueError(f"ptxas -v failed:\n{run.stderr[-2000:]}")
        if binary.read_bytes() != cubin:
            raise ValueError("ptxas -v built another cubin than Triton's: align its flags "
                             "with triton/backends/nvidia/compiler.py's make_cubin")
    registers, frames = PTXAS_REGISTERS.findall(run.stderr), PTXAS_FRAME.findall(run.stderr)
    if len(registers) != 1 or len(frames) != 1:
        raise ValueError(f"expected one kernel's figures in ptxas's log:\n{run.stderr}")
    stack_frame, spill_stores, spill_loads = map(int, frames[0])
    return {"registers": int(registers[0]), "spill_stores": spill_stores,
            "spill_loads": spill_loads, "stack_frame": stack_frame}


def error_text(error: BaseException, limit: int = 4000) -> str:
    """``error`` as text; for a compile error, its innermost one, which shows the failing
    line even inside a helper and ends with the cause."""
    chain = [error]
    while (cause := chain[-1].__cause__ or chain[-1].__context__) and len(chain) < 16:
        chain.append(cause)
    innermost = next((e for e in reversed(chain) if isinstance(e, CompilationError)), error)
    text = f"{type(innermost).__name__}: {innermost}"
    return text if len(text) <= limit else f"{text[:limit // 4]}\n...\n{text[-limit // 2:]}"


def unlaunched(launches: list[Launch]) -> list[str]:
    """Jit functions neither launched nor called by a launched kernel (helpers, and the
    helpers they call)."""
    functions = {(module.__name__, name): kernel for module in KERNEL_MODULES
                 for name, kernel in jit_functions(module).items()}
    reached = {launch.kernel for launch in launches}
    while True:
        sources = "\n".join(kernel.src for kernel in reached)
        called = {kernel for (_, name), kernel in functions.items() if f"{name}(" in sources}
        if called <= reached:
            break
        reached |= called
    return sorted(f"{module}.{name}" for (module, name), kernel in functions.items()
                  if kernel not in reached)


def launch_targets(launch: Launch) -> tuple[str, ...]:
    """The targets a launch runs on: every one, but ``FP8_TARGETS`` for fp8 operands."""
    tensors = [value for value in (*launch.args, *launch.kwargs.values())
               if isinstance(value, torch.Tensor)]
    fp8 = any(tensor.dtype == torch.float8_e4m3fn for tensor in tensors)
    return FP8_TARGETS if fp8 else tuple(TARGETS)


def distinct_jobs(launches: list[Launch]) -> list[tuple[CompileJob, Launch]]:
    """One job per distinct binary: each launch for each of its targets, repeats dropped."""
    jobs: dict[str, tuple[CompileJob, Launch]] = {}
    for launch in launches:
        for target in launch_targets(launch):
            job = specialise(launch, target)
            jobs.setdefault(job.key(), (job, launch))
    return list(jobs.values())


def report(job: CompileJob, launch: Launch) -> dict[str, Any]:
    """Compile ``job``; what it is (kernel, target, geometry, constexprs, pointer dtypes) and
    how it went (``shared`` bytes and ptxas's ``RESOURCES``, or ``error``)."""
    pointers = {name: kind for name, kind in job.signature.items() if kind.startswith("*")}
    return {"kernel": job.kernel.__name__, "target": job.target, "geometry": launch.geometry.name,
            "constexprs": job.constexprs, "pointers": pointers, **compile_job(job)}


def fp8_store_on_sm80(launches: list[Launch]) -> str | None:
    """The error compiling an FP8 pool's store for sm_80 gives (None: it compiled)."""
    store = next(launch for launch in launches if launch.geometry.fp8_kv
                 and launch.kernel.__name__ == "_store_kv_kernel")
    return compile_job(specialise(store, "sm_80"))["error"]


def sliding_window_kinds(launches: list[Launch]) -> dict[str, list[str]]:
    """Per kernel taking a ``sliding_window``, the kinds it specialised to over every launch
    (one kind: every window, none included, runs one binary)."""
    kinds: dict[str, set[str]] = {}
    for launch in launches:
        if "sliding_window" in launch.kernel.arg_names:
            kind = specialise(launch, "sm_90").signature["sliding_window"]
            kinds.setdefault(launch.kernel.__name__, set()).add(kind)
    return {name: sorted(found) for name, found in kinds.items()}


def main() -> None:
    """Compile each distinct launch for each target, on every CPU; write the results as JSON
    to the path given as the first argument (Triton prints to stdout when ptxas fails)."""
    launches = record_launches()
    # Threads suffice: two threads on two cores compile in about half the time of one.
    with ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0))) as pool:
        compiled = list(pool.map(lambda pair: report(*pair), distinct_jobs(launches)))
    results = {"compiled": compiled, "unlaunched": unlaunched(launches),
               "fp8_on_sm80": fp8_store_on_sm80(launches),
               "sliding_windows": sliding_window_kinds(launches)}
    Path(sys.argv[1]).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
