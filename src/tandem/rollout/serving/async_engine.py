"""``AsyncLLMEngine``: the server's asyncio side of one ``EngineCore``.

Requests arrive concurrently on the event loop; the engine core (engine_core.py) runs on a
thread or in a process of its own (core_client.py) and steps continuously while it has
work, whatever the event loop is doing. Commands go to the core in order (add, abort, any
engine method); its messages come back to the event loop in order, through
``call_soon_threadsafe``: each step's report (finished outputs, new tokens of streamed
requests, token counts, the scheduler's waiting queue) and each call's answer. Prompts are
tokenized on the input thread, beside the event loop.

A streamed request's tokens accumulate until its consumer is ready: one that fell behind
gets one snapshot carrying everything since its last, never one per step. Admission is
bounded (admission.py); a request past its deadline is aborted; a core process that dies
fails every request and every later call with ``EngineDeadError`` (503).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ..input_processor import ProcessedPrompt
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .admission import Admission, Deadline, within
from .core_client import EngineDeadError, ProcessCore, ThreadCore
from .core_messages import CallResult, CoreCall, CoreDied, StepFailed, StepReport
from .metrics import ServerMetrics
from .tracked_request import StreamedOutput, TrackedRequest

PAUSE_MODES = ("abort", "wait", "keep")
T = TypeVar("T")


class AsyncLLMEngine:
    """Drives an ``EngineCore`` from asyncio: concurrent requests, streaming, abort, pause.

    Start it with ``start()`` inside a running event loop; ``shutdown()`` stops it.

    Args:
        core: where the engine core runs (``ThreadCore`` or ``ProcessCore``); its
            ``engine`` is what the server reads of the engine.
        metrics: the server's counters and histograms, updated as requests go.
        max_num_waiting: most requests accepted but not yet running (None: no bound).
    """

    def __init__(self, core: ThreadCore | ProcessCore, metrics: ServerMetrics,
                 max_num_waiting: int | None = None) -> None:
        self.core = core
        self.engine = core.engine
        self.metrics = metrics
        self.admission = Admission(max_num_waiting)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._input_executor = ThreadPoolExecutor(max_workers=1,
                                                  thread_name_prefix="tandem-input")
        self._tracked: dict[str, TrackedRequest] = {}
        self._request_ids = itertools.count()
        self._call_ids = itertools.count()
        self._calls: dict[int, tuple[asyncio.Future, Callable[[Any], None] | None]] = {}
        self._dead: EngineDeadError | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._admitting = asyncio.Event()
        self._admitting.set()

    def start(self) -> None:
        """Start the core, delivering its messages to the running event loop."""
        self.loop = asyncio.get_running_loop()
        self.core.start(self._deliver)

    async def shutdown(self) -> None:
        """Abort what is left, stop the core and release the input thread."""
        for request_id in list(self._tracked):
            self.abort(request_id)
        await asyncio.to_thread(self.core.close)
        self._input_executor.shutdown(wait=True)

    @property
    def is_dead(self) -> bool:
        """True once the core process has died."""
        return self._dead is not None

    async def call(self, method: str, *args: Any) -> Any:
        """Run the engine's public method ``method(*args)`` (``stats``, ``sleep``...)
        between steps; its result or exception.

        Raises:
            EngineDeadError: when the core process has died.
        """
        return await self.call_core("engine_method", method, *args)

    async def call_core(self, method: str, *args: Any, threaded: bool = False,
                        on_result: Callable[[Any], None] | None = None) -> Any:
        """Run the ``EngineCore`` method ``method(*args)`` between steps (``threaded``: on
        a core thread of its own, beside the steps); its result or exception.
        ``on_result`` sees the result first, in order with the step reports.

        Raises:
            EngineDeadError: when the core process has died.
        """
        future = asyncio.get_running_loop().create_future()
        call_id = next(self._call_ids)
        self._calls[call_id] = (future, on_result)
        try:
            self._send(CoreCall(call_id, method, args, threaded))
        except BaseException:
            del self._calls[call_id]
            raise
        return await future

    async def call_input(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the input thread, beside the event loop and the steps; its
        result or exception.

        Only for work that reads nothing but the tokenizer and fixed limits
        (``process_prompt``, ``apply_chat_template``): a Rust tokenizer allows the
        concurrent reads of a core thread's detokenizer and the streams' decoding.
        """
        return await asyncio.get_running_loop().run_in_executor(self._input_executor, fn,
                                                                *args)

    async def add_requests(self, prompts: Sequence[ProcessedPrompt],
                           params: Sequence[SamplingParams], stream: bool,
                           prefix: str = "req", timeout: float | None = None
                           ) -> list[TrackedRequest]:
        """Queue one request per prompt, all or none; follow each with ``outputs``.

        While paused, waits for ``resume`` first. ``timeout`` (seconds from now, the pause's
        wait included) bounds each request: ``outputs`` aborts it when it passes.

        Raises:
            ServerUnavailableError, ValueError: as ``Admission.check``.
            ValueError: for any invalid prompt (nothing is queued then).
            EngineAsleepError: while the engine sleeps.
            RequestTimeoutError: when the deadline passes during a pause.
            EngineDeadError: when the core process has died.
        """
        if self._dead is not None:  # before a pause's wait: a dead core never resumes
            raise self._dead
        self.admission.check(len(prompts))
        deadline = Deadline.after(timeout)
        self.admission.num_queued += len(prompts)
        try:
            await within(deadline, self._admitting.wait())
            self.admission.check_open()  # a drain that began during the pause refuses it
            return await self._add(prompts, params, stream, prefix, deadline)
        finally:
            self.admission.num_queued -= len(prompts)

    async def _add(self, prompts: Sequence[ProcessedPrompt], params: Sequence[SamplingParams],
                   stream: bool, prefix: str, deadline: Deadline | None
                   ) -> list[TrackedRequest]:
        request_ids = [f"{prefix}-{next(self._request_ids)}" for _ in prompts]
        arrival = time.monotonic()
        tokenizer = self.engine.tokenizer
        tracked = [TrackedRequest(r, stream, arrival, deadline,
                                  StreamedOutput(r, p, sp, tokenizer) if stream else None)
                   for r, p, sp in zip(request_ids, prompts, params)]
        # Tracked before the core sees them, so a step that finishes one finds it.
        self._tracked.update((t.request_id, t) for t in tracked)
        self._update_state()
        try:
            await self.call_core("add_requests", request_ids, list(prompts), list(params),
                                 stream, on_result=self._set_engine_waiting)
        except BaseException:
            for request_id in request_ids:
                self._untrack(request_id)
            # Cancelled while the core added them: they leave after the current step.
            self._send_quietly(CoreCall(None, "abort_requests", (request_ids,)))
            self._update_state()
            raise
        return tracked

    async def outputs(self, tracked: TrackedRequest) -> AsyncIterator[RequestOutput]:
        """The outputs of a queued request: when it streams, snapshots (``finished``
        False; each carries every token that arrived since the last), then its final
        output. Leaving early (a closed stream, a cancelled task) aborts it.

        Raises:
            Exception: what ended the request (a failed step, a dead core).
        """
        finished = False
        try:
            while not finished:
                await within(tracked.deadline, tracked.ready.wait())
                tracked.ready.clear()
                output = tracked.take(self.engine.weight_version)
                if isinstance(output, BaseException):
                    raise output
                if output is not None:
                    finished = output.finished
                    yield output
        finally:
            if not finished:
                self.abort(tracked.request_id)

    async def generate(self, prompts: Sequence[ProcessedPrompt],
                       params: Sequence[SamplingParams], prefix: str = "req",
                       timeout: float | None = None) -> list[RequestOutput]:
        """Queue the prompts and return their final outputs, in order (cancelling aborts).

        Raises:
            RequestTimeoutError: when ``timeout`` seconds pass first (all are aborted).
            Exception: as ``add_requests`` and ``outputs``.
        """
        tracked = await self.add_requests(prompts, params, False, prefix, timeout)
        return list(await asyncio.gather(*(self._final(t) for t in tracked)))

    def abort(self, request_id: str) -> None:
        """Stop a request after the current step and free its blocks (without waiting)."""
        if self._untrack(request_id) is None:
            return
        self.metrics.aborted_requests.inc()
        self._send_quietly(CoreCall(None, "abort_requests", ([request_id],)))
        self._update_state()

    async def pause(self, mode: str = "abort") -> None:
        """Stop generating until ``resume``; new requests wait for it.

        ``mode`` (vLLM's): ``"abort"`` ends the requests in flight (their outputs so far,
        finish_reason "abort"); ``"wait"`` lets them finish first; ``"keep"`` freezes them
        where they are, to go on after ``resume``. Returns once no step runs.

        Raises:
            ValueError: for another mode.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r} is invalid: use one of "
                             f"{', '.join(PAUSE_MODES)}.")
        self._admitting.clear()
        if mode == "abort":
            await self._abort_all()
        elif mode == "keep":
            await self.call_core("set_frozen", True)
        else:
            await self._idle.wait()

    def resume(self) -> None:
        """Undo ``pause``: admit waiting requests and step again."""
        self._send_quietly(CoreCall(None, "set_frozen", (False,)))
        self._admitting.set()

    @property
    def is_paused(self) -> bool:
        """True between ``pause`` and ``resume``."""
        return not self._admitting.is_set()

    async def drain(self, timeout: float) -> None:
        """Shut admission for good: new requests (and those a pause held) are refused from
        now on, the tracked ones get ``timeout`` seconds to finish (a pause is lifted), and
        what is left is then aborted (outputs so far, finish_reason "abort")."""
        self.admission.draining = True
        self.resume()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            await self._abort_all()

    def _untrack(self, request_id: str) -> TrackedRequest | None:
        self.admission.engine_waiting.discard(request_id)
        return self._tracked.pop(request_id, None)

    async def _final(self, tracked: TrackedRequest) -> RequestOutput:
        async for output in self.outputs(tracked):
            if output.finished:
                return output
        raise AssertionError("unreachable: outputs() ends with a finished output")

    async def _abort_all(self) -> None:
        request_ids = list(self._tracked)
        outputs = await self.call_core("abort_requests", request_ids)
        for request_id, output in zip(request_ids, outputs):
            # None: it finished in a step whose report is on its way; that output ends it.
            tracked = self._untrack(request_id) if output is not None else None
            if tracked is not None:
                self.metrics.aborted_requests.inc()
                tracked.end(output)
        self._update_state()

    def _update_state(self) -> None:
        if self._tracked:
            self._idle.clear()
        else:
            self._idle.set()

    def _send(self, command: CoreCall) -> None:
        if self._dead is not None:
            raise self._dead
        self.core.send(command)

    def _send_quietly(self, command: CoreCall) -> None:  # a dead core needs none
        try:
            self._send(command)
        except EngineDeadError:
            pass

    def _deliver(self, message: object) -> None:  # on the core's threads
        try:
            self.loop.call_soon_threadsafe(self._receive, message)
        except RuntimeError:  # the loop is closed: the server is gone
            pass

    def _receive(self, message: object) -> None:
        if isinstance(message, StepReport):
            self.core.observe(message)
            self._dispatch(message)
        elif isinstance(message, CallResult):
            self.core.observe(message)
            self._answer(message)
        elif isinstance(message, StepFailed):
            self._fail(message.error, message.request_ids)
        elif isinstance(message, CoreDied):
            self._core_died(message.exitcode)

    def _answer(self, result: CallResult) -> None:
        future, on_result = self._calls.pop(result.call_id)
        if result.error is not None:
            if not future.done():
                future.set_exception(result.error)
            return
        if on_result is not None:
            on_result(result.value)
        if not future.done():
            future.set_result(result.value)

    def _dispatch(self, report: StepReport) -> None:
        now = time.monotonic()
        if report.waiting is not None:
            self._set_engine_waiting(report.waiting, report.started)
        for request_id, num_tokens in report.num_output_tokens.items():
            self._count_tokens(request_id, num_tokens, now)
        for request_id, deltas in report.deltas.items():
            tracked = self._tracked.get(request_id)
            if tracked is not None:
                tracked.streamed.add(deltas)
                tracked.ready.set()
        for output in report.finished:
            self._finish(output, report.started, now)
        self._update_state()

    def _set_engine_waiting(self, waiting: set[str], started: float | None = None) -> None:
        """Count the tracked requests among ``waiting``; those that left it since the last
        count were scheduled by the step that began at ``started``."""
        if started is not None:
            for request_id in self.admission.engine_waiting - waiting:
                self._mark_scheduled(request_id, started)
        # Those untracked (aborted) since the core counted are no longer ours.
        self.admission.engine_waiting = {r for r in waiting if r in self._tracked}

    def _mark_scheduled(self, request_id: str, started: float) -> None:
        tracked = self._tracked.get(request_id)
        if tracked is not None and tracked.scheduled_time is None:
            tracked.scheduled_time = started

    def _finish(self, output: RequestOutput, started: float, now: float) -> None:
        num_tokens = sum(len(c.token_ids) for c in output.outputs)
        self._count_tokens(output.request_id, num_tokens, now)
        tracked = self._untrack(output.request_id)
        if tracked is None:
            return
        # Unmarked: it finished in the very step that first scheduled it.
        scheduled = started if tracked.scheduled_time is None else tracked.scheduled_time
        self.metrics.request_finished(scheduled - tracked.arrival, now - tracked.arrival,
                                      len(output.prompt_token_ids), num_tokens)
        tracked.end(output)

    def _count_tokens(self, request_id: str, num_tokens: int, now: float) -> None:
        tracked = self._tracked.get(request_id)
        if tracked is None or num_tokens <= tracked.num_output_tokens:
            return
        self.metrics.generation_tokens.inc(num_tokens - tracked.num_output_tokens)
        if tracked.last_token_time is None:
            self.metrics.time_to_first_token.observe(now - tracked.arrival)
        else:
            self.metrics.inter_token_latency.observe(now - tracked.last_token_time)
        tracked.num_output_tokens = num_tokens
        tracked.last_token_time = now

    def _fail(self, error: BaseException, request_ids: Sequence[str]) -> None:
        # The core already aborted them.
        for request_id in request_ids:
            tracked = self._untrack(request_id)
            if tracked is not None:
                self.metrics.aborted_requests.inc()
                tracked.end(error)
        self._update_state()

    def _core_died(self, exitcode: int | None) -> None:
        self._dead = EngineDeadError(f"the engine core process died (exit code {exitcode}): "
                                     "this server can serve nothing more; restart it.")
        for future, _ in self._calls.values():
            if not future.done():
                future.set_exception(self._dead)
        self._calls.clear()
        self._fail(self._dead, list(self._tracked))
