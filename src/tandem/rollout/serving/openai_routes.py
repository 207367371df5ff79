"""OpenAI's routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, and the
``/health`` and ``/metrics`` probes every vLLM deployment answers."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from ..input_processor import Prompt
from .core_client import EngineDeadError
from .errors import APIError, error_responses
from .protocol import ChatCompletionRequest, CompletionRequest
from .state import TandemServer
from .tokenize_routes import chat_prompt_ids

OPENAI_DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI
# A whole answer is JSON, a streamed one server-sent events (each a ``data`` line: a chunk
# as JSON, then ``[DONE]``); refusals are OpenAI's errors.
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string"}, "event": {"type": "string"}}}
GENERATION_RESPONSES = {
    200: {"description": "The completion (JSON), or with stream its server-sent events.",
          "content": {"application/json": {}, "text/event-stream": {"schema": SSE_EVENT}}},
} | error_responses(404, 409, 503, 504)


class PrometheusResponse(PlainTextResponse):
    """Prometheus' text exposition format, as ``prometheus_client`` writes it."""

    media_type = CONTENT_TYPE_LATEST


def openai_routes(server: TandemServer) -> APIRouter:
    """The router of OpenAI's endpoints and the probes, answering from ``server``."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> dict[str, str]:
        if server.async_engine.is_dead:
            raise EngineDeadError("the engine core process died: restart this server.")
        return {"status": "ok"}

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": server.model_name, "object": "model", "created": 0, "owned_by": "tandem",
            "max_model_len": server.engine.max_model_len}]}

    @router.post("/v1/completions", responses=GENERATION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        server.check_model(body.model)
        params = server.sampling_params(body, _first_set(body.max_tokens,
                                                         OPENAI_DEFAULT_MAX_TOKENS),
                                        body.logprobs)
        prompts = await server.process_prompts(_prompt_list(body.prompts()))
        return await server.openai_response(request, body, prompts, params, chat=False)

    @router.post("/v1/chat/completions", responses=GENERATION_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        server.check_model(body.model)
        tools = body.template_tools()
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = _first_set(body.max_completion_tokens, body.max_tokens,
                                server.config.max_tokens)
        params = server.sampling_params(body, max_tokens, logprobs)
        server.async_engine.admission.check(1)  # before any work on the template
        prompt = await server.async_engine.call_input(
            chat_prompt_ids, server.engine, body, tools)
        prompts = await server.process_prompts([prompt])
        return await server.openai_response(request, body, prompts, params, chat=True,
                                            tool_calls=body.parses_tool_calls)

    @router.get("/metrics", response_class=PrometheusResponse)
    async def metrics() -> PrometheusResponse:
        return PrometheusResponse(server.metrics.render(await server.async_engine.call("stats")))

    return router


def _prompt_list(prompts: list[Prompt]) -> list[Prompt]:
    if not prompts:
        raise APIError(400, "no prompt given.", param="prompt")
    return prompts


def _first_set(*values: int | None) -> int:
    """The first value given (0 included: it is refused later, as OpenAI refuses it,
    unless a completion echoes its prompt)."""
    return next(value for value in values if value is not None)
