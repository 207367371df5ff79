"""Structured outputs through the server, with the official ``openai`` client: vLLM's
``structured_outputs`` extra field and OpenAI's ``response_format`` on both completion
endpoints, streamed or not; every output parses and validates against its schema."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from tandem.rollout import LLMEngine

from .test_server import MODEL, openai_client, running_server, wait_until_idle

SCHEMA = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Rome", "Oslo"]}, "sunny": {"type": "boolean"},
    "rank": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "sunny", "rank"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def served(llama_dir) -> Iterator[tuple[str, LLMEngine]]:
    with running_server(llama_dir, dict(num_kv_blocks=256, max_model_len=512)) as served:
        yield served


def texts_of(response, stream: bool, chat: bool) -> list[tuple[str, str]]:
    """Each choice's whole text and finish reason, from a response or a stream of chunks."""
    if not stream:
        return [(c.message.content if chat else c.text, c.finish_reason)
                for c in response.choices]
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in response:
        for choice in chunk.choices:
            piece = (choice.delta.content if chat else choice.text) or ""
            texts[choice.index] = texts.get(choice.index, "") + piece
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    return [(texts[i], reasons[i]) for i in sorted(texts)]


def create(url: str, chat: bool, stream: bool, response_format: dict | None = None,
           structured_outputs: dict | None = None, max_tokens: int = 400):
    """Four sampled choices under a constraint (``response_format`` goes as vLLM takes it
    on completions too: the client only offers it for chat). The grammar allows free
    whitespace, which a random model may emit until ``max_tokens``: the seed is one whose
    choices close their objects (the draws changed with seeded_uniforms)."""
    client = openai_client(url)
    extra = {k: v for k, v in (("response_format", response_format),
                               ("structured_outputs", structured_outputs)) if v is not None}
    common = dict(model=MODEL, n=4, temperature=1.0, max_tokens=max_tokens, seed=1,
                  stream=stream, extra_body=extra)
    if chat:
        return client.chat.completions.create(
            messages=[{"role": "user", "content": "Weather as JSON?"}], **common)
    return client.completions.create(prompt="Weather as JSON:", **common)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("how", ["structured_outputs", "response_format"])
def test_every_output_validates_against_its_schema(served, how, chat, stream):
    options = ({"response_format": RESPONSE_FORMAT} if how == "response_format"
               else {"structured_outputs": {"json": SCHEMA}})
    outputs = texts_of(create(served[0], chat, stream, **options), stream, chat)
    assert len(outputs) == 4
    for text, finish_reason in outputs:
        assert finish_reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_every_output_validates_with_the_engine_core_in_its_own_process(llama_dir, stream):
    """``tandem serve``'s default core: the grammar is compiled and masks applied in the
    core's process, the text assembled in the server's."""
    from .test_server_engine_core import running_process_server

    with running_process_server(llama_dir, dict(num_kv_blocks=256, max_model_len=512)) as (
            url, _):
        outputs = texts_of(create(url, True, stream, structured_outputs={"json": SCHEMA}),
                           stream, True)
    assert len(outputs) == 4
    for text, finish_reason in outputs:
        assert finish_reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_regex_and_choice(served):
    url, _ = served
    objects = texts_of(create(url, True, False, response_format={"type": "json_object"},
                              max_tokens=200), False, True)
    finished = [text for text, reason in objects if reason == "stop"]
    assert finished and all(isinstance(json.loads(text), dict) for text in finished)
    choices = texts_of(create(url, False, False,
                              structured_outputs={"choice": ["left", "right"]}), False, False)
    assert {text for text, _ in choices} <= {"left", "right"}
    codes = texts_of(create(url, False, True, structured_outputs={
        "regex": "[A-Z]{3}-[0-9]{2}"}), True, False)
    assert all(len(code) == 6 and code[3] == "-" and code[4:].isdigit() for code, _ in codes)


@pytest.mark.parametrize("options, says", [
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex is invalid"),
    ({"structured_outputs": {"json": {"type": "nope"}}}, "structured_outputs.json is invalid"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"structured_outputs": {"regexp": "a"}}, "StructuredOutputsParams"),
    ({"response_format": {"type": "json_schema"}}, "needs its json_schema"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "give one"),
], ids=["bad_regex", "bad_schema", "two_kinds", "unknown_field", "no_schema", "both"])
def test_a_bad_constraint_is_a_400_naming_it_and_the_server_goes_on(served, options, says):
    url, engine = served
    with pytest.raises(openai.BadRequestError) as raised:
        create(url, False, False, **options)
    assert says in raised.value.body["message"], raised.value.body["message"]
    assert texts_of(create(url, False, False, max_tokens=2), False, False)
    wait_until_idle(engine)
    assert engine.stats()["kv_blocks_used"] == 0
