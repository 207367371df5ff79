"""The ``tandem`` command line: ``tandem generate --model M --prompt TEXT [-n 8 ...]`` and
``tandem train RECIPE.yaml [overrides]``.

``train`` lives in ``tandem.trainers`` (which builds on the engine); this module reaches it
only through the import in ``build_parser``, so the engine never imports trainer code.
"""

from __future__ import annotations

import argparse
import sys
import time

from .default_model import DEFAULT_MODEL


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every ``tandem`` subcommand."""
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem rollout engine.")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", help="sample completions of prompts")
    generate.add_argument("--model", default=DEFAULT_MODEL,
                          help=f"local Hugging Face folder or {DEFAULT_MODEL!r} (default)")
    generate.add_argument("--prompt", action="append", required=True,
                          help="a prompt (repeat for several)")
    generate.add_argument("--chat", action="store_true",
                          help="treat each prompt as a user message and apply the chat template")
    generate.add_argument("-n", type=int, default=1, help="completions per prompt")
    generate.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--seed", type=int, default=None, help="per-request seed")
    generate.add_argument("--dtype", default="auto")
    generate.add_argument("--device", default=None)
    from tandem.trainers.cli import add_train_parser

    add_train_parser(commands)
    return parser


def generate(args: argparse.Namespace) -> None:
    """Run ``tandem generate``: print every completion and the throughput."""
    from . import LLM, SamplingParams

    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, max_tokens=args.max_tokens, seed=args.seed)
    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    start = time.perf_counter()
    if args.chat:
        conversations = [[{"role": "user", "content": p}] for p in args.prompt]
        outputs = llm.chat(conversations, params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    num_tokens = 0
    for prompt, output in zip(args.prompt, outputs):
        for completion in output.outputs:
            num_tokens += len(completion.token_ids)
            print(f"[{prompt!r} #{completion.index}] ({completion.finish_reason}) "
                  f"{completion.text}")
    print(f"{num_tokens} tokens in {seconds:.2f} s ({num_tokens / seconds:.1f} tok/s)")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tandem`` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            from tandem.trainers.cli import train

            return train(args)
        generate(args)
    except ValueError as error:
        print(f"tandem: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
