"""Where Tandem's CPU generation call spends its time: by phase, and by torch op.

Runs Tandem exactly as ``grpo_cpu.py`` does (same workload, prompts, sampling and KV pool;
``--workload``, ``--dtype``, ``--max-tokens`` as there), one untimed warm-up call, then the
call twice more:

1. timed by phase, each summed over the call's steps: scheduling (``Scheduler.schedule``),
   flattening the batch (``ModelRunner._prepare``, which also builds the cascade layout), the
   model's forward pass, the LM head, and the rest of the step (sampling, output processing,
   the engine's bookkeeping);
2. under ``torch.profiler``: the ops with the most self CPU time, with their share.

Run::

    python benchmarks/cpu_profile.py
    python benchmarks/cpu_profile.py --workload heavy --max-tokens 64
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable

from common import DTYPES, model_folder, print_table, setup_torch
from grpo_cpu import WORKLOADS, build_workload, tandem_call
from torch.profiler import ProfilerActivity, profile

from tandem.rollout import LLM

TOP_OPS = 15


def parse_args() -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=tuple(WORKLOADS), default="grpo")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="new tokens per sequence (default: the workload's)")
    return parser.parse_args()


def phase_seconds(llm: LLM, call: Callable[[], list[int]]) -> dict[str, float]:
    """Seconds of each phase of one ``call``, summed over its steps, and the call's total."""
    engine, runner = llm.engine, llm.engine.runner
    seconds: dict[str, float] = defaultdict(float)
    phases = {"schedule": (engine.scheduler, "schedule"), "prepare": (runner, "_prepare"),
              "forward": (runner, "_forward"), "LM head": (runner.model, "compute_logits")}

    def timed(name: str, method: Callable) -> Callable:
        def run(*args, **kwargs):
            start = time.perf_counter()
            result = method(*args, **kwargs)
            seconds[name] += time.perf_counter() - start
            return result
        return run

    for name, (owner, attribute) in phases.items():
        setattr(owner, attribute, timed(name, getattr(owner, attribute)))
    start = time.perf_counter()
    call()
    total = time.perf_counter() - start
    for owner, attribute in phases.values():
        delattr(owner, attribute)  # back to the class's method
    return {**seconds, "rest": total - sum(seconds.values()), "total": total}


def op_shares(call: Callable[[], list[int]]) -> tuple[list[tuple[str, float, int]], float]:
    """The ``TOP_OPS`` ops by self CPU seconds in one profiled ``call`` (name, seconds,
    calls), and all ops' self CPU seconds."""
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        call()
    events = profiler.key_averages()
    ranked = sorted(events, key=lambda event: event.self_cpu_time_total, reverse=True)
    top = [(event.key, event.self_cpu_time_total / 1e6, event.count)
           for event in ranked[:TOP_OPS]]
    return top, sum(event.self_cpu_time_total for event in events) / 1e6


def main() -> None:
    """Warm up, then print the phase table and the op table."""
    args = parse_args()
    setup_torch()
    folder = model_folder()
    work = build_workload(folder, args.workload, args.max_tokens)
    llm, call = tandem_call(folder, args.dtype, work)
    call()
    phases = phase_seconds(llm, call)
    print(f"{args.workload}: {len(work.prompt_ids)} prompts x n={work.n}, "
          f"max_tokens={work.max_tokens}, {args.dtype}")
    print_table([("phase", "seconds", "share"),
                 *((name, f"{value:.3f}", f"{value / phases['total']:.1%}")
                   for name, value in phases.items())])
    top, total = op_shares(call)
    print(f"\ntorch.profiler, self CPU time of all ops {total:.2f} s")
    print_table([("op", "self seconds", "share", "calls"),
                 *((name, f"{value:.3f}", f"{value / total:.1%}", str(count))
                   for name, value, count in top)])


if __name__ == "__main__":
    main()
