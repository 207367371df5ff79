"""``EngineCore``: the server's busy loop around one ``LLMEngine`` (vLLM V1's engine core).

While the engine has unfinished requests the core steps continuously: between two steps it
takes every command waiting in its inbox without blocking (add, abort, an engine method),
then steps, then emits one ``StepReport``. With nothing to do it blocks on the inbox. It
never waits for the API side: reports pile up there and streams coalesce them (one chunk
carries every token that arrived since the last), instead of the engine slowing down.

The core runs on a thread of the API process (``ThreadCore``) or in a process of its own
(``ProcessCore``; core_client.py); it sees only an inbox and an ``emit`` callable.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist

from tandem.kernels.cpu_threads import bind_threads
from tandem.sync import WeightReceiver

from ..core.sequence import Request, Sequence
from ..engine import LLMEngine
from ..input_processor import ProcessedPrompt
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .core_messages import CallResult, CoreCall, StepFailed, StepReport, TokenDelta

Emit = Callable[[object], None]


class CoreInbox(Protocol):
    """Where the core's commands wait."""

    def get(self, block: bool) -> CoreCall | None:
        """The next command; None when ``block`` is False and none waits."""


@dataclass(slots=True)
class _StreamProgress:
    """How much of a streamed request's completions the reports carried."""

    sent: list[int]
    done: set[int] = field(default_factory=set)


class EngineCore:
    """Steps ``engine`` while it has work; runs the inbox's commands between steps.

    Commands name a public method of this class (``CoreCall.method``); each call's answer
    (or exception) is emitted as a ``CallResult``.

    Args:
        engine: the engine it owns (nothing else may call it, but a weight commit, which
            takes the engine's lock and so lands between two steps).
        inbox: where the commands arrive.
        emit: sends a message to the API side; called from the core's thread, and from a
            threaded call's.
    """

    def __init__(self, engine: LLMEngine, inbox: CoreInbox, emit: Emit) -> None:
        self.engine = engine
        self.inbox = inbox
        self.emit = emit
        self.running = True
        self.frozen = False  # /pause?mode=keep: requests stay, steps stop
        self.weight_receiver: WeightReceiver | None = None
        self._streams: dict[str, _StreamProgress] = {}
        self._counts: dict[str, int] = {}
        self._waiting: set[str] = set()

    def run(self) -> None:
        """Step and take commands until ``shutdown``."""
        self.engine.bind_thread()
        while self.running:
            self._take_commands(block=not self._has_work())
            if self.running and self._has_work():
                self._step()

    def _has_work(self) -> bool:
        return not self.frozen and self.engine.has_unfinished_requests()

    def _take_commands(self, block: bool) -> None:
        command = self.inbox.get(block)
        while command is not None:
            if command.threaded:
                threading.Thread(target=self._answer, args=(command,), daemon=True,
                                 name=f"tandem-core-{command.method}").start()
            else:
                self._answer(command)
            command = self.inbox.get(False) if self.running else None

    def _answer(self, command: CoreCall) -> None:
        value, error = None, None
        try:
            self.engine.bind_thread()  # a threaded command runs on a thread of its own
            value = getattr(self, command.method)(*command.args)
        except Exception as exc:  # the caller's error, answered; the core goes on
            error = exc
        if command.call_id is not None:
            self.emit(CallResult(command.call_id, value, error, self.engine.weight_version,
                                 self.engine.is_sleeping))

    def _step(self) -> None:
        started = time.monotonic()
        try:
            finished = self.engine.step()
        except Exception as exc:  # a failed step fails its requests, not the server
            request_ids = list(self.engine.requests)
            self.abort_requests(request_ids)
            self.emit(StepFailed(exc, request_ids))
            return
        self.emit(self._report(started, finished))

    def _report(self, started: float, finished: list[RequestOutput]) -> StepReport:
        for output in finished:
            self._forget(output.request_id)
        report = StepReport(started, finished, weight_version=self.engine.weight_version)
        for request_id, request in self.engine.requests.items():
            num_output_tokens = request.num_output_tokens
            if num_output_tokens == self._counts.get(request_id, 0):
                continue
            self._counts[request_id] = report.num_output_tokens[request_id] = num_output_tokens
            progress = self._streams.get(request_id)
            if progress is not None:
                report.deltas[request_id] = self._deltas(request, progress)
        waiting = self.engine.waiting_request_ids()
        if waiting != self._waiting:
            report.waiting = self._waiting = waiting
        return report

    def _deltas(self, request: Request, progress: _StreamProgress) -> list[TokenDelta]:
        deltas, final = [], None
        for seq in request.seqs:
            if seq.index in progress.done:
                continue
            delta = _delta(seq, progress.sent[seq.index])
            progress.sent[seq.index] += len(delta.token_ids)
            if seq.is_finished:  # in a group whose others go on: its final text, once
                final = final or self.engine.request_output(request.request_id)
                delta.text = final.outputs[seq.index].text
                delta.finish_reason, delta.stop_reason = seq.finish_reason, seq.stop_reason
                progress.done.add(seq.index)
            if delta.token_ids or delta.finish_reason:
                deltas.append(delta)
        return deltas

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._counts.pop(request_id, None)

    def add_requests(self, request_ids: list[str], prompts: list[ProcessedPrompt],
                     params: list[SamplingParams], stream: bool) -> set[str]:
        """Queue requests, all or none (as ``LLMEngine.add_requests``); with ``stream`` the
        reports carry their new tokens. Returns the scheduler's waiting request ids.

        Raises:
            ValueError, EngineAsleepError: as ``LLMEngine.add_requests``.
        """
        self.engine.add_requests(request_ids, prompts, params)
        if stream:
            for request_id, request_params in zip(request_ids, params):
                self._streams[request_id] = _StreamProgress([0] * request_params.n)
        self._waiting = self.engine.waiting_request_ids()
        return set(self._waiting)

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput | None]:
        """Abort requests now (freeing their blocks); their outputs so far, None for one the
        engine does not have (unknown or finished)."""
        for request_id in request_ids:
            self._forget(request_id)
        return [self.engine.abort_request(request_id) for request_id in request_ids]

    def engine_method(self, name: str, *args: Any) -> Any:
        """``engine.<name>(*args)``: ``stats``, ``sleep``, ``wake_up``,
        ``reset_prefix_cache``... (the public methods of ``LLMEngine``).

        Raises:
            ValueError: for a private name.
        """
        if name.startswith("_"):
            raise ValueError(f"{name!r} is not a public engine method.")
        return getattr(self.engine, name)(*args)

    def set_frozen(self, frozen: bool) -> None:
        """Stop stepping (requests stay where they are) or step again."""
        self.frozen = frozen

    def ping(self) -> None:
        """Nothing: answered once the step running when it arrived has ended."""

    def bind_threads(self, cpus: list[int]) -> None:
        """Pin the core's thread and its OpenMP team to ``cpus`` (``bind_threads``)."""
        bind_threads(cpus)

    def join_weight_group(self, master_address: str, master_port: int, world_size: int,
                          rank: int, timeout: timedelta) -> None:
        """Join the trainer's weight-transfer group as ``rank`` (blocks until it forms;
        call threaded). A failed join leaves no receiver.

        Raises:
            ValueError: as ``WeightReceiver``.
            TimeoutError: when the group did not form (``torch.distributed``'s
                ``DistError``, which does not cross a process boundary, as its message).
        """
        self.weight_receiver = None
        try:
            self.weight_receiver = WeightReceiver(self.engine, master_address, master_port,
                                                  world_size, rank, None, timeout)
        except dist.DistError as exc:  # the store unreachable, or a rank missing
            raise TimeoutError(str(exc)) from None

    def receive_weights(self, timeout: timedelta,
                        expected: list[tuple[str, str, tuple[int, ...]]] | None) -> int:
        """Receive one update and commit it between two steps (call threaded); returns
        the new weight version.

        Raises:
            RuntimeError: before ``join_weight_group``.
            WeightUpdateError: as ``WeightReceiver.receive``.
        """
        if self.weight_receiver is None:
            raise RuntimeError("no weight-transfer group was joined.")
        return self.weight_receiver.receive(timeout, expected)

    def shutdown(self) -> None:
        """End ``run`` after the current command."""
        self.running = False


def _delta(seq: Sequence, start: int) -> TokenDelta:
    """``seq``'s tokens from its ``start``-th generated one, with their log-probs."""
    params = seq.sampling_params
    return TokenDelta(seq.index, seq.token_ids[seq.num_prompt_tokens + start:],
                      seq.logprobs[start:] if params.logprobs is not None else None,
                      seq.top_logprobs[start:] if params.logprobs else None,
                      seq.token_weight_versions[start:])
