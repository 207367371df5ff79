"""``AsyncLLMEngine``: the server's asyncio loop around one ``LLMEngine``.

Requests arrive concurrently on the event loop. One engine thread runs every engine call
(add, abort, step, sleep, ...) in order, so the event loop never blocks on a step and the
engine never has two callers at once. Prompts are tokenized on a second thread, the input
thread, so a request that arrives while a step runs is queued before the next step rather
than behind it, and joins the batch at the next step; an aborted one (its client went away)
leaves right after the current step, and its blocks go back to the pool. Weight commits
come from another thread (the weight receiver) and land between steps through the engine's
lock.

Admission is bounded (admission.py): past ``max_num_waiting`` requests accepted but not yet
running, or once ``drain`` has begun, a new request is refused and nothing accepted is ever
dropped. A request with a deadline is aborted when it passes.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..engine import LLMEngine
from ..input_processor import ProcessedPrompt
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .admission import Admission, Deadline, within
from .metrics import ServerMetrics

PAUSE_MODES = ("abort", "wait", "keep")
T = TypeVar("T")


@dataclass(slots=True)
class TrackedRequest:
    """A request the loop drives: its id, where its outputs go, its latency marks
    (``scheduled_time``: the start of the first step that scheduled it)."""

    request_id: str
    outputs: asyncio.Queue
    stream: bool
    arrival: float
    deadline: Deadline | None = None
    num_output_tokens: int = 0
    last_token_time: float | None = None
    scheduled_time: float | None = None


@dataclass(slots=True)
class _StepReport:
    """What one step did, gathered on the engine thread (``started``: when it began)."""

    started: float
    finished: list[RequestOutput]
    waiting: set[str]
    num_output_tokens: dict[str, int] = field(default_factory=dict)
    snapshots: dict[str, RequestOutput] = field(default_factory=dict)


class AsyncLLMEngine:
    """Drives an ``LLMEngine`` from asyncio: concurrent requests, streaming, abort, pause.

    Start the loop with ``start()`` inside a running event loop; ``shutdown()`` stops it.

    Args:
        engine: the engine it drives (nothing else may call it).
        metrics: the server's counters and histograms, updated as requests go.
        max_num_waiting: most requests accepted but not yet running (None: no bound).
    """

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics,
                 max_num_waiting: int | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.admission = Admission(max_num_waiting)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-engine")
        self._input_executor = ThreadPoolExecutor(max_workers=1,
                                                  thread_name_prefix="tandem-input")
        self._tracked: dict[str, TrackedRequest] = {}
        self._request_ids = itertools.count()
        self._frozen = False  # /pause?mode=keep: requests stay, steps stop
        self._snapshotted: dict[str, int] = {}  # output tokens last streamed, per request
        self._loop_task: asyncio.Task | None = None
        self._has_work = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._admitting = asyncio.Event()
        self._admitting.set()

    def start(self) -> None:
        """Start the engine loop on the running event loop."""
        self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def shutdown(self) -> None:
        """Stop the loop, abort what is left and release the engine thread."""
        if self._loop_task is not None:
            self._loop_task.cancel()
        for request_id in list(self._tracked):
            self.abort(request_id)
        self._executor.shutdown(wait=True)
        self._input_executor.shutdown(wait=True)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the engine thread, between steps; its result or exception."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def call_input(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the input thread, while steps run; its result or exception.

        Only for work that reads nothing but the tokenizer and the engine's fixed limits
        (``LLMEngine.process_prompt``, ``apply_chat_template``). The engine thread's
        detokenizer reads the same tokenizer at the same time, which a Rust tokenizer
        allows: it is changed only by settings (truncation, padding) the engine never sets.
        Waiting for the current step instead would queue the request's ``add`` behind the
        next one: a whole step later.
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
        """
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
        tracked = [TrackedRequest(r, asyncio.Queue(), stream, arrival, deadline)
                   for r in request_ids]
        # Tracked before the engine sees them, so a step that finishes one finds it.
        self._tracked.update((t.request_id, t) for t in tracked)
        try:
            waiting = await self.call(self._add_on_engine, request_ids, prompts, params)
        except BaseException:
            for request_id in request_ids:
                self._untrack(request_id)
            self._update_state()
            raise
        self._set_engine_waiting(waiting)
        self._update_state()
        return tracked

    def _add_on_engine(self, request_ids: list[str], prompts: Sequence[ProcessedPrompt],
                       params: Sequence[SamplingParams]) -> set[str]:
        self.engine.add_requests(request_ids, prompts, params)
        return self._waiting_request_ids()

    def _waiting_request_ids(self) -> set[str]:
        """The requests in the scheduler's waiting queue (a group waits as one sequence;
        sequences preempted back there count their request once)."""
        return {seq.request_id for seq in self.engine.scheduler.waiting}

    def _set_engine_waiting(self, waiting: set[str]) -> None:
        # Those untracked (aborted) while the engine thread counted are no longer ours.
        self.admission.engine_waiting = {r for r in waiting if r in self._tracked}

    async def outputs(self, tracked: TrackedRequest) -> AsyncIterator[RequestOutput]:
        """The outputs of a queued request: snapshots (``finished`` False) when it streams,
        then its final output. Leaving early (a closed stream, a cancelled task) aborts it.

        Raises:
            Exception: what the engine raised, when a step failed.
        """
        finished = False
        try:
            while not finished:
                output = await within(tracked.deadline, tracked.outputs.get())
                if isinstance(output, BaseException):
                    raise output
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
        self._executor.submit(self.engine.abort_request, request_id)
        self._update_state()

    async def pause(self, mode: str = "abort") -> None:
        """Stop generating until ``resume``; new requests wait for it.

        ``mode`` (vLLM's): ``"abort"`` ends the requests in flight (their outputs so far,
        finish_reason "abort"); ``"wait"`` lets them finish first; ``"keep"`` freezes them
        where they are, to go on after ``resume``.

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
            self._frozen = True
            self._update_state()
        await self._idle.wait() if mode == "wait" else await self.call(_nothing)

    def resume(self) -> None:
        """Undo ``pause``: admit waiting requests and step again."""
        self._frozen = False
        self._admitting.set()
        self._update_state()

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
        outputs = await self.call(lambda: [self.engine.abort_request(r) for r in request_ids])
        for request_id, output in zip(request_ids, outputs):
            # None: the engine had not seen it yet (its add was still queued); it runs on.
            tracked = self._untrack(request_id) if output is not None else None
            if tracked is not None:
                self.metrics.aborted_requests.inc()
                tracked.outputs.put_nowait(output)
        self._update_state()

    def _update_state(self) -> None:
        if self._tracked and not self._frozen:
            self._has_work.set()
        else:
            self._has_work.clear()
        if self._tracked:
            self._idle.clear()
        else:
            self._idle.set()

    async def _run(self) -> None:
        step: asyncio.Future | None = None
        while True:
            if step is None:
                await self._has_work.wait()
                step = self._start_step()
            try:
                report = await step
            except Exception as exc:  # a failed step fails its requests, not the server
                self._fail_all(exc)
                step = None
                continue
            # The next step runs on the engine thread while this one's outputs go out: the
            # engine never waits for the event loop's dispatch.
            step = self._start_step() if self._work_after(report) else None
            self._dispatch(report)

    def _start_step(self) -> asyncio.Future:
        watched = [(request_id, t.stream) for request_id, t in self._tracked.items()]
        return asyncio.ensure_future(self.call(self._step, watched))

    def _work_after(self, report: _StepReport) -> bool:
        finished = {output.request_id for output in report.finished}
        return not self._frozen and any(r not in finished for r in self._tracked)

    def _step(self, watched: list[tuple[str, bool]]) -> _StepReport:
        started = time.monotonic()
        report = _StepReport(started, self.engine.step(), self._waiting_request_ids())
        snapshotted, self._snapshotted = self._snapshotted, {}  # the engine thread's own
        for request_id, stream in watched:
            num_output_tokens = self.engine.num_output_tokens(request_id)
            if num_output_tokens is None:
                continue
            report.num_output_tokens[request_id] = num_output_tokens
            self._snapshotted[request_id] = snapshotted.get(request_id, 0)
            if stream and num_output_tokens > self._snapshotted[request_id]:
                report.snapshots[request_id] = self.engine.request_output(request_id)
                self._snapshotted[request_id] = num_output_tokens
        return report

    def _dispatch(self, report: _StepReport) -> None:
        now = time.monotonic()
        for request_id, num_tokens in report.num_output_tokens.items():
            self._count_tokens(request_id, num_tokens, now)
            if request_id not in report.waiting:
                self._mark_scheduled(request_id, report.started)
        for request_id, snapshot in report.snapshots.items():
            if request_id in self._tracked:
                self._tracked[request_id].outputs.put_nowait(snapshot)
        for output in report.finished:
            self._finish(output, report.started, now)
        self._set_engine_waiting(report.waiting)
        self._update_state()

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
        tracked.outputs.put_nowait(output)

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

    def _fail_all(self, exc: Exception) -> None:
        for request_id, tracked in list(self._tracked.items()):
            tracked.outputs.put_nowait(exc)
            self.abort(request_id)


def _nothing() -> None:
    """An engine-thread call that returns once the current step has ended."""
