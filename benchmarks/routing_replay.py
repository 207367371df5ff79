"""Routing replay on a mixture of experts: how far the trainer's forward is from the
sampler's, with exact log-probs, without them, and without them but with routing replay.

Runs ``recipes/grpo_moe_tiny.yaml`` (GRPO on ``tiny-random-moe``: Qwen3-MoE shape, 8
experts, top 2) for each mode and dtype, and prints per run: the mean and least
``routing_agreement`` over the steps (the fraction of token-layer choices where the
trainer's own top-k set equals the sampler's), the largest ``sampler_logprob_diff_max``,
the mean reward over the first and last two steps, and the mean training seconds per step.

Run::

    python benchmarks/routing_replay.py [--dtypes float32 bfloat16] [--steps 10]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import print_table, setup_torch

from tandem.trainers.config import load_config
from tandem.trainers.trainer import Trainer

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "grpo_moe_tiny.yaml"
MODES = {"exact": ["exact_logprobs=null", "moe.routing_replay=false"],
         "not exact": ["exact_logprobs=false", "moe.routing_replay=false"],
         "not exact, replay": ["exact_logprobs=false", "moe.routing_replay=true"]}


def run(mode: str, dtype: str, steps: int) -> tuple[str, ...]:
    with tempfile.TemporaryDirectory() as out:
        config = load_config(RECIPE, [*MODES[mode], f"dtype={dtype}", f"steps={steps}",
                                      f"output_dir={out}", "logging.wandb=false",
                                      "logging.progress_bar=false", "eval_size=0"])
        trainer = Trainer(config)
        history = [trainer.train_step() for _ in range(steps)]
    agreement = [m["routing_agreement"] for m in history]
    first, last = (sum(m["reward"] for m in part) / 2 for part in (history[:2], history[-2:]))
    return (mode, dtype, f"{sum(agreement) / steps:.4f}", f"{min(agreement):.4f}",
            f"{max(m['sampler_logprob_diff_max'] for m in history):.3g}",
            f"{first:.3f} -> {last:.3f}",
            f"{sum(m['train_seconds'] for m in history) / steps:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    setup_torch()
    rows = [("mode", "dtype", "agreement mean", "agreement min", "diff max", "reward",
             "train s/step")]
    rows += [run(mode, dtype, args.steps) for dtype in args.dtypes for mode in MODES]
    print_table(rows)


if __name__ == "__main__":
    main()
