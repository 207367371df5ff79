"""Does learning survive partial rollouts? README's main job, synchronous and partial, 2 seeds.

``benchmarks/partial_rollouts.py`` times partial rollouts on a long-tailed workload whose
reward never spreads on this model; this script checks the other half of the group-aware
issue's figure: the reward after 20 steps with ``rollout.partial`` (4 groups
over-provisioned, ``carried_kv: keep``, so stale groups train through importance weights)
stays within the spread of the synchronous run over 2 seeds. The task is the main job's
(recipes/grpo_arith.yaml, where rewards do spread): 20 steps of 8 prompts x 8 completions.

Per run: the mean reward of the last 5 steps, the held-out accuracy after the last step,
and for the partial runs the mean staleness of the trained tokens.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from common import print_table, setup_torch

from tandem.trainers.config import load_config
from tandem.trainers.trainer import Trainer

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "grpo_arith.yaml"
PARTIAL = ["rollout.partial.enabled=true", "rollout.partial.over_provision=4"]


def run(seed: int, steps: int, overrides: list[str]) -> dict[str, float]:
    """The last 5 steps' mean reward and mean staleness, and the held-out accuracy after."""
    with tempfile.TemporaryDirectory() as output_dir:
        config = load_config(str(RECIPE), [
            f"seed={seed}", f"steps={steps}", f"output_dir={output_dir}",
            "logging.wandb=false", "logging.progress_bar=false", "logging.console_every=0",
            *overrides])
        trainer = Trainer(config)
        history = [trainer.train_step() for _ in range(steps)]
        last = history[-5:]
        return {"reward": statistics.mean(m["reward"] for m in last),
                "staleness": statistics.mean(m.get("staleness_mean", 0.0) for m in last),
                "accuracy": trainer.evaluate()["accuracy"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = parser.parse_args()
    setup_torch()
    results = {(mode, seed): run(seed, args.steps, overrides)
               for mode, overrides in (("synchronous", []), ("partial (keep)", PARTIAL))
               for seed in args.seeds}
    print(f"recipes/grpo_arith.yaml, {args.steps} steps, seeds {args.seeds}")
    print_table([("run", "seed", f"reward, steps {max(args.steps - 4, 1)}-{args.steps}",
                  "held-out accuracy after", "staleness of trained tokens")]
                + [(mode, str(seed), f"{r['reward']:.3f}", f"{r['accuracy']:.3f}",
                    f"{r['staleness']:.2f}") for (mode, seed), r in results.items()])
    for key in ("reward", "accuracy"):
        sync = [r[key] for (mode, _), r in results.items() if mode == "synchronous"]
        partial = [r[key] for (mode, _), r in results.items() if mode != "synchronous"]
        inside = all(min(sync) <= value <= max(sync) for value in partial)
        print(f"{key}: synchronous spread [{min(sync):.3f}, {max(sync):.3f}], partial "
              f"{', '.join(f'{v:.3f}' for v in partial)}: "
              f"{'within' if inside else 'outside'} the spread")


if __name__ == "__main__":
    main()
