"""``tandem train RECIPE.yaml [section.field=value ...]``: run a recipe, print where it went;
``--list-keys`` lists every recipe key with its help, ``--print-config`` prints the resolved
recipe as YAML (defaults included) without running it."""

from __future__ import annotations

import argparse
import sys

import yaml

from tandem.trainers.config import load_config, to_dict
from tandem.trainers.data_parallel import shutdown
from tandem.trainers.rewards import RewardError


def add_train_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``train`` on the ``tandem`` command's subparsers."""
    train_parser = commands.add_parser("train", help="train a policy with GRPO or PPO (a recipe)")
    train_parser.set_defaults(run=train)
    train_parser.add_argument("recipe", nargs="?", default=None,
                              help="a recipe YAML (recipes/grpo_arith.yaml...); omit for defaults")
    train_parser.add_argument("overrides", nargs="*",
                              help="section.field=value settings over the recipe "
                                   "(steps=5, optim.lr=1e-5, lora.enabled=true)")
    train_parser.add_argument("--list-keys", action="store_true",
                              help="list every recipe key with its type, default and help, "
                                   "and exit")
    train_parser.add_argument("--print-config", action="store_true",
                              help="print the resolved recipe (the recipe, the overrides and "
                                   "every default) as YAML, and exit")


def train(args: argparse.Namespace) -> int:
    """Run ``tandem train``; returns the exit status."""
    if args.list_keys:
        from tandem.trainers.recipe_keys import format_keys, recipe_keys

        print(format_keys(recipe_keys()))
        return 0
    recipe, overrides = args.recipe, list(args.overrides)
    if recipe is not None and "=" in recipe:
        recipe, overrides = None, [recipe, *overrides]
    config = load_config(recipe, overrides)
    if args.print_config:
        print(yaml.safe_dump(to_dict(config), sort_keys=False), end="")
        return 0
    from tandem.trainers.trainer import Trainer

    trainer = Trainer(config)
    try:
        summary = trainer.train()
    except RewardError as error:
        print(f"tandem: error: {error}", file=sys.stderr)
        return 1
    if trainer.context.is_main:
        print_summary(summary)
    shutdown(trainer.context, 0)
    return 0


def print_summary(summary: dict) -> None:
    """Before/after accuracy, the reward's first and last steps, and where everything went."""
    history = summary["history"]
    if history:
        first, last = history[0]["reward"], history[-1]["reward"]
        print(f"mean reward: first step {first:.3f}, last step {last:.3f}")
    if summary["before"]:
        print(f"held-out accuracy: before {summary['before']['accuracy']:.3f}, after "
              f"{summary['after']['accuracy']:.3f}")
    print(f"checkpoint: {summary['checkpoint']}")
    if summary["jsonl"]:
        print(f"metrics (JSONL): {summary['jsonl']}")
    if summary["wandb_dir"]:
        print(f"W&B run (offline unless WANDB_MODE=online): {summary['wandb_dir']}")
