"""The ``tandem`` command line (``tandem.cli``): ``tandem generate`` (``generate.py``),
``tandem serve`` (``serve.py``) and ``tandem train`` (``train.py``); ``arguments.py`` turns a
config dataclass into options.

The top of the stack: it imports the engine, the server and the trainers, and nothing
imports it.
"""

from __future__ import annotations

import argparse
import os
import sys

# Transparent huge pages for torch's large CPU tensors (torch reads this at its first large
# allocation). On a VM every 4 KiB page first touched faults into the hypervisor: a GRPO
# training step's fresh activations and logits (hundreds of MB each step) spent seconds
# there. Set THP_MEM_ALLOC_ENABLE=0 to keep torch's default.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from .generate import add_generate_parser
from .serve import add_serve_parser
from .train import add_train_parser


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every ``tandem`` subcommand (each sets ``run``, its handler)."""
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem rollout engine.")
    commands = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(commands)
    add_serve_parser(commands)
    add_train_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tandem`` command; returns the exit status (2 for bad input)."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ValueError as error:
        print(f"tandem: error: {error}", file=sys.stderr)
        return 2
