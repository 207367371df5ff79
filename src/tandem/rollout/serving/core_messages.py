"""What the server's API side and its ``EngineCore`` say to each other: plain, picklable
dataclasses, the same whether the core runs on a thread or in a process of its own.

Into the core go ``CoreCall``s (add requests, abort, any engine method, shutdown); out of
it come ``CoreReady`` once, then ``StepReport``s (one per engine step), ``CallResult``s,
``StepFailed`` and, from the API side's own reader, ``CoreDied``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..outputs import RequestOutput


@dataclass(slots=True)
class CoreCall:
    """Run the core's method ``method`` with ``args``, between two steps.

    ``call_id`` None wants no answer (an abort); ``threaded`` runs it on a thread of its own
    beside the steps (a weight receiver's join or receive, which wait for the trainer).
    """

    call_id: int | None
    method: str
    args: tuple = ()
    threaded: bool = False


@dataclass(slots=True)
class CallResult:
    """A ``CoreCall``'s return value, or the exception it raised; with the engine's weight
    version after it, and whether it sleeps."""

    call_id: int
    value: Any = None
    error: BaseException | None = None
    weight_version: int = 0
    is_sleeping: bool = False


@dataclass(slots=True)
class TokenDelta:
    """What one completion of a streamed request added since the last report: its new
    tokens, their log-probs (None when not asked) and weight versions. Once the completion
    finished (in a group whose others go on), its finish and stop reasons and its final
    ``text`` come with it, once."""

    index: int
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[dict[int, float]] | None
    token_weight_versions: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str | None = None


@dataclass(slots=True)
class StepReport:
    """What one engine step did (``started``: when it began, on ``time.monotonic``'s clock,
    which every process of a machine shares).

    ``finished`` holds the outputs of the requests it finished; ``num_output_tokens`` the
    requests whose generated-token count changed, with the new count; ``deltas`` the new
    tokens of streamed requests; ``waiting`` the request ids in the scheduler's waiting
    queue (None: as in the last report).
    """

    started: float
    finished: list[RequestOutput]
    num_output_tokens: dict[str, int] = field(default_factory=dict)
    deltas: dict[str, list[TokenDelta]] = field(default_factory=dict)
    waiting: set[str] | None = None
    weight_version: int = 0


@dataclass(slots=True)
class StepFailed:
    """A step raised ``error``; the core aborted ``request_ids``, the requests it had."""

    error: BaseException
    request_ids: list[str]


@dataclass(slots=True)
class CoreReady:
    """A core process's engine is built: the facts the API side needs without it (its
    tokenizer's folder, the model's vocabulary, limits and stop tokens), or the exception
    that stopped the build."""

    model_dir: str = ""
    vocab_size: int = 0
    max_model_len: int = 0
    eos_token_ids: set[int] = field(default_factory=set)
    error: BaseException | None = None


@dataclass(slots=True)
class CoreDied:
    """The core process ended without being asked (``exitcode`` as ``Process.exitcode``)."""

    exitcode: int | None
