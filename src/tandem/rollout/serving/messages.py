"""Chat messages as OpenAI types them, and as the chat template reads them.

A message is one of ``SystemMessage`` (role ``system`` or ``developer``), ``UserMessage``,
``AssistantMessage`` (optional content, optional ``tool_calls``) and ``ToolMessage``, told
apart by ``role``; content is a string or a list of text parts. Every model keeps the
fields it does not declare (``extra="allow"``), so whatever a client sends reaches the chat
template as it was sent; ``templated`` then renders each message as the server always has:
the content as plain text (text parts joined), the arguments of each assistant tool call,
a JSON string in OpenAI's shape, as the object they encode (as vLLM passes them).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .errors import APIError

# Undeclared fields are kept, so they reach the chat template as the client sent them.
PASS_THROUGH = ConfigDict(extra="allow")


class TextContentPart(BaseModel):
    """A text part of a message's content: ``{"type": "text", "text": "..."}``."""

    model_config = PASS_THROUGH

    type: Literal["text"]
    text: str


Content = str | list[TextContentPart]


class FunctionCall(BaseModel):
    """The function an assistant called: its name and arguments (OpenAI's JSON string; an
    object is passed on as it is)."""

    model_config = PASS_THROUGH

    name: str
    arguments: str | dict[str, Any]


class ToolCall(BaseModel):
    """One of an assistant message's ``tool_calls``."""

    model_config = PASS_THROUGH

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(BaseModel):
    """Instructions: role ``system`` (or OpenAI's newer name for it, ``developer``)."""

    model_config = PASS_THROUGH

    role: Literal["system", "developer"]
    content: Content
    name: str | None = None


class UserMessage(BaseModel):
    """What the user said."""

    model_config = PASS_THROUGH

    role: Literal["user"]
    content: Content
    name: str | None = None


class AssistantMessage(BaseModel):
    """A model turn: its text (none when it only called tools) and its tool calls."""

    model_config = PASS_THROUGH

    role: Literal["assistant"]
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None


class ToolMessage(BaseModel):
    """A tool's result, answering the tool call ``tool_call_id``."""

    model_config = PASS_THROUGH

    role: Literal["tool"]
    content: Content
    tool_call_id: str | None = None


ChatMessage = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage,
                        Field(discriminator="role")]


def templated(message: BaseModel) -> dict[str, Any]:
    """``message`` as the chat template reads it: the fields the client sent, the content
    as text, each tool call's arguments decoded.

    Raises:
        APIError: for tool-call arguments that are not JSON.
    """
    sent = message.model_dump(exclude_unset=True)
    rendered = {**sent, "content": _text_of(sent.get("content"))}
    if isinstance(sent.get("tool_calls"), list):
        rendered["tool_calls"] = [_arguments_decoded(call) for call in sent["tool_calls"]]
    return rendered


def _arguments_decoded(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    if not isinstance(function["arguments"], str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError as exc:
        raise APIError(400, f"the arguments of a tool call in messages are not JSON ({exc}): "
                       f"{function['arguments']!r}.", param="messages") from exc
    return {**call, "function": {**function, "arguments": arguments}}


def _text_of(content: str | list[dict[str, Any]] | None) -> str:
    if isinstance(content, list):
        return "".join(part["text"] for part in content)
    return "" if content is None else content
