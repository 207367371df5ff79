"""Dynamic sampling on the main job's task: trained groups per second and the share of
zero-advantage groups in a trained batch, against the synchronous baseline, same run.

Both runs are README's main job (recipes/grpo_arith.yaml: the embedded
SmolLM2-135M-Instruct, 8 prompts x 8 completions per step, float32, 2 threads) for the same
number of steps from the same seed, without held-out evaluation; the second turns on
``rollout.dynamic_sampling`` (drop mode, at most 16 extra prompts per step). Per run:
trained groups per second of rollout and of the whole step, the mean share of trained
groups whose rewards do not spread (all right or all wrong: zero advantages), prompts
sampled per trained group, steps that reached the cap, and the mean reward. The target:
0% zero-advantage groups in drop mode whenever the cap was not reached.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from common import print_table, setup_torch, timed_steps

from tandem.trainers.config import load_config
from tandem.trainers.trainer import Trainer

MAIN_JOB = str(Path(__file__).resolve().parent.parent / "recipes" / "grpo_arith.yaml")


def run(steps: int, overrides: list[str]) -> list[dict[str, float]]:
    """Each step's metrics, with its wall seconds as ``step_seconds``."""
    with tempfile.TemporaryDirectory() as output_dir:
        config = load_config(MAIN_JOB, [f"steps={steps}", "eval_size=0", "logging.wandb=false",
                                        "logging.progress_bar=false",
                                        "logging.console_every=0",
                                        f"output_dir={output_dir}", *overrides])
        return timed_steps(Trainer(config), steps)


def row(name: str, history: list[dict[str, float]], groups: int) -> tuple[str, ...]:
    rollout = sum(m["rollout_seconds"] for m in history)
    wall = sum(m["step_seconds"] for m in history)
    trained = groups * len(history)
    return (name, f"{trained / rollout:.3f}", f"{trained / wall:.3f}",
            f"{100 * statistics.mean(m['zero_spread_group_fraction'] for m in history):.0f}%",
            f"{statistics.mean(m.get('prompts_per_kept_group', 1.0) for m in history):.2f}",
            str(int(sum(m.get("dynamic_sampling_cap_reached", 0.0) for m in history))),
            f"{statistics.mean(m['reward'] for m in history):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    setup_torch()
    groups = load_config(MAIN_JOB).rollout.prompts_per_step
    baseline = run(args.steps, [])
    dynamic = run(args.steps, ["rollout.dynamic_sampling.enabled=true"])
    print(f"recipes/grpo_arith.yaml, {args.steps} steps each from seed 0, {groups} trained "
          "groups per step; dynamic: drop mode, at most 16 extra prompts per step")
    print_table([("run", "groups/s (rollout)", "groups/s (step)", "zero-advantage groups",
                  "prompts per trained group", "steps at cap", "mean reward"),
                 row("synchronous", baseline, groups), row("dynamic sampling", dynamic, groups)])


if __name__ == "__main__":
    main()
