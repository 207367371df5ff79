"""``TandemServer``: the state every route shares (the engine, its asyncio loop, limits,
the response builder, the weight transfer), the checks they share, and answering as OpenAI
(one JSON body, or server-sent events).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import replace
from datetime import timedelta
from typing import Any, TypeVar

import torch
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tandem.kernels.cpu_threads import cpus_to_bind, release_team

from ..config import EngineConfig
from ..engine import LLMEngine
from ..input_processor import ProcessedPrompt, Prompt
from ..outputs import CompletionOutput, RequestOutput
from ..sampling_params import SamplingParams
from ..tool_calls import ToolCallParser
from .async_engine import AsyncLLMEngine, TrackedRequest
from .config import ServerConfig
from .core_client import open_core
from .errors import APIError, stream_error
from .metrics import ServerMetrics
from .protocol import SamplingRequest
from .responses import (
    ChoiceForm,
    DeltaTracker,
    ResponseBuilder,
    json_safe,
    nothing_generated,
    sse_event,
    usage,
)
from .weight_transfer import WeightTransfer

T = TypeVar("T")
WAITING_PER_SEQ = 16  # the default max_num_waiting, in multiples of max_num_seqs


class TandemServer:
    """The routes' shared state: the engine and its loop, limits, response builder, weight
    transfer.

    ``engine`` is what the routes read of the engine: the ``LLMEngine`` itself when the
    core runs on a thread, its ``EngineMirror`` when the core has a process of its own.

    Args:
        engine: the engine to serve, driven by a core on a thread of this process (this
            server drives it, through ``async_engine``; nothing else should), or the
            configuration of one to build, where ``config.engine_core`` says.
        config: listening, safety and limits.

    Raises:
        Exception: what building the engine raised.
    """

    def __init__(self, engine: LLMEngine | EngineConfig, config: ServerConfig) -> None:
        core = open_core(engine, config.engine_core, config.api_nice)
        self.engine = engine = core.engine
        self.config = config
        self.model_name = config.served_model_name or str(engine.config.model)
        self.max_prompt_tokens = config.max_prompt_tokens or engine.max_model_len - 1
        self.metrics = ServerMetrics(self.model_name, engine.max_model_len)
        self.async_engine = AsyncLLMEngine(
            core, self.metrics,
            config.max_num_waiting or WAITING_PER_SEQ * engine.config.max_num_seqs)
        binds = engine.config.torch_device.type == "cpu" or config.cpu_threads_bind != "auto"
        self.bound_cpus = (cpus_to_bind(config.cpu_threads_bind, torch.get_num_threads())
                           if binds else None)
        self.responses = ResponseBuilder(engine.tokenizer, self.model_name)
        self.weight_transfer = WeightTransfer(
            self.async_engine, timedelta(seconds=config.weight_transfer_timeout),
            self.metrics.weight_sync_seconds)

    async def start(self) -> None:
        """Start the engine core (a core process's server then lowers its priority: see
        ``api_nice``); on CPU, leave the core's OpenMP team the only one (``release_team``
        on this thread, the event loop's, and on the input thread); pin the core's threads
        to ``bound_cpus`` (when there are any: see ``cpu_threads_bind``);
        freeze the objects alive now out of the garbage collector's reach (``gc.freeze``,
        as vLLM's server does: the model's and the libraries' hundreds of thousands,
        traversed by every collection the steps trigger, cost about 5% of a CPU decode
        step; a core process freezes its own).

        Raises:
            ValueError, RuntimeError: as ``bind_threads``.
        """
        self.async_engine.start()
        if self.engine.config.torch_device.type == "cpu":
            release_team()
            await self.async_engine.call_input(release_team)
        if self.bound_cpus is not None:
            await self.async_engine.call_core("bind_threads", self.bound_cpus)
        gc.collect()
        gc.freeze()

    async def shutdown(self) -> None:
        """Stop the engine core (``AsyncLLMEngine.shutdown``) and give the objects ``start``
        froze back to the garbage collector."""
        await self.async_engine.shutdown()
        gc.unfreeze()

    def check_model(self, model: str | None) -> None:
        """Refuse a request for another model (404, as OpenAI)."""
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist: this server serves "
                           f"{self.model_name!r}.", param="model", code="model_not_found")

    def check_limits(self, params: SamplingParams) -> None:
        """Refuse parameters over the server's limits (400 naming the limit)."""
        for name, value, limit, flag in (
                ("n", params.n, self.config.max_n, "--max-n"),
                ("max_tokens", params.max_tokens, self.config.max_tokens, "--max-tokens"),
                ("logprobs", params.logprobs or 0, self.config.max_logprobs,
                 "--max-logprobs"),
                ("prompt_logprobs", params.prompt_logprobs or 0, self.config.max_logprobs,
                 "--max-logprobs")):
            if value > limit:
                raise APIError(400, f"{name}={value} exceeds this server's limit of {limit} "
                               f"({flag}).", param=name)

    async def process_prompts(self, prompts: list[Prompt]) -> list[ProcessedPrompt]:
        """Every prompt tokenized once (on the input thread) and checked, refusing one
        over ``max_prompt_tokens``; an overloaded or draining server refuses them first,
        before spending any work on them.

        Raises:
            ServerUnavailableError: as ``Admission.check``.
            APIError: for a prompt over the limit.
            ValueError: for a prompt the engine refuses, or more than ``max_num_waiting``.
        """
        self.async_engine.admission.check(len(prompts))
        processed = await self.async_engine.call_input(
            lambda: [self.engine.process_prompt(prompt) for prompt in prompts])
        for ids in (p.prompt_token_ids for p in processed):
            if len(ids) > self.max_prompt_tokens:
                raise APIError(400, f"the prompt has {len(ids)} tokens, over this server's "
                               f"limit of {self.max_prompt_tokens} (--max-prompt-tokens or "
                               "max_model_len): shorten it.", param="prompt",
                               code="context_length_exceeded")
        return processed

    def sampling_params(self, body: SamplingRequest, max_tokens: int,
                        logprobs: int | None) -> SamplingParams:
        """The request's validated ``SamplingParams`` within the limits."""
        params = body.sampling_params(max_tokens, logprobs)
        self.check_limits(params)
        return params

    def timeout(self, requested: float | None) -> float | None:
        """A request's deadline in seconds: the smaller of ``request_timeout`` and the
        request's own ``timeout`` (None: neither is set)."""
        given = [t for t in (self.config.request_timeout, requested) if t is not None]
        return min(given, default=None)

    async def generate(self, request: Request, prompts: list[ProcessedPrompt],
                       params: list[SamplingParams], prefix: str,
                       timeout: float | None) -> list[RequestOutput]:
        """The prompts' final outputs, unless the client goes away (all aborted).

        Raises:
            RequestTimeoutError: when ``self.timeout(timeout)`` passes first (all aborted).
            APIError: 499 when the client went away.
        """
        return await until_disconnected(request, self.async_engine.generate(
            prompts, params, prefix, self.timeout(timeout)))

    async def openai_response(self, request: Request, body: SamplingRequest,
                              prompts: list[ProcessedPrompt], params: SamplingParams,
                              chat: bool, tool_calls: bool = False) -> Response:
        """Generate and answer as OpenAI: one JSON body, or server-sent events, the choices
        written as the body's ``choice_form`` says (echo, token names). With ``tool_calls``
        each chat completion's text is parsed into content and tool calls."""
        prefix = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        form = body.choice_form(params)
        if body.stream:
            tracked = await self.async_engine.add_requests(
                prompts, [params] * len(prompts), True, prefix, self.timeout(body.timeout))
            return StreamingResponse(
                self._events(body, tracked, params, form, prefix, chat, tool_calls),
                media_type="text/event-stream")
        outputs = await self.generate(request, prompts, [params] * len(prompts), prefix,
                                      body.timeout)
        if form.prompt_only:
            outputs = [nothing_generated(output) for output in outputs]
        choices = [choice for i, output in enumerate(outputs) for choice in self._choices(
            output, i * params.n, params, form, chat, tool_calls)]
        envelope = self.responses.envelope(
            prefix, "chat.completion" if chat else "text_completion", int(time.time()),
            choices, max(o.weight_version for o in outputs))
        if chat and body.return_token_ids:
            envelope["prompt_token_ids"] = outputs[0].prompt_token_ids
        if chat and params.prompt_logprobs is not None:  # vLLM's: beside the choices
            envelope["prompt_logprobs"] = self.responses.prompt_logprobs(
                outputs[0], params.prompt_logprobs)
        return JSONResponse(json_safe(envelope | {"usage": usage(outputs)}))

    def _choices(self, output: RequestOutput, offset: int, params: SamplingParams,
                 form: ChoiceForm, chat: bool, tool_calls: bool) -> list[dict[str, Any]]:
        """The whole answer's choices of one prompt (its completions', numbered from
        ``offset``); a completion choice carries the prompt's log-probs when scored."""
        if chat:
            return [self.responses.chat_choice(offset + completion.index, completion, False,
                                               form, ToolCallParser() if tool_calls else None)
                    for completion in output.outputs]
        prompt_logprobs = self.responses.prompt_logprobs(output, params.prompt_logprobs or 0)
        return [self.responses.completion_choice(offset + completion.index, output, completion,
                                                 form, form.echo,
                                                 prompt_logprobs=prompt_logprobs)
                for completion in output.outputs]

    def _streamed_choice(self, output: RequestOutput, delta: CompletionOutput, offset: int,
                         form: ChoiceForm, sent: dict[int, int],
                         parser: ToolCallParser | None, chat: bool) -> dict[str, Any]:
        """The choice of one streamed delta; ``sent`` holds, per completion, the characters
        of its text already sent (a completion's first chunk echoes the prompt)."""
        index = offset + delta.index
        if chat:
            return self.responses.chat_choice(index, delta, True, form, parser)
        choice = self.responses.completion_choice(
            index, output, delta, form, form.echo and delta.index not in sent,
            text_offset=sent.get(delta.index, 0))
        sent[delta.index] = sent.get(delta.index, 0) + len(choice["text"])
        return choice

    async def _streamed(self, tracked: TrackedRequest, params: SamplingParams,
                        form: ChoiceForm) -> AsyncIterator[RequestOutput]:
        """A streamed request's outputs as its chunks show them: nothing generated for
        ``form.prompt_only``; when the prompt is echoed with log-probs, its log-probs
        (a snapshot carries none: they are asked of the engine once, after the prefill)."""
        prompt_logprobs = None
        async for output in self.async_engine.outputs(tracked):
            if form.echo and params.prompt_logprobs is not None and not output.finished:
                prompt_logprobs = prompt_logprobs or await self._prompt_logprobs(
                    tracked.request_id)
                if prompt_logprobs is None:
                    continue  # it finished meanwhile: its final output carries them
                output = replace(output, prompt_logprobs=prompt_logprobs)
            yield nothing_generated(output) if form.prompt_only else output

    async def _prompt_logprobs(self, request_id: str) -> list | None:
        """A running request's prompt log-probs (None once it finished)."""
        try:
            return (await self.async_engine.call("request_output", request_id)).prompt_logprobs
        except KeyError:
            return None

    def _opening(self, prefix: str, created: int, n: int, delta: dict[str, str]) -> str:
        """A chat stream's chunk giving each of its ``n`` choices ``delta``."""
        return sse_event(self.responses.envelope(prefix, "chat.completion.chunk", created, [
            {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
            for i in range(n)], self.engine.weight_version))

    async def _events(self, body: SamplingRequest, tracked: list[TrackedRequest],
                      params: SamplingParams, form: ChoiceForm, prefix: str, chat: bool,
                      tool_calls: bool) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())
        finals: list[RequestOutput] = []
        try:
            if chat:
                yield self._opening(prefix, created, params.n,
                                    {"role": "assistant", "content": ""})
                if form.chat_echo:  # vLLM's: the echoed text in a chunk of its own
                    yield self._opening(prefix, created, params.n, {"content": form.chat_echo})
            hold_back = max((len(stop) for stop in params.stop), default=1) - 1
            for i, tracked_request in enumerate(tracked):
                deltas = DeltaTracker(hold_back)
                parsers = collections.defaultdict(ToolCallParser)
                sent: dict[int, int] = {}
                async for output in self._streamed(tracked_request, params, form):
                    for delta in deltas.deltas(output):
                        choice = self._streamed_choice(
                            output, delta, i * params.n, form, sent,
                            parsers[delta.index] if tool_calls else None, chat)
                        yield sse_event(self.responses.envelope(prefix, obj, created, [choice],
                                                             output.weight_version))
                    if output.finished:
                        finals.append(output)
            if body.include_usage:
                yield sse_event(self.responses.envelope(prefix, obj, created, [], max(
                    o.weight_version for o in finals)) | {"usage": usage(finals)})
        except Exception as exc:  # the stream has begun: report in it, as vLLM does
            yield sse_event(stream_error(exc))
        finally:
            for tracked_request in tracked:
                self.async_engine.abort(tracked_request.request_id)
        yield "data: [DONE]\n\n"


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client goes away first; then cancel it (which aborts its
    requests) and raise ``APIError`` 499 (nobody reads it)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        raise APIError(499, "the client closed the connection; its requests were aborted.")
    return task.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
