"""The CPU kernel backends side by side: the compiled C kernels against the torch references.

The embedded SmolLM2-135M-Instruct on 2 threads, one engine per variant, all in this process
with the same linear layout:

- ``torch``: the references (decode attention gathers each decode's K/V, upcasts it and
  attends groups as a cascade; prefills through SDPA's flash kernel; norms, rotary, SiLU
  and the K/V store as torch operations);
- ``C attention``: the ``"cpu"`` backend's attention (decodes and prefill chunks, reading
  the pool in place, in C) with the torch layer operations;
- ``cpu``: the ``"cpu"`` backend, decode attention and the layer operations in C.

Each round times every engine on three workloads, alternating:

- ``batch 1``: one sequence greedy for 64 tokens, ms/token (after an untimed call);
- ``grpo 8x8``: 8 prompts of 40 tokens x n=8 x 64 tokens sampled, tok/s;
- ``long 8x1``: 8 distinct prompts of 564 tokens x 128 tokens sampled (the serving
  benchmark's shape: decode attention over long contexts), tok/s;
- ``prefill 4x564``: 4 distinct prompts of 564 tokens, one token each: prompt tok/s;
- ``chunks 4x52``: 4 prompts of a cached 512-token prefix and 52 tokens of their own, one
  token each (the serving benchmark's shared-prefix step): prompt tok/s computed.

The prefix cache is reset before each timed call (then, for ``chunks 4x52``, the prefix
alone generated, untimed). ``--rounds`` rounds; each variant's median
is printed with its speed-up over the references. Sampled tokens may differ in the last
bits' wake.

    python benchmarks/cpu_backends.py [--dtype float32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from common import DTYPES, model_folder, print_table, setup_torch

from tandem.kernels import CPU_OPS, TORCH_OPS, KernelOps
from tandem.rollout import LLM, SamplingParams

# Each variant: the engine's attention_backend, and the kernels its layers are switched to.
VARIANTS = {
    "torch": ("torch", TORCH_OPS),
    "C attention": ("cpu", KernelOps(dataclasses.replace(
        CPU_OPS.attention, store_kv=TORCH_OPS.store_kv), TORCH_OPS.layers)),
    "cpu": ("cpu", CPU_OPS),
}
ONE = SamplingParams(temperature=0, max_tokens=64, min_tokens=64)
GROUPS = SamplingParams(n=8, temperature=1.0, max_tokens=64, ignore_eos=True, seed=1)
LONG = SamplingParams(temperature=1.0, max_tokens=128, ignore_eos=True, seed=1)
FIRST = SamplingParams(temperature=0, max_tokens=1)
PREFIX = [1, *range(20000, 20511)]
WORKLOADS = {
    "batch 1": ([[1, *range(100, 137)]], ONE),
    "grpo 8x8": ([[1, *range(100 + i, 140 + i)] for i in range(8)], GROUPS),
    "long 8x1": ([[1, *range(1000 + 600 * i, 1563 + 600 * i)] for i in range(8)], LONG),
    "prefill 4x564": ([[1, *range(6000 + 600 * i, 6563 + 600 * i)] for i in range(4)], FIRST),
    "chunks 4x52": ([[*PREFIX, *range(9000 + 60 * i, 9052 + 60 * i)] for i in range(4)], FIRST),
}
CACHED = {"chunks 4x52": PREFIX}  # generated after the reset, untimed: its blocks cached


def parse_args() -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--rounds", type=int, default=3)
    return parser.parse_args()


def timed_call(llm: LLM, workload: str) -> float:
    """ms/token for ``batch 1`` (after an untimed call), prompt tokens computed a second
    for the one-token workloads, else generated tok/s."""
    prompts, params = WORKLOADS[workload]
    if workload == "batch 1":
        llm.generate(prompts, params, use_tqdm=False)
    llm.reset_prefix_cache()
    cached = CACHED.get(workload, [])
    if cached:
        llm.generate([cached], FIRST, use_tqdm=False)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    if workload == "batch 1":
        return seconds / params.max_tokens * 1e3
    if params is FIRST:
        return sum(len(prompt) - len(cached) for prompt in prompts) / seconds
    return len(prompts) * params.n * params.max_tokens / seconds


def engine(dtype: str, variant: str) -> LLM:
    """An engine whose layers call ``variant``'s kernels."""
    backend, ops = VARIANTS[variant]
    llm = LLM(str(model_folder()), dtype=dtype, attention_backend=backend)
    for module in llm.engine.runner.model.modules():
        if hasattr(module, "ops"):
            module.ops = ops
    return llm


def main() -> None:
    """Alternate the variants and print the table."""
    args = parse_args()
    setup_torch()
    engines = {name: engine(args.dtype, name) for name in VARIANTS}
    results = {(name, w): [] for name in VARIANTS for w in WORKLOADS}
    for _ in range(args.rounds):
        for workload in WORKLOADS:
            for name, llm in engines.items():
                results[name, workload].append(timed_call(llm, workload))
    print(f"{args.dtype}, median of {args.rounds} alternating rounds; linear layout "
          f"{engines['cpu'].engine.runner.model.linear_layout or 'F.linear'}")
    rows = [("workload", "unit", *VARIANTS, *(f"{name} speed-up" for name in VARIANTS
                                              if name != "torch"))]
    for workload in WORKLOADS:
        medians = [statistics.median(results[name, workload]) for name in VARIANTS]
        per_token = workload == "batch 1"
        speed_ups = [medians[0] / m if per_token else m / medians[0] for m in medians[1:]]
        unit = "prompt tok/s" if WORKLOADS[workload][1] is FIRST else "tok/s"
        rows.append((workload, "ms/token" if per_token else unit,
                     *(f"{m:.1f}" for m in medians), *(f"{x:.2f}x" for x in speed_ups)))
    print_table(rows)


if __name__ == "__main__":
    main()
