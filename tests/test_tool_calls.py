"""The Hermes/Qwen tool-call parser: content around calls, several calls, malformed blocks
left as content, and a text fed piece by piece cut exactly as the whole text."""

from __future__ import annotations

import random

import pytest

from tandem.rollout.tool_calls import (
    MalformedToolCall,
    ToolCall,
    ToolCallParser,
    parse_tool_calls,
)

CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
OTHER = '<tool_call>{"name": "add", "arguments": {"x": [1, "</tool"]}}</tool_call>'


def test_text_around_a_call_is_content():
    parsed = parse_tool_calls(f"Let me compute.\n{CALL}\nDone.")
    assert parsed.content == "Let me compute.\n\nDone."
    assert parsed.calls == [ToolCall("multiply", {"a": 3, "b": 4})]


def test_two_calls_come_in_order():
    parsed = parse_tool_calls(f"{CALL}\n{OTHER}")
    assert parsed.tool_calls == [ToolCall("multiply", {"a": 3, "b": 4}),
                                 ToolCall("add", {"x": [1, "</tool"]})]
    assert parsed.content == "\n"


def test_a_call_without_arguments_has_none():
    assert parse_tool_calls('<tool_call>{"name": "now"}</tool_call>').calls == [
        ToolCall("now", {})]


@pytest.mark.parametrize(("block", "error"), [
    ('<tool_call>{"name": "multiply", "arguments": {"a": 3</tool_call>', "not JSON"),
    ('<tool_call>["multiply"]</tool_call>', "string name"),
    ('<tool_call>{"name": 7, "arguments": {}}</tool_call>', "string name"),
    ('<tool_call>{"name": "f", "arguments": "a=3"}</tool_call>', "not a JSON object"),
])
def test_a_malformed_block_stays_in_the_content(block, error):
    parsed = parse_tool_calls(f"a {block} {CALL}")
    malformed, call = parsed.calls
    assert isinstance(malformed, MalformedToolCall) and error in malformed.error
    assert malformed.text == block and call == ToolCall("multiply", {"a": 3, "b": 4})
    assert parsed.content == f"a {block} " and parsed.tool_calls == [call]


def test_an_unclosed_block_is_content():
    parsed = parse_tool_calls(f"Hi {CALL[:-3]}")
    assert parsed.content == f"Hi {CALL[:-3]}" and parsed.calls == []


@pytest.mark.parametrize("seed", range(20))
def test_fed_in_pieces_the_text_is_cut_as_a_whole_and_no_tag_leaks(seed):
    rng = random.Random(seed)
    text = f"I will <tool call> now. <tool_{CALL}<tool_call>{OTHER} then {CALL} <tool_ca"
    cuts = sorted(rng.sample(range(1, len(text)), 12))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    parser = ToolCallParser()
    fed = [parser.feed(piece, final=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    whole = parse_tool_calls(text)
    assert "".join(p.content for p in fed) == whole.content
    assert [c for p in fed for c in p.calls] == whole.calls
    assert parser.num_tool_calls == len(whole.tool_calls) == 2
    assert whole.content.endswith(" <tool_ca") and "<tool_call><tool_call>" in whole.content


def test_a_tail_that_may_begin_a_call_waits_until_settled():
    parser = ToolCallParser()
    assert parser.feed("Sure <tool").content == "Sure "
    assert parser.feed("s> and <").content == "<tools> and "
    opened = parser.feed(CALL[1:-4])
    assert opened.content == "" and opened.calls == []
    closed = parser.feed(CALL[-4:] + "!")
    assert closed.content == "!" and closed.tool_calls == [ToolCall("multiply", {"a": 3, "b": 4})]
