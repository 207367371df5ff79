"""Tool calls in a completion's text, in the Hermes/Qwen format that Qwen's chat templates
teach: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

The one parser of them: the server answers OpenAI's ``tool_calls`` with it and the trainers'
``ToolEnvironment`` runs what it finds. ``ToolCallParser`` cuts a text as it grows (a
stream) into content and calls; ``parse_tool_calls`` cuts a whole text. A block whose JSON
is not an object with a string ``name`` and an object ``arguments`` (absent: ``{}``) is a
``MalformedToolCall`` and stays in the content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"


@dataclass(slots=True)
class ToolCall:
    """A well-formed call: the function's name and its arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass(slots=True)
class MalformedToolCall:
    """A call block that does not parse: its whole text (tags included) and why not."""

    text: str
    error: str


@dataclass(slots=True)
class ParsedText:
    """A text cut at its calls.

    Attributes:
        content: the text outside the well-formed calls (a malformed block stays in it).
        calls: every call block, in order, well-formed or not.
    """

    content: str
    calls: list[ToolCall | MalformedToolCall] = field(default_factory=list)

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The well-formed calls, in order."""
        return [call for call in self.calls if isinstance(call, ToolCall)]


@dataclass(slots=True)
class ToolCallParser:
    """Cuts one completion's text, fed as it grows, into content and calls.

    Text that may still become a call (an open ``<tool_call>`` block, or a tail that begins
    ``<tool_call>``) waits in ``pending`` until it is settled, so no part of a call's tags
    is ever given as content.
    """

    pending: str = ""
    num_tool_calls: int = 0

    def feed(self, delta: str, final: bool = False) -> ParsedText:
        """Add ``delta`` and return what it settled: the content before the next possible
        call and every block closed since the last feed. With ``final`` (the text is
        complete) whatever waits is content, an unclosed block included."""
        text = self.pending + delta
        content, calls = [], []
        while (block := _next_block(text)) is not None:
            start, end = block
            call = _parse_block(text[start:end])
            content.append(text[:start] + (call.text if isinstance(call, MalformedToolCall)
                                           else ""))
            calls.append(call)
            text = text[end:]
        settled = len(text) if final else _settled_length(text)
        content.append(text[:settled])
        self.pending = text[settled:]
        parsed = ParsedText("".join(content), calls)
        self.num_tool_calls += len(parsed.tool_calls)
        return parsed


def parse_tool_calls(text: str) -> ParsedText:
    """A whole text cut into content and calls."""
    return ToolCallParser().feed(text, final=True)


def _next_block(text: str) -> tuple[int, int] | None:
    """Where the first closed call block of ``text`` starts and ends, if there is one."""
    start = text.find(TOOL_CALL_START)
    end = text.find(TOOL_CALL_END, start + len(TOOL_CALL_START)) if start >= 0 else -1
    return None if end < 0 else (start, end + len(TOOL_CALL_END))


def _settled_length(text: str) -> int:
    """How much of ``text`` (holding no closed block) cannot become part of a call."""
    start = text.find(TOOL_CALL_START)
    if start >= 0:
        return start
    for length in range(min(len(TOOL_CALL_START) - 1, len(text)), 0, -1):
        if text.endswith(TOOL_CALL_START[:length]):
            return len(text) - length
    return len(text)


def _parse_block(block: str) -> ToolCall | MalformedToolCall:
    try:
        call = json.loads(block[len(TOOL_CALL_START):-len(TOOL_CALL_END)])
    except ValueError as exc:
        return MalformedToolCall(block, f"not JSON ({exc})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return MalformedToolCall(block, "not a JSON object with a string name")
    arguments = call.get("arguments", {})
    if not isinstance(arguments, dict):
        return MalformedToolCall(block, "its arguments are not a JSON object")
    return ToolCall(call["name"], arguments)
