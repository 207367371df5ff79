"""Partial rollouts on a long-tailed GRPO workload, against the synchronous step, same run.

Workload: the embedded SmolLM2-135M-Instruct (float32, 2 threads) on a mix of prompts: half
ask for a short answer ("What is 23 + 58? Answer with the number only."), half for a long
one ("Explain step by step how to add 23 and 58, ..."), so completions range from a few
tokens to the 256-token limit. 4 prompts x 4 completions trained per step, temperature 1,
reward ``correct`` (the last integer is the sum). Two runs of the same number of steps from
the same seed: synchronous (every group runs to its end) and ``rollout.partial`` (4 groups
over-provisioned; a step trains as soon as 4 groups are complete, the rest stay in the
engine with their KV and go on next step, ``carried_kv: keep``).

Per run: rollout seconds per trained group (the target: partial at most two thirds of the
synchronous), seconds per step and steps per second, the average number of sequences per
decode step (the engine's ``decoded_seqs / decode_steps``), rollout tokens per second, and
the mean reward.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile

from common import print_table, setup_torch, timed_steps

from tandem.trainers.config import load_config
from tandem.trainers.tasks import Task, correct_reward
from tandem.trainers.trainer import Trainer

PROMPTS_PER_STEP, NUM_GENERATIONS, MAX_TOKENS = 4, 4, 256


def example(seed: int, index: int) -> dict:
    """A short-answer or a step-by-step sum question, alternating."""
    rng = random.Random(seed * 1_000_003 + index)
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    if index % 2:
        prompt = f"What is {a} + {b}? Answer with the number only."
    else:
        prompt = (f"Explain step by step how to add {a} and {b}, digit by digit with the "
                  "carries, then give the sum on the last line.")
    return {"prompt": [{"role": "user", "content": prompt}], "answer": a + b}


TASK = Task(example, [], {"correct": correct_reward}, [("correct", 1.0)])


def run(steps: int, overrides: list[str]) -> tuple[list[dict[str, float]], dict[str, float]]:
    """Each step's metrics (with ``step_seconds``), and the engine's decode counters."""
    with tempfile.TemporaryDirectory() as output_dir:
        config = load_config(None, [
            f"steps={steps}", f"output_dir={output_dir}", "optim.lr=1e-5",
            f"rollout.prompts_per_step={PROMPTS_PER_STEP}",
            f"rollout.num_generations={NUM_GENERATIONS}", f"rollout.max_tokens={MAX_TOKENS}",
            "rollout.engine.kv_cache_memory_bytes=536870912", "logging.wandb=false",
            "logging.progress_bar=false", "logging.console_every=0", *overrides])
        trainer = Trainer(config, task=TASK)
        return timed_steps(trainer, steps), trainer.llm.stats()


def row(name: str, history: list[dict[str, float]], stats: dict[str, float]
        ) -> tuple[str, ...]:
    rollout = sum(m["rollout_seconds"] for m in history)
    steps = sum(m["step_seconds"] for m in history)
    tokens = sum(m["rollout_tok_per_s"] * m["rollout_seconds"] for m in history)
    groups = PROMPTS_PER_STEP * len(history)
    return (name, f"{rollout / groups:.2f}", f"{steps / len(history):.1f}",
            f"{len(history) / steps:.4f}",
            f"{stats['decoded_seqs'] / max(stats['decode_steps'], 1):.1f}",
            f"{tokens / rollout:.0f}", f"{statistics.mean(m['reward'] for m in history):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    setup_torch()
    sync = run(args.steps, [])
    partial = run(args.steps, ["rollout.partial.enabled=true",
                               f"rollout.partial.over_provision={PROMPTS_PER_STEP}"])
    print(f"{args.steps} steps each from seed 0, {PROMPTS_PER_STEP} groups of "
          f"{NUM_GENERATIONS} trained per step, up to {MAX_TOKENS} tokens, float32, 2 threads")
    table = [("run", "rollout s / trained group", "s / step", "steps / s",
              "seqs per decode step", "rollout tok/s", "mean reward"),
             row("synchronous", *sync), row("partial (keep)", *partial)]
    print_table(table)
    ratio = float(table[2][1]) / float(table[1][1])
    print(f"partial / synchronous rollout seconds per trained group: {ratio:.2f} "
          "(target <= 0.67)")


if __name__ == "__main__":
    main()
