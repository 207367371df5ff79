"""The one-call GPU check: every GPU claim of the project, measured in one run.

``benchmarks/gpu_check.sh OUT`` installs the project and runs this on a bare GPU machine in
about 7 minutes on one H200, with no network: models are random-weight models built from
config shapes (Qwen3-0.6B's and Qwen3-8B's, written here). Sections, in order of importance,
each in its own guard, each appending its results to ``OUT/results.jsonl`` as it goes (a
failed section's traceback goes to ``OUT/tracebacks.txt``), and each letting go of what it
took before the next starts (``between`` rows record the device memory still held and the
engines still alive):

- ``kernels``: every Triton kernel against its torch reference in float64 on random data at
  Qwen3-0.6B sizes, relative error ‖out − ref‖ / ‖ref‖, in bfloat16, float16 and float32.
- ``tokens``: greedy tokens of the whole model, Triton (eager and graphs) against torch: all
  equal in float32; in bfloat16 a divergence passes only at a near-tie (the float32 model's
  top-2 margin under bfloat16's spacing), and the margin is recorded; seeded sampling with
  overlapped steps against the landed path: the same tokens.
- ``sync_free``: the steady-state overlapped decode loop with every ``ModelRunner.launch``
  under ``torch.cuda.set_sync_debug_mode("error")``, per configuration (dense, MoE, FP8 KV,
  int8 weights, routing replay, ``min_tokens``, penalties, top-p/top-k, seeded, unseeded,
  top-5 log-probs): ok, or the first synchronizing call and where the project made it.
- ``memory``: the engine's share at start and under load against ``gpu_memory_utilization``;
  the KV pool released alone and sleep at both levels, each woken (seconds, their parts, what
  stays held; level 2 with the full update that must follow), seeded sampling after.
- ``lifecycle``: an engine deleted by its only owner gives its memory back.
- ``updates``: copy, alias and LoRA-merge updates against a fresh engine on the saved weights;
  the run-time LoRA layers against ``x W + s (x A) B`` in the same dtype.
- ``ipc``: a full push from a sender process over CUDA IPC.
- ``receive_decode``: decode tok/s at batch 64 while a sender process pushes 8 full updates
  over CUDA IPC (received on a thread), against none in flight; every weight then equals
  the one sent.
- ``bandwidth``: paged decode attention at batch 256, context 1k and 4k, against the device
  copy (target: 60%).
- ``families``: Phi-3, Gemma 3, Gemma 2 and GPT-OSS (small random models, windows the
  prompts pass): greedy tokens, Triton with graphs, against eager transformers in float32.
- ``sliding``: sliding-window decode at batch 32, contexts 4k and 32k, windows 128
  (GPT-OSS) and 1024 (Gemma 3): the window's K/V bytes per second against the device copy,
  and the speedup over the same contexts without a window.
- ``decode``: decode tokens/s, eager against CUDA graphs, at batch 1, 8, 64, 256, with
  overlapped steps and (batch 1 and 256) without; the device's busy fraction at batch 256
  under the torch profiler (issue 46: batch 1 at least 650 tok/s, busy at least 0.9).
- ``nano_bench``: DESIGN.md's workload (256 sequences, lengths uniform in [100, 1024], EOS
  ignored) against its bandwidth bound (issue 46: 0.7 of it), overlapped and not, then
  transformers' ``generate`` on the same prompts.
- ``server``: ``tandem serve`` at concurrency 1, 8, 32, 128, streamed and not (aiohttp),
  against the same requests offline in one ``generate`` call.
- ``grpo``: ``tandem train`` colocated GRPO, 3 steps, the device's peak polled from here.
- ``structured``: JSON-schema sampling with xgrammar's bitmask on the device.
- ``exact``: exact log-probs (issue 40): the batch-invariant Triton matmul against cuBLAS
  (row bits alone and among M rows, seconds), decode tok/s with ``exact_logprobs`` on over
  off, the engine against itself (batch of 8, prefill rescoring) and the trainer's forward
  against the engine's sampled log-probs (target: a gap of exactly 0).
- ``moe``: the Triton grouped experts at Qwen3-30B-A3B's layer shape (issue 41): error
  against float64, a token's bits alone and among others, seconds against the torch path.
- ``moe_graphs``: a random Qwen3-MoE engine (fused Triton experts) with decode graphs: it
  starts and captures them, its greedy tokens equal the eager engine's (float32), and both
  engines' decode tok/s at batch 1 and 64 with overlapped steps on and off.
- ``fp8_kv``: the FP8 KV cache (issue 42): the store's bits against ``fp8_kv.quantize``,
  attention over an FP8 pool against float64 attention over its dequantized values (each
  case and dtype of ``kernels``), decode attention's bandwidth over an FP8 pool against a
  bfloat16 one at batch 256 and context 4k, and an FP8 engine (decode graphs, a group)
  along the unquantized engine's greedy tokens (skipped below sm_89).
- ``quantized``: 8-bit weights (issue 42): the Triton 8-bit matmul against float64 on the
  dequantized weight and against cuBLAS in bfloat16 (int8; fp8 where the device converts
  it), then each quantized engine's decode tok/s and greedy agreement against the
  unquantized engine.
- ``resources``: registers, spills and shared memory of every Triton kernel compiled here.
- ``qwen3_8b``: the Qwen3-8B shape: prefill attention at 8k and 32k against torch's flash
  SDPA, decode attention at 32k against copy, and nano-bench against its bandwidth bound.
- ``tensor_parallel``: TP=2 against TP=1 (needs two GPUs; recorded as skipped otherwise).
- ``devices``: TP=2 decode tok/s with overlapped steps on and off; an engine on ``cuda:1``
  against ``cuda:0`` (greedy, float32); an NCCL update from ``cuda:0`` received by an engine
  on ``cuda:1`` during generation against a fresh engine on the new weights (each part
  recorded skipped on one device).

A section that would overrun the budget is skipped and says so; ``--only`` runs some
sections; ``--table OUT`` prints the table of whatever ``results.jsonl`` holds (the shell
script calls it if the run is killed). ``--smoke`` runs every section at toy sizes on a CPU
(Triton under its interpreter), to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports Triton

import torch  # noqa: E402
from gpu_check_common import (  # noqa: E402
    QWEN3_06B,
    QWEN3_8B,
    TOY,
    Recorder,
    collect,
    device_used_bytes,
    live_engines,
    make_llm,
    save_random_model,
)
from gpu_check_devices import check_devices  # noqa: E402
from gpu_check_engine import (  # noqa: E402
    check_lifecycle,
    check_memory,
    check_tokens,
    check_updates,
    greedy,
)
from gpu_check_exact import check_exact  # noqa: E402
from gpu_check_families import check_families  # noqa: E402
from gpu_check_kernels import (  # noqa: E402
    check_bandwidth,
    check_fp8_kv,
    check_kernels,
    check_long_attention,
    check_resources,
    check_sliding,
)
from gpu_check_moe import check_moe, check_moe_graphs, moe_folder  # noqa: E402
from gpu_check_quantized import check_quantized_section  # noqa: E402
from gpu_check_receive import check_receive_decode  # noqa: E402
from gpu_check_rl import check_grpo, check_ipc, check_server, check_structured  # noqa: E402
from gpu_check_sync_free import check_sync_free  # noqa: E402
from gpu_check_throughput import check_decode, check_nano_bench  # noqa: E402

BUDGET_SECONDS = 400
TOY_8B = TOY | dict(hidden_size=128, intermediate_size=256, num_attention_heads=8,
                    num_key_value_heads=2, tie_word_embeddings=False)


def check_tensor_parallel(rec: Recorder, folder: Path) -> None:
    """Greedy tokens of TP=2 (eager, then decode graphs holding the NCCL all-reduces)
    against TP=1 (needs two GPUs; with --smoke, gloo on CPU)."""
    if rec.device.type == "cuda" and torch.cuda.device_count() < 2:
        rec.record("tensor_parallel", "skipped",
                   reason=f"TP=2 needs two GPUs; {torch.cuda.device_count()} present")
        return
    prompts = [[5, 6, 7, 8], list(range(20, 60))]
    tokens = {}
    for name, size, eager in (("TP=1", 1, False), ("TP=2 eager", 2, True),
                              ("TP=2 graphs", 2, False)):
        llm = make_llm(rec, folder, tensor_parallel_size=size, enforce_eager=eager)
        tokens[name] = greedy(llm, prompts, 3 if rec.smoke else 32)
        graphs = len(llm.engine.runner.graph_sizes)
        del llm
        collect()
        if size == 2:
            same = sum(a == b for a, b in zip(tokens[name], tokens["TP=1"]))
            rec.record("tensor_parallel", f"greedy tokens, {name} = TP=1",
                       equal_sequences=f"{same}/{len(prompts)}", graph_sizes=graphs,
                       ok=same == len(prompts))


def check_qwen3_8b(rec: Recorder, work: Path) -> None:
    """The Qwen3-8B shape: long-context attention, then nano-bench on a random 8B model."""
    check_long_attention(rec)
    collect()
    folder = save_random_model(TOY_8B if rec.smoke else QWEN3_8B, work / "qwen3-8b-random",
                               torch.float32 if rec.smoke else torch.bfloat16, rec.device)
    check_nano_bench(rec, folder, section="qwen3_8b", comparator=False)


# ---------------------------------------------------------------- table and main


def print_table(out: Path) -> None:
    """Print every recorded result as a Markdown table (also saved as ``table.md``)."""
    path = out / "results.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    lines = ["| section | check | results |", "|---|---|---|"]
    for row in rows:
        values = ", ".join(f"{k}={v}" for k, v in row.items() if k not in ("section", "name"))
        lines.append(f"| {row['section']} | {row['name']} | {values} |")
    table = "\n".join(lines)
    (out / "table.md").write_text(table + "\n")
    print(table)


def run_section(rec: Recorder, name: str, needs_seconds: float, call: Callable[[], object],
                baseline: int) -> None:
    """Run a section unless the budget cannot hold it; record a skip or a failure (its
    traceback in ``tracebacks.txt``), then what the process still holds once it is over:
    the device memory above ``baseline`` and the engines the section left alive."""
    if rec.seconds_left() < needs_seconds:
        rec.record(name, "skipped", reason=f"under {needs_seconds:.0f} s of budget left")
        return
    collect()  # engines an earlier section or caller dropped are not this section's
    start, engines_before = time.monotonic(), live_engines()
    try:
        call()
    except Exception as error:  # a broken section must not hide the others' results
        rec.record(name, "failed", error=f"{type(error).__name__}: {error}"[:500])
        rec.record_traceback(name)
    collect()
    engines = live_engines() - engines_before
    rec.record(name, "between", seconds=round(time.monotonic() - start, 1),
               held_gib=round((device_used_bytes() - baseline) / 2**30, 3),
               engines_alive=engines, ok=engines == 0)


def sections(rec: Recorder, folder: Path, work: Path) -> dict[str, tuple[float, Callable]]:
    """Name -> (seconds it needs, call), in order of importance."""
    shape = TOY if rec.smoke else QWEN3_06B
    return {"kernels": (20, lambda: check_kernels(rec, shape)),
            "tokens": (40, lambda: check_tokens(rec, folder)),
            "sync_free": (35, lambda: check_sync_free(rec, folder, moe_folder(rec, work))),
            "memory": (25, lambda: check_memory(rec, folder)),
            "lifecycle": (8, lambda: check_lifecycle(rec, folder)),
            "updates": (30, lambda: check_updates(rec, folder, work)),
            "ipc": (20, lambda: check_ipc(rec, folder)),
            "receive_decode": (25, lambda: check_receive_decode(rec, folder, work)),
            "bandwidth": (8, lambda: check_bandwidth(rec, shape)),
            "sliding": (10, lambda: check_sliding(rec, shape)),
            "decode": (35, lambda: check_decode(rec, folder)),
            "nano_bench": (55, lambda: check_nano_bench(rec, folder)),
            "server": (40, lambda: check_server(rec, folder, work)),
            "grpo": (40, lambda: check_grpo(rec, folder, work)),
            "structured": (15, lambda: check_structured(rec, work)),
            "exact": (25, lambda: check_exact(rec, folder)),
            "moe": (10, lambda: check_moe(rec)),
            "moe_graphs": (35, lambda: check_moe_graphs(rec, moe_folder(rec, work))),
            "families": (30, lambda: check_families(rec, work)),
            "fp8_kv": (30, lambda: check_fp8_kv(rec, shape, folder)),
            "quantized": (35, lambda: check_quantized_section(rec, folder)),
            "resources": (2, lambda: check_resources(rec)),
            "qwen3_8b": (60, lambda: check_qwen3_8b(rec, work)),
            "tensor_parallel": (20, lambda: check_tensor_parallel(rec, folder)),
            "devices": (40, lambda: check_devices(rec, folder, work))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for results.jsonl and table.md")
    parser.add_argument("--smoke", action="store_true",
                        help="toy sizes on CPU (Triton interpreter): checks the script")
    parser.add_argument("--table", action="store_true",
                        help="only print the table of what OUT/results.jsonl holds")
    parser.add_argument("--budget", type=float, default=BUDGET_SECONDS,
                        help="seconds the whole check may take")
    parser.add_argument("--only", nargs="+", metavar="SECTION",
                        help="run only these sections (names as in results.jsonl)")
    args = parser.parse_args()
    if args.table:
        print_table(args.out)
        return
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or pass --smoke")
    rec = Recorder(args.out, args.budget, args.smoke)
    rec.record("setup", "device", card="cpu" if args.smoke else torch.cuda.get_device_name(),
               torch=torch.__version__, smoke=args.smoke)
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    folder = save_random_model(TOY if args.smoke else QWEN3_06B, work / "qwen3-0.6b-random",
                               torch.float32 if args.smoke else torch.bfloat16, rec.device)
    baseline = device_used_bytes()
    every = sections(rec, folder, work)
    unknown = set(args.only or ()) - set(every)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(every)}")
    for name, (needs_seconds, call) in every.items():
        if args.only is None or name in args.only:
            run_section(rec, name, needs_seconds, call, baseline)
    print_table(args.out)


if __name__ == "__main__":
    main()
