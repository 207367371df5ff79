"""OpenAI tool calls on ``/v1/chat/completions``, with the official client, against a tiny
model fitted to call ``multiply`` (tests/tool_model.py): the call parsed whole and streamed,
the tool's result answered, ``tool_choice: "none"``, the prompt rendered exactly as the
tokenizer's own chat template renders it, and the refusals (a template without tools, a
tool_choice not supported or naming an unknown function) leaving the server serving."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from transformers.utils import get_json_schema

from tandem.rollout import LLM, LLMEngine, SamplingParams
from tandem.rollout.tool_calls import parse_tool_calls

from .test_server import MODEL, openai_client, running_server, wait_until_idle
from .tool_model import ANSWER, CALL_TEXT, QUESTION, conversation, multiply

TOOLS = [get_json_schema(multiply)]
ENGINE_OPTIONS = dict(num_kv_blocks=160, max_model_len=1024)  # the prompts are ~850 tokens
CALLED = {"id": "call_1", "type": "function",
          "function": {"name": "multiply", "arguments": '{"a": 3, "b": 4}'}}
FIRST_TURN = [{"role": "user", "content": QUESTION}]
SECOND_TURN = [*FIRST_TURN, {"role": "assistant", "content": None, "tool_calls": [CALLED]},
               {"role": "tool", "tool_call_id": "call_1", "content": "12"}]


@pytest.fixture(scope="module")
def served(tool_model_dir) -> Iterator[tuple[str, LLMEngine]]:
    with running_server(tool_model_dir, ENGINE_OPTIONS) as served:
        yield served


def ask(served: tuple[str, LLMEngine], messages: list[dict], **options):
    """A greedy chat completion with ``TOOLS``."""
    url, _ = served
    return openai_client(url).chat.completions.create(
        model=MODEL, messages=messages, tools=options.pop("tools", TOOLS), temperature=0,
        max_tokens=100, **options)


def test_a_tool_call_is_answered_as_tool_calls(served):
    choice = ask(served, FIRST_TURN).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) > 10
    assert call.function.name == "multiply"
    assert json.loads(call.function.arguments) == {"a": 3, "b": 4}


def test_a_tool_call_comes_from_an_engine_core_in_its_own_process(tool_model_dir):
    from .test_server_engine_core import running_process_server

    with running_process_server(tool_model_dir, ENGINE_OPTIONS) as (url, _):
        choice = ask((url, None), FIRST_TURN).choices[0]
        answer = ask((url, None), SECOND_TURN).choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "multiply"
    assert json.loads(call.function.arguments) == {"a": 3, "b": 4}
    assert answer.finish_reason == "stop" and answer.message.content == ANSWER


def test_a_streamed_tool_call_comes_as_tool_call_deltas(served):
    contents, calls, finish_reasons = [], {}, []
    for chunk in ask(served, FIRST_TURN, stream=True):
        (choice,) = chunk.choices
        contents.append(choice.delta.content or "")
        finish_reasons.append(choice.finish_reason)
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += delta.id or ""
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
    assert not any("<tool" in content for content in contents)
    assert "".join(contents).strip() == ""
    assert list(calls) == [0] and calls[0]["id"].startswith("call_")
    assert calls[0]["name"] == "multiply"
    assert json.loads(calls[0]["arguments"]) == {"a": 3, "b": 4}
    assert finish_reasons[-1] == "tool_calls" and set(finish_reasons[:-1]) == {None}


def test_the_tool_result_is_answered_as_content(served):
    choice = ask(served, SECOND_TURN).choices[0]
    assert choice.message.content == ANSWER and not choice.message.tool_calls
    assert choice.finish_reason == "stop"


def test_tool_choice_none_renders_tools_but_answers_the_raw_text(served):
    choice = ask(served, FIRST_TURN, tool_choice="none").choices[0]
    assert choice.message.content == CALL_TEXT and not choice.message.tool_calls
    assert choice.finish_reason == "stop"


@pytest.mark.parametrize(("messages", "fitted"), [(FIRST_TURN, 1), (SECOND_TURN, 3)],
                         ids=["question", "tool_result"])
def test_prompt_ids_equal_the_tokenizers_own_chat_template(served, messages, fitted):
    response = ask(served, messages, extra_body={"return_token_ids": True})
    tokenizer = served[1].tokenizer
    expected = tokenizer.apply_chat_template(conversation()[:fitted], tools=TOOLS,
                                             add_generation_prompt=True, return_dict=False)
    assert response.model_extra["prompt_token_ids"] == list(expected)
    completion_ids = response.choices[0].model_extra["token_ids"]
    assert tokenizer.decode(completion_ids, skip_special_tokens=True) == \
        (CALL_TEXT if fitted == 1 else ANSWER)


@pytest.fixture(scope="module")
def served_without_tools(llama_dir) -> Iterator[tuple[str, LLMEngine]]:
    with running_server(llama_dir) as served:
        yield served


def refusal(served: tuple[str, LLMEngine], messages: list[dict], **options) -> openai.APIError:
    with pytest.raises(openai.BadRequestError) as refused:
        ask(served, messages, **options)
    return refused.value


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "multiply"}}])
@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_choice_calls_the_tool_where_the_model_would_answer(served, tool_choice,
                                                                          stream):
    # After the tool's result the model answers in text; a forced choice makes it call again.
    response = ask(served, SECOND_TURN, tool_choice=tool_choice, stream=stream)
    if stream:
        calls = [d for chunk in response for d in chunk.choices[0].delta.tool_calls or []]
        names = [call.function.name for call in calls]
        arguments = [json.loads(call.function.arguments) for call in calls]
    else:
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls"
        names = [call.function.name for call in choice.message.tool_calls]
        arguments = [json.loads(call.function.arguments) for call in choice.message.tool_calls]
    assert names and set(names) == {"multiply"}
    assert all(set(a) == {"a", "b"} and all(isinstance(v, int) for v in a.values())
               for a in arguments)
    if isinstance(tool_choice, dict):
        assert len(names) == 1  # a named function is called once


def test_a_template_that_ignores_tools_is_refused(served_without_tools):
    error = refusal(served_without_tools, FIRST_TURN)
    assert "chat template does not render tools" in error.body["message"]
    url, engine = served_without_tools
    assert openai_client(url).chat.completions.create(
        model=MODEL, messages=FIRST_TURN, max_tokens=2).choices[0].finish_reason == "length"
    wait_until_idle(engine)
    assert engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize(("options", "messages", "param", "says"), [
    ({"tool_choice": {"type": "function", "function": {"name": "divide"}}}, FIRST_TURN,
     "tool_choice", ["'divide'", "multiply"]),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, FIRST_TURN,
     "tool_choice", ["already constrains", "response_format"]),
    ({"tool_choice": "auto", "tools": openai.omit}, FIRST_TURN, "tool_choice",
     ["needs tools"]),
    ({}, [*FIRST_TURN, {"role": "assistant", "content": "", "tool_calls": [
        CALLED | {"function": {"name": "multiply", "arguments": "a=3"}}]}], "messages",
     ["not JSON", "a=3"]),
], ids=["unknown_function", "forced_and_constrained", "without_tools", "bad_arguments"])
def test_bad_tool_requests_are_refused_and_leak_nothing(served, options, messages, param, says):
    error = refusal(served, messages, **options)
    assert error.param == param
    assert all(part in error.body["message"] for part in says), error.body["message"]
    assert ask(served, FIRST_TURN).choices[0].finish_reason == "tool_calls"
    wait_until_idle(served[1])
    assert served[1].stats()["kv_blocks_used"] == 0


def test_offline_chat_renders_tools_as_the_server_does(served, tool_model_dir):
    _, engine = served
    llm = LLM(str(tool_model_dir), **ENGINE_OPTIONS)
    output = llm.chat(FIRST_TURN, SamplingParams(temperature=0, max_tokens=100), tools=TOOLS,
                      use_tqdm=False)[0]
    assert output.prompt_token_ids == engine.apply_chat_template(FIRST_TURN, True, TOOLS)
    assert parse_tool_calls(output.outputs[0].text).tool_calls[0].name == "multiply"
