"""CPU attention backends side by side: the compiled decode kernel against the torch reference.

The embedded SmolLM2-135M-Instruct on 2 threads, one engine per backend
(``attention_backend="cpu"``: decodes read the pool in place in C; ``"torch"``: the
reference, which gathers each decode's K/V, upcasts it, and attends groups as a cascade),
both in this process with the same linear layout. Each round times both engines on three
workloads, alternating:

- ``batch 1``: one sequence greedy for 64 tokens, ms/token (after an untimed call);
- ``grpo 8x8``: 8 prompts of 40 tokens x n=8 x 64 tokens sampled, tok/s;
- ``long 8x1``: 8 distinct prompts of 564 tokens x 128 tokens sampled (the serving
  benchmark's shape: decode attention over long contexts), tok/s.

The prefix cache is reset before each timed call. ``--rounds`` rounds; each backend's median
is printed beside the reference's. Sampled tokens may differ in the last bits' wake.

    python benchmarks/cpu_attention.py [--dtype float32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import DTYPES, model_folder, print_table, setup_torch

from tandem.rollout import LLM, SamplingParams

BACKENDS = ("torch", "cpu")
ONE = SamplingParams(temperature=0, max_tokens=64, min_tokens=64)
GROUPS = SamplingParams(n=8, temperature=1.0, max_tokens=64, ignore_eos=True, seed=1)
LONG = SamplingParams(temperature=1.0, max_tokens=128, ignore_eos=True, seed=1)
WORKLOADS = {
    "batch 1": ([[1, *range(100, 137)]], ONE),
    "grpo 8x8": ([[1, *range(100 + i, 140 + i)] for i in range(8)], GROUPS),
    "long 8x1": ([[1, *range(1000 + 600 * i, 1563 + 600 * i)] for i in range(8)], LONG),
}


def parse_args() -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--rounds", type=int, default=3)
    return parser.parse_args()


def timed_call(llm: LLM, workload: str) -> float:
    """ms/token for ``batch 1`` (after an untimed call), else generated tok/s."""
    prompts, params = WORKLOADS[workload]
    if workload == "batch 1":
        llm.generate(prompts, params, use_tqdm=False)
    llm.reset_prefix_cache()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    if workload == "batch 1":
        return seconds / params.max_tokens * 1e3
    return len(prompts) * params.n * params.max_tokens / seconds


def main() -> None:
    """Alternate the backends and print the table."""
    args = parse_args()
    setup_torch()
    engines = {name: LLM(str(model_folder()), dtype=args.dtype, attention_backend=name)
               for name in BACKENDS}
    results = {(name, w): [] for name in BACKENDS for w in WORKLOADS}
    for _ in range(args.rounds):
        for workload in WORKLOADS:
            for name, llm in engines.items():
                results[name, workload].append(timed_call(llm, workload))
    print(f"{args.dtype}, median of {args.rounds} alternating rounds; linear layout "
          f"{engines['cpu'].engine.runner.model.linear_layout or 'F.linear'}")
    rows = [("workload", "unit", "torch reference", "compiled (cpu)", "speed-up")]
    for workload in WORKLOADS:
        reference, ours = (statistics.median(results[name, workload]) for name in BACKENDS)
        per_token = workload == "batch 1"
        speed_up = reference / ours if per_token else ours / reference
        rows.append((workload, "ms/token" if per_token else "tok/s", f"{reference:.1f}",
                     f"{ours:.1f}", f"{speed_up:.2f}x"))
    print_table(rows)


if __name__ == "__main__":
    main()
