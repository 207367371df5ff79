"""``tandem generate --model M --prompt TEXT [-n 8 ...]``: sample completions, print them and
the throughput; the engine options are ``EngineConfig``'s fields."""

from __future__ import annotations

import argparse
import dataclasses
import time

from tandem.rollout.config import EngineConfig
from tandem.rollout.default_model import DEFAULT_MODEL

from .arguments import add_config_arguments

# EngineConfig's fields that are not engine options here: the model is its own option, and
# --seed is each request's.
NOT_ENGINE_OPTIONS = {"model", "seed"}


def add_generate_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``generate`` on the ``tandem`` command's subparsers."""
    generate_parser = commands.add_parser("generate", help="sample completions of prompts")
    generate_parser.set_defaults(run=generate)
    generate_parser.add_argument("--model", default=DEFAULT_MODEL,
                                 help=f"local Hugging Face folder or {DEFAULT_MODEL!r} (default)")
    generate_parser.add_argument("--prompt", action="append", required=True,
                                 help="a prompt (repeat for several)")
    generate_parser.add_argument("--chat", action="store_true",
                                 help="treat each prompt as a user message and apply the chat "
                                      "template")
    generate_parser.add_argument("-n", type=int, default=1, help="completions per prompt")
    generate_parser.add_argument("--temperature", type=float, default=1.0, help="0 is greedy")
    generate_parser.add_argument("--top-p", type=float, default=1.0)
    generate_parser.add_argument("--top-k", type=int, default=0)
    generate_parser.add_argument("--max-tokens", type=int, default=64)
    generate_parser.add_argument("--seed", type=int, default=None, help="per-request seed")
    add_config_arguments(generate_parser, EngineConfig, skip=NOT_ENGINE_OPTIONS)


def generate(args: argparse.Namespace) -> int:
    """Run ``tandem generate``: print every completion and the throughput; returns 0.

    Raises:
        ValueError: for invalid sampling parameters or engine options.
    """
    from tandem.rollout import LLM, SamplingParams

    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, max_tokens=args.max_tokens, seed=args.seed)
    llm = LLM(args.model, **{field.name: getattr(args, field.name)
                             for field in dataclasses.fields(EngineConfig)
                             if field.name not in NOT_ENGINE_OPTIONS})
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
    return 0
