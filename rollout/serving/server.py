"""``tandem serve``: an OpenAI-compatible HTTP server with RL and weight-transfer endpoints.

The only module that imports FastAPI and uvicorn (the ``serve`` extra). Routes:
``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``,
``/v1/rollouts`` (Tandem's: ``LLM.generate``'s shapes over HTTP), ``/reset_prefix_cache``,
``/sleep``, ``/wake_up``, ``/is_sleeping``, ``/pause``, ``/resume``, ``/is_paused``,
``/server_info``, ``/get_world_size`` and, with ``enable_weight_transfer``,
``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict
from datetime import timedelta
from typing import Any, TypeVar

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.sync import WeightUpdateError

from ..engine import LLMEngine
from ..errors import EngineAsleepError
from ..input_processor import ProcessedPrompt
from ..llm import as_prompt_list, params_per_prompt
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .async_engine import AsyncLLMEngine, TrackedRequest
from .config import ServerConfig
from .metrics import CONTENT_TYPE, ServerMetrics
from .openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DeltaTracker,
    ResponseBuilder,
    SamplingRequest,
    error_body,
    usage,
)
from .weight_transfer import WeightTransfer, WeightTransferStateError

T = TypeVar("T")
OPENAI_DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI


class APIError(Exception):
    """A request the server refuses, answered with ``status`` and OpenAI's error body."""

    def __init__(self, status: int, message: str, error_type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = error_body(message, error_type, param, code)


class GuardMiddleware:
    """Refuses a request before routing: no or a wrong API key (401; /health is open) or
    a body over the limit (413). It reads the (bounded) body itself and replays it."""

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        """Check one HTTP request, then pass it on with its body replayed."""
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["path"] != "/health" and not self._authorized(scope):
            return await _send_error(send, APIError(
                401, "missing or wrong API key: send 'Authorization: Bearer <key>' with the "
                "key the server was started with (--api-key).", code="invalid_api_key"))
        body = await self._read_body(scope, receive)
        if body is None:
            return await _send_error(send, APIError(
                413, f"the request body exceeds {self.max_body_bytes} bytes "
                "(--max-body-bytes).", code="request_too_large"))
        replay = [{"type": "http.request", "body": body, "more_body": False}]

        async def replay_receive() -> dict:
            return replay.pop() if replay else await receive()

        await self.app(scope, replay_receive, send)

    def _authorized(self, scope: dict) -> bool:
        if self.expected is None:
            return True
        given = dict(scope["headers"]).get(b"authorization", b"")
        return hmac.compare_digest(given, self.expected)

    async def _read_body(self, scope: dict, receive: Callable) -> bytes | None:
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return None
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                return None
            more = message.get("more_body", False)
        return bytes(body)


async def _send_error(send: Callable, error: APIError) -> None:
    payload = json.dumps(error.body).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(payload)).encode())]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


class RolloutRequest(BaseModel):
    """``POST /v1/rollouts``: ``LLM.generate``'s arguments as JSON.

    ``prompts`` is one prompt (text or token ids) or a list; ``sampling_params`` holds
    ``SamplingParams`` fields, one object for all prompts or one each.
    """

    prompts: str | list[Any]
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None


class InitInfo(BaseModel):
    """vLLM's ``init_info``: the trainer's store (rank 0) and this engine's rank."""

    master_address: str
    master_port: int
    rank_offset: int = 1
    world_size: int = 2


class InitWeightTransferRequest(BaseModel):
    """``POST /init_weight_transfer_engine``."""

    init_info: InitInfo


class StartWeightUpdateRequest(BaseModel):
    """``POST /start_weight_update`` (vLLM's field; only checkpoint-format names)."""

    is_checkpoint_format: bool = True


class UpdateInfo(BaseModel):
    """vLLM's ``update_info``: the names, dtypes and shapes the trainer is about to send."""

    names: list[str] | None = None
    dtype_names: list[str] | None = None
    shapes: list[list[int]] | None = None

    def expected(self) -> list[tuple[str, str, tuple[int, ...]]] | None:
        """``(name, dtype, shape)`` per tensor, or None when nothing was announced.

        Raises:
            APIError: when the three lists are partly given or differ in length.
        """
        fields = (self.names, self.dtype_names, self.shapes)
        if all(f is None for f in fields):
            return None
        if any(f is None for f in fields) or len({len(f) for f in fields}) != 1:
            raise APIError(400, "update_info needs names, dtype_names and shapes of the same "
                           "length (or none of them).", param="update_info")
        return [(n, d, tuple(s)) for n, d, s in zip(*fields)]


class UpdateWeightsRequest(BaseModel):
    """``POST /update_weights``."""

    update_info: UpdateInfo = UpdateInfo()


class TandemServer:
    """The routes' shared state: the engine loop, limits, response builder, weight transfer.

    Args:
        engine: the engine to serve (this server drives it; nothing else should).
        config: listening, safety and limits.
    """

    def __init__(self, engine: LLMEngine, config: ServerConfig) -> None:
        self.llm_engine = engine
        self.config = config
        self.model_name = config.served_model_name or str(engine.config.model)
        self.max_prompt_tokens = config.max_prompt_tokens or engine.max_model_len - 1
        self.metrics = ServerMetrics(self.model_name)
        self.engine = AsyncLLMEngine(engine, self.metrics)
        self.responses = ResponseBuilder(engine.tokenizer, self.model_name)
        self.weight_transfer = WeightTransfer(
            engine, timedelta(seconds=config.weight_transfer_timeout),
            self.metrics.weight_sync_seconds)

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
                 "--max-logprobs")):
            if value > limit:
                raise APIError(400, f"{name}={value} exceeds this server's limit of {limit} "
                               f"({flag}).", param=name)

    def process_prompts(self, prompts: list[str | list[int]]) -> list[ProcessedPrompt]:
        """Every prompt tokenized once and checked, refusing one over ``max_prompt_tokens``
        (run on the engine thread).

        Raises:
            APIError: for a prompt over the limit.
            ValueError: for a prompt the engine refuses.
        """
        processed = [self.llm_engine.process_prompt(prompt) for prompt in prompts]
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

    async def openai_response(self, request: Request, body: SamplingRequest,
                              prompts: list[ProcessedPrompt], params: SamplingParams,
                              chat: bool) -> Response:
        """Generate and answer as OpenAI: one JSON body, or server-sent events."""
        prefix = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if body.stream:
            tracked = await self.engine.add_requests(prompts, [params] * len(prompts), True,
                                                     prefix)
            return StreamingResponse(self._events(body, tracked, params, prefix, chat),
                                     media_type="text/event-stream")
        outputs = await until_disconnected(
            request, self.engine.generate(prompts, [params] * len(prompts), prefix))
        choices = [self._choice(body, output, completion, i * params.n, chat, stream=False)
                   for i, output in enumerate(outputs) for completion in output.outputs]
        envelope = self.responses.envelope(
            prefix, "chat.completion" if chat else "text_completion", int(time.time()),
            choices, max(o.weight_version for o in outputs))
        if chat and body.return_token_ids:
            envelope["prompt_token_ids"] = outputs[0].prompt_token_ids
        return JSONResponse(envelope | {"usage": usage(outputs)})

    def _choice(self, body: SamplingRequest, output: RequestOutput, completion: Any,
                offset: int, chat: bool, stream: bool) -> dict[str, Any]:
        index = offset + completion.index
        if chat:
            return self.responses.chat_choice(index, completion, stream, body.return_token_ids)
        return self.responses.completion_choice(index, completion, output.prompt_token_ids,
                                                body.return_token_ids)

    async def _events(self, body: SamplingRequest, tracked: list[TrackedRequest],
                      params: SamplingParams, prefix: str, chat: bool) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())
        finals: list[RequestOutput] = []
        try:
            if chat:
                yield _event(self.responses.envelope(prefix, obj, created, [
                    {"index": i, "delta": {"role": "assistant", "content": ""},
                     "logprobs": None, "finish_reason": None} for i in range(params.n)],
                    self.llm_engine.weight_version))
            hold_back = max((len(stop) for stop in params.stop), default=1) - 1
            for i, request in enumerate(tracked):
                deltas = DeltaTracker(hold_back)
                async for output in self.engine.outputs(request):
                    for delta in deltas.deltas(output):
                        choice = self._choice(body, output, delta, i * params.n, chat, True)
                        yield _event(self.responses.envelope(prefix, obj, created, [choice],
                                                             output.weight_version))
                    if output.finished:
                        finals.append(output)
            if body.include_usage:
                yield _event(self.responses.envelope(prefix, obj, created, [], max(
                    o.weight_version for o in finals)) | {"usage": usage(finals)})
            yield "data: [DONE]\n\n"
        except Exception as exc:  # the stream has begun: report in it, as vLLM does
            yield _event(error_body(str(exc), "internal_server_error", code=500))
        finally:
            for request in tracked:
                self.engine.abort(request.request_id)


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


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


def build_app(engine: LLMEngine, config: ServerConfig) -> FastAPI:
    """The FastAPI application serving ``engine`` (start with uvicorn, or ``serve``)."""
    server = TandemServer(engine, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.engine.start()
        yield
        await server.engine.shutdown()

    app = FastAPI(title="Tandem", lifespan=lifespan)
    app.state.server = server
    app.add_middleware(GuardMiddleware, api_key=config.api_key,
                       max_body_bytes=config.max_body_bytes)
    _add_error_handlers(app)
    app.include_router(_openai_routes(server))
    app.include_router(_rl_routes(server))
    app.include_router(_weight_transfer_routes(server))
    return app


def _add_error_handlers(app: FastAPI) -> None:
    def answer(status: int, message: str, error_type: str = "invalid_request_error",
               param: str | None = None) -> JSONResponse:
        return JSONResponse(error_body(message, error_type, param), status_code=status)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body, status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        error = exc.errors()[0]
        if error["type"] == "json_invalid":
            return answer(400, f"the body is not valid JSON: "
                          f"{error.get('ctx', {}).get('error', error['msg'])}")
        param = ".".join(str(part) for part in error["loc"][1:]) or None
        return answer(400, f"{param or 'body'}: {error['msg']}", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return answer(exc.status_code, str(exc.detail))

    @app.exception_handler(ValueError)
    async def value_error(_: Request, exc: ValueError) -> JSONResponse:
        return answer(400, str(exc))

    @app.exception_handler(WeightUpdateError)
    async def weight_update_error(_: Request, exc: WeightUpdateError) -> JSONResponse:
        return answer(400, str(exc), "weight_update_error")

    async def conflict(_: Request, exc: Exception) -> JSONResponse:
        return answer(409, str(exc), "conflict")

    async def internal(_: Request, exc: Exception) -> JSONResponse:
        return answer(500, f"internal error: {exc!r}", "internal_server_error")

    for state_error in (EngineAsleepError, WeightTransferStateError):
        app.add_exception_handler(state_error, conflict)
    app.add_exception_handler(Exception, internal)


def _openai_routes(server: TandemServer) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": server.model_name, "object": "model", "created": 0, "owned_by": "tandem",
            "max_model_len": server.llm_engine.max_model_len}]}

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        server.check_model(body.model)
        if body.echo or body.suffix:
            raise APIError(400, "echo and suffix are not supported.",
                           param="echo" if body.echo else "suffix")
        params = server.sampling_params(body, body.max_tokens or OPENAI_DEFAULT_MAX_TOKENS,
                                        body.logprobs)
        prompts = await server.engine.call(server.process_prompts, _prompt_list(body.prompts()))
        return await server.openai_response(request, body, prompts, params, chat=False)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        server.check_model(body.model)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens or body.max_tokens or server.config.max_tokens
        params = server.sampling_params(body, max_tokens, logprobs)
        prompt = await server.engine.call(server.llm_engine.apply_chat_template,
                                          body.conversation(), body.add_generation_prompt)
        prompts = await server.engine.call(server.process_prompts, [prompt])
        return await server.openai_response(request, body, prompts, params, chat=True)

    @router.get("/metrics")
    async def metrics() -> Response:
        stats = await server.engine.call(server.llm_engine.stats)
        return PlainTextResponse(server.metrics.render(stats), media_type=CONTENT_TYPE)

    return router


def _prompt_list(prompts: list[str | list[int]]) -> list[str | list[int]]:
    if not prompts:
        raise APIError(400, "no prompt given.", param="prompt")
    return prompts


def _rl_routes(server: TandemServer) -> APIRouter:
    router = APIRouter()
    engine = server.engine

    @router.post("/v1/rollouts")
    async def rollouts(body: RolloutRequest, request: Request) -> dict[str, Any]:
        prompts = as_prompt_list(body.prompts)
        params = params_per_prompt(_sampling_params(body.sampling_params), len(prompts))
        for p in params:
            server.check_limits(p)
        processed = await engine.call(server.process_prompts, prompts)
        outputs = await until_disconnected(request, engine.generate(processed, params,
                                                                    "rollout"))
        return {"outputs": [o.to_dict() for o in outputs],
                "weight_version": server.llm_engine.weight_version}

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, Any]:
        await engine.call(server.llm_engine.reset_prefix_cache)
        return {}

    @router.post("/sleep")
    async def sleep(level: int = 1) -> dict[str, Any]:
        await engine.call(server.llm_engine.sleep, level)
        return {}

    @router.post("/wake_up")
    async def wake_up(request: Request) -> dict[str, Any]:
        await engine.call(server.llm_engine.wake_up, request.query_params.getlist("tags") or None)
        return {}

    @router.get("/is_sleeping")
    async def is_sleeping() -> dict[str, Any]:
        return {"is_sleeping": server.llm_engine.sleep_level > 0}

    @router.post("/pause")
    async def pause(mode: str = "abort") -> dict[str, Any]:
        await engine.pause(mode)
        return {}

    @router.post("/resume")
    async def resume() -> dict[str, Any]:
        engine.resume()
        return {}

    @router.get("/is_paused")
    async def is_paused() -> dict[str, Any]:
        return {"is_paused": engine.is_paused}

    @router.get("/server_info")
    async def server_info() -> dict[str, Any]:
        engine_config = {k: str(v) if not isinstance(v, int | float | bool | None) else v
                         for k, v in asdict(server.llm_engine.config).items()}
        return {"model": server.model_name, "max_model_len": server.llm_engine.max_model_len,
                "weight_version": server.llm_engine.weight_version, "world_size": 1,
                "engine_config": engine_config,
                "server_config": asdict(server.config) | {"api_key": None}}

    @router.get("/get_world_size")
    async def get_world_size() -> dict[str, Any]:
        return {"world_size": 1}

    return router


def _sampling_params(fields: dict[str, Any] | list[dict[str, Any]] | None
                     ) -> SamplingParams | list[SamplingParams] | None:
    if fields is None:
        return None
    if isinstance(fields, list):
        return [_sampling_params(f) for f in fields]
    try:
        return SamplingParams(**fields)
    except TypeError as exc:
        raise APIError(400, f"sampling_params: {exc}", param="sampling_params") from exc


def _weight_transfer_routes(server: TandemServer) -> APIRouter:
    def enabled() -> None:
        if not server.config.enable_weight_transfer:
            raise APIError(403, "weight transfer is disabled on this server: start it with "
                           "--enable-weight-transfer.", code="weight_transfer_disabled")

    router = APIRouter(dependencies=[Depends(enabled)])
    transfer = server.weight_transfer

    @router.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(body: InitWeightTransferRequest) -> dict[str, Any]:
        info = body.init_info
        await transfer.init(info.master_address, info.master_port, info.rank_offset,
                            info.world_size)
        return {"message": "weight transfer initialised"}

    @router.post("/start_weight_update")
    async def start_weight_update(body: StartWeightUpdateRequest | None = None
                                  ) -> dict[str, Any]:
        if body is not None and not body.is_checkpoint_format:
            raise APIError(400, "only checkpoint-format (Hugging Face) names are taken: send "
                           "is_checkpoint_format true.", param="is_checkpoint_format")
        transfer.start()
        return {"weight_version": server.llm_engine.weight_version}

    @router.post("/update_weights")
    async def update_weights(body: UpdateWeightsRequest | None = None) -> dict[str, Any]:
        expected = None if body is None else body.update_info.expected()
        return {"weight_version": await transfer.update(expected)}

    @router.post("/finish_weight_update")
    async def finish_weight_update() -> dict[str, Any]:
        return {"weight_version": transfer.finish()}

    return router


def serve(engine: LLMEngine, config: ServerConfig) -> None:
    """Serve ``engine`` until interrupted (uvicorn on ``config.host:config.port``)."""
    uvicorn.run(build_app(engine, config), host=config.host, port=config.port,
                log_level="info", timeout_graceful_shutdown=5)
