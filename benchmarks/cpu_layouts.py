"""The CPU linear layouts on one engine: tokens per second of each, alternating in one process.

The embedded SmolLM2-135M-Instruct on 2 threads, in float32 (or ``--dtype``). The engine's
projections are switched between the layouts with ``pack_linear_weights``: ``F.linear`` on
row-major weights, the weights re-stored column-major (``"transposed"``) and, where oneDNN
packs the dtype, oneDNN's packed copies. Each round times every layout on two workloads: one
sequence greedy for 64 tokens (ms/token, after an untimed call) and grpo's shape, 8 prompts
of 40 tokens x n=8 x 64 tokens sampled (tok/s, the prefix cache reset first). ``--rounds``
rounds alternate the layouts; each layout's median is printed beside F.linear's. The
sampled tokens are printed equal or not: last-bit differences may change them.

    python benchmarks/cpu_layouts.py [--dtype float32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import DTYPES, model_folder, print_table, setup_torch

from tandem.kernels import cpu_linear
from tandem.rollout import LLM, SamplingParams

ONE = SamplingParams(temperature=0, max_tokens=64, min_tokens=64)
GROUPS = SamplingParams(n=8, temperature=1.0, max_tokens=64, ignore_eos=True, seed=1)
PROMPT = [[1, *range(100, 137)]]
PROMPTS = [[1, *range(100 + i, 140 + i)] for i in range(8)]


def parse_args() -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--rounds", type=int, default=3)
    return parser.parse_args()


def one_round(llm: LLM) -> tuple[float, float, list[int]]:
    """ms/token of one greedy sequence, tok/s of the grpo shape, and its first tokens."""
    llm.generate(PROMPT, ONE, use_tqdm=False)
    start = time.perf_counter()
    llm.generate(PROMPT, ONE, use_tqdm=False)
    ms_per_token = (time.perf_counter() - start) / ONE.max_tokens * 1e3
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(PROMPTS, GROUPS, use_tqdm=False)
    tok_s = len(PROMPTS) * GROUPS.n * GROUPS.max_tokens / (time.perf_counter() - start)
    return ms_per_token, tok_s, outputs[0].outputs[0].token_ids


def main() -> None:
    """Alternate the layouts and print the table."""
    args = parse_args()
    setup_torch()
    llm = LLM(str(model_folder()), dtype=args.dtype)
    model = llm.engine.runner.model
    chosen = model.linear_layout
    layouts = cpu_linear.candidate_layouts(getattr(torch, args.dtype))
    results: dict[str | None, list[tuple[float, float, list[int]]]] = {name: [] for name in layouts}
    for _ in range(args.rounds):
        for layout in layouts:
            model.pack_linear_weights(layout)
            results[layout].append(one_round(llm))
    model.pack_linear_weights(chosen)
    medians = {layout: (statistics.median(r[0] for r in runs),
                        statistics.median(r[1] for r in runs)) for layout, runs in results.items()}
    reference = medians[None]
    print(f"{args.dtype}, median of {args.rounds} alternating rounds; the engine chose "
          f"{chosen or 'F.linear'}")
    rows = [("layout", "batch 1 ms/token", "vs F.linear", "grpo 8x8 tok/s", "vs F.linear",
             "same tokens")]
    for layout, (ms, tok_s) in medians.items():
        same = all(r[2] == results[None][0][2] for r in results[layout])
        rows.append((layout or "F.linear", f"{ms:.1f}", f"{reference[0] / ms:.2f}x",
                     f"{tok_s:.0f}", f"{tok_s / reference[1]:.2f}x", str(same)))
    print_table(rows)


if __name__ == "__main__":
    main()
