"""The ``tandem`` command line (``tandem.cli``): ``tandem generate --model M --prompt TEXT
[-n 8 ...]``, ``tandem serve MODEL [--port 8000 --api-key KEY ...]`` and ``tandem train
RECIPE.yaml [overrides]``.

The top of the stack: it imports the engine, the server and the trainers, and nothing
imports it.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
import typing

from tandem.rollout.config import EngineConfig
from tandem.rollout.default_model import DEFAULT_MODEL
from tandem.rollout.serving.config import ServerConfig

from .train import add_train_parser, train

ARGUMENT_TYPES = (bool, int, float, str)


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
    serve = commands.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible, "
                                "RL and weight-transfer endpoints)")
    serve.add_argument("model", help=f"local Hugging Face folder or {DEFAULT_MODEL!r}")
    add_config_arguments(serve, EngineConfig, skip={"model"})
    add_config_arguments(serve, ServerConfig)
    add_train_parser(commands)
    return parser


def add_config_arguments(parser: argparse.ArgumentParser, config_class: type,
                         skip: set[str] = frozenset()) -> None:
    """One ``--field-name`` option per field of a config dataclass, typed and documented
    from the class (its annotations and its docstring's ``Attributes:``)."""
    docs = _attribute_docs(config_class)
    hints = typing.get_type_hints(config_class)
    for field in dataclasses.fields(config_class):
        if field.name in skip:
            continue
        kind = _argument_type(hints[field.name])
        options = {"action": argparse.BooleanOptionalAction} if kind is bool else {"type": kind}
        parser.add_argument(f"--{field.name.replace('_', '-')}", default=field.default,
                            help=f"{docs.get(field.name, '')} (default: {field.default})",
                            **options)


def config_from_arguments(config_class: type, args: argparse.Namespace) -> typing.Any:
    """Build ``config_class`` from the parsed options ``add_config_arguments`` added."""
    names = {field.name for field in dataclasses.fields(config_class)}
    return config_class(**{name: value for name, value in vars(args).items() if name in names})


def _argument_type(hint: typing.Any) -> type:
    candidates = typing.get_args(hint) or (hint,)
    return next(kind for kind in candidates if kind in ARGUMENT_TYPES)


def _attribute_docs(config_class: type) -> dict[str, str]:
    """``name: text`` entries of the docstring's Attributes section (continuations joined)."""
    docs: dict[str, str] = {}
    section = (config_class.__doc__ or "").partition("Attributes:")[2]
    for name, text in re.findall(r"^\s{8}(\w+): (.*(?:\n\s{12}.*)*)", section, re.MULTILINE):
        docs[name] = " ".join(text.split())
    return docs


def generate(args: argparse.Namespace) -> None:
    """Run ``tandem generate``: print every completion and the throughput."""
    from tandem.rollout import LLM, SamplingParams

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


def serve(args: argparse.Namespace) -> None:
    """Run ``tandem serve``: load the engine, then serve it until interrupted."""
    try:
        from tandem.rollout.serving.server import serve as serve_engine
    except ImportError as error:
        raise ValueError(f"tandem serve needs the serve extra: pip install "
                         f"'tandem-rollout[serve]' ({error}).") from error
    from tandem.rollout import LLMEngine

    engine = LLMEngine(config_from_arguments(EngineConfig, args))
    serve_engine(engine, config_from_arguments(ServerConfig, args))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tandem`` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            return train(args)
        {"generate": generate, "serve": serve}[args.command](args)
    except ValueError as error:
        print(f"tandem: error: {error}", file=sys.stderr)
        return 2
    return 0
