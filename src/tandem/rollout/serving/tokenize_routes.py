"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: a text or a chat to the token ids a
completion of it gets, and token ids back to text.

Both go through the engine's ``InputProcessor`` (the one tokenizing place) on the input
thread, as the generating routes do: a prompt's ids are those ``/v1/completions`` queues for
it, and ``chat_prompt_ids``, which the chat route calls too, makes a chat's ids.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel

from ..input_processor import InputMethods
from .errors import error_responses
from .protocol import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest
from .state import TandemServer


class TokenizeResponse(BaseModel):
    """``/tokenize``'s answer (vLLM's): the ids, their count, the model's longest sequence,
    and with ``return_token_strs`` each id's token string (else null)."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    """``/detokenize``'s answer (vLLM's): the text of the ids."""

    prompt: str


def tokenize_routes(server: TandemServer) -> APIRouter:
    """The router of ``/tokenize`` and ``/detokenize``, answering from ``server``."""
    router = APIRouter()

    @router.post("/tokenize", responses=error_responses(404))
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        server.check_model(body.model)
        chat = body.is_chat()
        tokens, token_strs = await server.async_engine.call_input(
            _tokenized, server.engine, body, chat)
        return TokenizeResponse(count=len(tokens), max_model_len=server.engine.max_model_len,
                                tokens=tokens, token_strs=token_strs)

    @router.post("/detokenize", responses=error_responses(404))
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        server.check_model(body.model)
        text = await server.async_engine.call_input(server.engine.decode, body.tokens)
        return DetokenizeResponse(prompt=text)

    return router


def chat_prompt_ids(engine: InputMethods, body: ChatCompletionRequest | TokenizeRequest,
                    tools: list[dict[str, Any]] | None) -> list[int]:
    """The prompt ids of a chat body (its messages, ``tools`` and template options) under the
    model's chat template: what the chat route queues and ``/tokenize`` answers.

    Raises:
        ValueError: as ``InputProcessor.apply_chat_template``.
    """
    return engine.apply_chat_template(
        body.conversation(), body.add_generation_prompt, tools,
        continue_final_message=body.continue_final_message,
        add_special_tokens=body.add_special_tokens,
        chat_template_kwargs=body.chat_template_kwargs)


def _tokenized(engine: InputMethods, body: TokenizeRequest,
               chat: bool) -> tuple[list[int], list[str] | None]:
    tokens = (chat_prompt_ids(engine, body, body.template_tools()) if chat
              else engine.encode(body.prompt, body.add_special_tokens))
    if not body.return_token_strs:
        return tokens, None
    return tokens, engine.token_strings(tokens)
