"""The HTTP server on real sockets: the openai client equals offline generation, concurrent
streams whose clients leave free every block, pause and sleep, metrics, and bad requests
refused with OpenAI-style 4xx bodies while other requests go on."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import os
import socket
import subprocess
import sys
import threading
import time
import typing
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from tandem.cli import build_parser
from tandem.cli.arguments import config_from_arguments
from tandem.rollout import LLM, EngineConfig, LLMEngine, SamplingParams, StructuredOutputsParams
from tandem.rollout.serving.config import ServerConfig
from tandem.rollout.serving.middleware import GuardMiddleware
from tandem.rollout.serving.protocol import ChatCompletionRequest, CompletionRequest
from tandem.rollout.serving.server import DrainingServer, uvicorn_server

from .conftest import count_tokenizations

HOST = "127.0.0.1"
API_KEY = "test-key"
MODEL = "tiny"
ENGINE_OPTIONS = dict(num_kv_blocks=256, max_model_len=256)
LIMITS = dict(max_prompt_tokens=64, max_n=8, max_tokens=64, max_body_bytes=1 << 16)
PROMPTS = ["What is 2+3?", "The quick brown fox"]
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CONTROL_KEY = "test-control-key"
CONTROL_AUTH = {"Authorization": f"Bearer {CONTROL_KEY}"}
# The engine-control routes under a key of their own, as a trainer's server runs them.
CONTROL_OPTIONS = dict(enable_control_routes=True, control_api_key=CONTROL_KEY)


@contextmanager
def running_uvicorn(folder, engine_options: dict | None = None, **server_options
                    ) -> Iterator[tuple[str, LLMEngine, DrainingServer, threading.Thread]]:
    """A server for the model in ``folder`` (with ``engine_options``, default
    ``ENGINE_OPTIONS``) on a free port of 127.0.0.1, in a thread; also the uvicorn server
    (``should_exit = True`` shuts it down, as SIGTERM does) and its thread. Its control
    routes are served, under the API key unless ``server_options`` give a control key."""
    engine = LLMEngine(EngineConfig(model=str(folder), **(engine_options or ENGINE_OPTIONS)))
    config = ServerConfig(**{"api_key": API_KEY, "served_model_name": MODEL,
                             "enable_control_routes": True} | server_options)
    listener = socket.socket()
    listener.bind((HOST, 0))
    server = uvicorn_server(engine, config, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://{HOST}:{listener.getsockname()[1]}", engine, server, thread
    finally:
        server.should_exit = True
        thread.join(30)


@contextmanager
def running_server(folder, engine_options: dict | None = None,
                   **server_options) -> Iterator[tuple[str, LLMEngine]]:
    """``running_uvicorn``'s address and engine."""
    with running_uvicorn(folder, engine_options, **server_options) as (url, engine, _, _):
        yield url, engine


def wait_until_idle(engine: LLMEngine) -> None:
    deadline = time.monotonic() + 30
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.02)


def recorded_request_ids(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ids of every request the server queues on ``engine`` from now on."""
    request_ids: list[str] = []
    add_requests = engine.add_requests

    def recording(ids, prompts, params) -> None:
        request_ids.extend(ids)
        add_requests(ids, prompts, params)

    monkeypatch.setattr(engine, "add_requests", recording)
    return request_ids


@pytest.fixture(scope="module")
def served(llama_dir) -> Iterator[tuple[str, LLMEngine]]:
    with running_server(llama_dir, **LIMITS, **CONTROL_OPTIONS) as served:
        yield served


@pytest.fixture(scope="module")
def offline(llama_dir) -> LLM:
    return LLM(str(llama_dir), **ENGINE_OPTIONS)


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)


def collect(chunks, content) -> dict[int, dict]:
    """Per choice index: text, token ids and sampled log-probs added up over a stream."""
    choices: dict[int, dict] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            entry = choices.setdefault(choice.index, {"text": "", "token_ids": [],
                                                      "logprobs": [], "finish_reason": None})
            entry["text"] += content(choice) or ""
            entry["token_ids"] += choice.model_extra.get("token_ids") or []
            entry["logprobs"] += sampled_logprobs(choice)
            entry["finish_reason"] = choice.finish_reason or entry["finish_reason"]
    return choices


def sampled_logprobs(choice) -> list[float]:
    if choice.logprobs is None:
        return []
    if hasattr(choice.logprobs, "token_logprobs"):
        return list(choice.logprobs.token_logprobs or [])
    return [entry.logprob for entry in choice.logprobs.content or []]


def assert_equal_to_offline(choices: dict[int, dict], expected, n: int) -> None:
    for prompt_index, output in enumerate(expected):
        for completion in output.outputs:
            got = choices[prompt_index * n + completion.index]
            assert got["text"] == completion.text
            assert got["token_ids"] == completion.token_ids
            assert got["logprobs"] == pytest.approx(completion.logprobs, abs=1e-5)
            assert got["finish_reason"] == completion.finish_reason


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_openai_completions_equal_offline_generate(served, offline, stream):
    params = SamplingParams(n=3, max_tokens=10, seed=11, logprobs=2)
    expected = offline.generate(PROMPTS, params, use_tqdm=False)
    response = openai_client(served[0]).completions.create(
        model=MODEL, prompt=PROMPTS, n=3, max_tokens=10, seed=11, logprobs=2, stream=stream,
        extra_body={"return_token_ids": True})
    chunks = response if stream else [response]
    assert_equal_to_offline(collect(chunks, lambda choice: choice.text), expected, n=3)
    if not stream:
        assert response.usage.completion_tokens == sum(
            len(c.token_ids) for o in expected for c in o.outputs)
        assert response.choices[0].model_extra["prompt_token_ids"] == \
            expected[0].prompt_token_ids


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_openai_chat_equals_offline_chat(served, offline, stream):
    messages = [{"role": "user", "content": "What is 17*4?"}]
    expected = offline.chat(messages, SamplingParams(n=2, max_tokens=12, seed=5, logprobs=2),
                            use_tqdm=False)
    response = openai_client(served[0]).chat.completions.create(
        model=MODEL, messages=messages, n=2, max_tokens=12, seed=5, logprobs=True,
        top_logprobs=2, stream=stream, extra_body={"return_token_ids": True})
    if stream:
        choices = collect(response, lambda choice: choice.delta.content)
    else:
        choices = collect([response], lambda choice: choice.message.content)
        first = response.choices[0].logprobs.content
        assert [top.logprob for entry in first for top in entry.top_logprobs] == \
            pytest.approx([lp for top in expected[0].outputs[0].top_logprobs
                           for lp in top.values()], abs=1e-5)
        assert response.model_extra["prompt_token_ids"] == expected[0].prompt_token_ids
    assert_equal_to_offline(choices, expected, n=2)


def test_token_id_prompt_returns_prompt_and_completion_ids_with_weight_version(served,
                                                                               offline):
    prompt = [5, 9, 33, 70, 2, 81, 100, 4, 17, 3, 44, 12, 200, 7, 8, 9, 10]  # a block plus one
    expected = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=6,
                                                         logprobs=0, prompt_logprobs=2),
                                use_tqdm=False)[0]
    answer = httpx.post(f"{served[0]}/v1/completions", headers=AUTH, json={
        "prompt": prompt, "temperature": 0, "max_tokens": 6, "logprobs": 0,
        "prompt_logprobs": 2, "return_token_ids": True}).json()
    choice = answer["choices"][0]
    assert choice["prompt_token_ids"] == prompt
    assert choice["prompt_logprobs"][0] is None
    for ours, offline_entry in zip(choice["prompt_logprobs"][1:], expected.prompt_logprobs[1:]):
        assert {int(t): v["logprob"] for t, v in ours.items()} == pytest.approx(offline_entry,
                                                                             abs=1e-5)
    assert choice["token_ids"] == expected.outputs[0].token_ids
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(expected.outputs[0].logprobs,
                                                                 abs=1e-5)
    assert answer["weight_version"] == 0 and choice["weight_versions"] == [0, 0]


def test_32_streams_with_a_third_leaving_midway_free_every_block(served):
    url, engine = served

    async def one(client: openai.AsyncOpenAI, i: int) -> str | None:
        stream = await client.completions.create(
            model=MODEL, prompt=f"{i}: The quick brown fox", max_tokens=48, seed=i,
            stream=True, extra_body={"ignore_eos": True})
        finish_reason, chunks = None, 0
        async for chunk in stream:
            chunks += 1
            if i % 3 == 0 and chunks == 3:
                await stream.close()
                return "left"
            finish_reason = chunk.choices[0].finish_reason or finish_reason
        return finish_reason

    async def all_streams() -> list[str | None]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
        return await asyncio.gather(*(one(client, i) for i in range(32)))

    aborted_before = metric(url, "tandem:aborted_requests_total")
    results = asyncio.run(all_streams())
    assert results == ["left" if i % 3 == 0 else "length" for i in range(32)]
    wait_until_idle(engine)
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == stats["num_waiting"] == 0
    assert metric(url, "tandem:aborted_requests_total") - aborted_before == 11


def metric(url: str, name: str) -> float:
    """The value of the sample ``name`` in the server's /metrics (parsed by prometheus_client)."""
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    return next(sample.value for family in families for sample in family.samples
                if sample.name == name)


def bad_requests(url: str) -> list[tuple[int, str | None, dict]]:
    """(expected status, expected param, httpx.request arguments) per bad request."""
    post = dict(method="POST", url=f"{url}/v1/completions", headers=AUTH)
    ok = {"prompt": "What is 2+3?", "max_tokens": 4}
    return [
        (400, None, post | {"content": b'{"prompt": "x",', "headers": AUTH | {
            "Content-Type": "application/json"}}),
        (400, "n", post | {"json": ok | {"n": 100000}}),
        (400, "max_tokens", post | {"json": ok | {"max_tokens": 10**9}}),
        (400, "prompt_logprobs", post | {"json": ok | {"prompt_logprobs": 10**6}}),
        (400, "prompt", post | {"json": ok | {"prompt": list(range(3, 100))}}),
        (400, None, post | {"json": ok | {"top_p": 0}}),
        (400, "prompt", post | {"json": ok | {"prompt": []}}),
        (400, "n", post | {"json": ok | {"n": "many"}}),
        (404, "model", post | {"json": ok | {"model": "gpt-4"}}),
        (413, None, post | {"json": ok | {"prompt": "x" * (1 << 17)}}),
        (401, None, post | {"json": ok, "headers": {}}),
        (401, None, post | {"json": ok, "headers": {"Authorization": "Bearer wrong"}}),
        (400, "prompt", post | {"json": ok | {"prompt": [True, False]}}),
        (400, None, post | {"json": ok | {"max_tokens": 0}}),
        (404, None, dict(method="POST", url=f"{url}/init_weight_transfer_engine",
                         headers=AUTH, json={"init_info": {"master_address": HOST,
                                                           "master_port": 1}})),
        (404, None, dict(method="GET", url=f"{url}/v2/nothing", headers=AUTH)),
    ]


async def stream_while(url: str, requests: list[dict]) -> tuple[str, list[httpx.Response]]:
    """Stream a completion of ``PROMPTS[0]`` (40 tokens, seed 3) and, once its first chunk
    came, send ``requests`` (``httpx`` request arguments) one by one: the streamed text and
    their answers."""
    async with httpx.AsyncClient(timeout=120) as client:
        async with client.stream("POST", f"{url}/v1/completions", headers=AUTH, json={
                "prompt": PROMPTS[0], "max_tokens": 40, "seed": 3, "ignore_eos": True,
                "stream": True}) as stream:
            lines = stream.aiter_lines()
            first = await anext(lines)
            answers = [await client.request(**request) for request in requests]
            rest = [line async for line in lines]
    texts = [chunk["choices"][0]["text"] for chunk in map(_event, [first, *rest]) if chunk]
    return "".join(texts), answers


def test_bad_requests_get_4xx_with_openai_errors_and_others_go_on(served, offline):
    url, _ = served
    params = SamplingParams(max_tokens=40, seed=3, ignore_eos=True)
    expected = offline.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].text

    text, answers = asyncio.run(stream_while(url, [request for _, _, request in
                                                    bad_requests(url)]))
    assert text == expected
    for (status, param, _), answer in zip(bad_requests(url), answers):
        assert answer.status_code == status, answer.text
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert error["param"] == param
    assert "--enable-weight-transfer" in answers[-2].json()["error"]["message"]
    assert httpx.get(f"{url}/health").status_code == 200
    assert openai_client(url).completions.create(model=MODEL, prompt="x", max_tokens=2).choices


def test_each_prompt_is_tokenized_once_whichever_route(served, monkeypatch):
    url, engine = served
    assert engine.tokenizer is engine.input_processor.tokenizer
    tokenizer = count_tokenizations(engine, monkeypatch)

    def calls(path: str, body: dict) -> dict[str, int]:
        tokenizer.calls.clear()
        answer = httpx.post(f"{url}{path}", headers=AUTH, json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        return dict(tokenizer.calls)

    three = [*PROMPTS, "x"]
    for stream in (False, True):
        counted = calls("/v1/completions", {"prompt": three, "n": 2, "max_tokens": 2,
                                            "stream": stream})
        assert sum(counted.values()) == 3 and "apply_chat_template" not in counted
    assert calls("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 2}) == {"encode": 1}
    assert calls("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                          "n": 2, "max_tokens": 2}) == {
        "apply_chat_template": 1}
    rollout = {"prompts": three, "sampling_params": {"n": 2, "max_tokens": 2}}
    counted = calls("/v1/rollouts", rollout)
    assert sum(counted.values()) == 3 and "apply_chat_template" not in counted
    assert calls("/v1/rollouts", rollout | {"prompts": [[5, 9, 33], [70, 2]]}) == {}


def changed_value(field: dataclasses.Field, hint: object) -> object:
    """A valid value of a ``SamplingParams`` field other than its default, by its type."""
    default = (field.default if field.default_factory is dataclasses.MISSING
               else field.default_factory())
    if hint is bool:
        return not default
    if hint is float:
        return default / 2 or 0.5
    if hint is int:
        return default + 1
    if hint == int | None:
        return 2
    if hint == list[str]:
        return ["Paris"]
    if hint == list[int]:
        return [7]
    if hint == StructuredOutputsParams | None:
        return StructuredOutputsParams(regex="[a-z]+")
    raise AssertionError(f"no test value for SamplingParams.{field.name}: {hint}; add one")


def test_every_sampling_params_field_is_an_openai_request_field_reaching_sampling_params():
    hints = typing.get_type_hints(SamplingParams)
    values = {field.name: changed_value(field, hints[field.name])
              for field in dataclasses.fields(SamplingParams)}
    expected = SamplingParams(**values)
    completion = CompletionRequest.model_validate({"prompt": "x", **values})
    assert completion.sampling_params(completion.max_tokens, completion.logprobs) == expected
    chat_values = {k: v for k, v in values.items() if k != "logprobs"}  # a flag in chat
    user = [{"role": "user", "content": "x"}]
    chat = ChatCompletionRequest.model_validate({"messages": user, **chat_values})
    assert chat.sampling_params(chat.max_tokens, values["logprobs"]) == expected
    for request in (CompletionRequest(prompt="x"),
                    ChatCompletionRequest.model_validate({"messages": user})):
        assert request.sampling_params(16, None) == SamplingParams(max_tokens=16)


def _event(line: str) -> dict | None:
    import json

    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    return json.loads(line.removeprefix("data: "))


def test_pause_keep_freezes_abort_ends_and_resume_admits_held_requests(served, monkeypatch):
    url, engine = served
    client = openai_client(url)
    results: list = []
    request_ids = recorded_request_ids(engine, monkeypatch)

    def request() -> threading.Thread:
        worker = threading.Thread(target=lambda: results.append(client.completions.create(
            model=MODEL, prompt=PROMPTS[1], max_tokens=60, extra_body={"ignore_eos": True})))
        worker.start()
        return worker

    def generated() -> int:
        return sum(engine.num_output_tokens(r) or 0 for r in request_ids)

    worker = request()
    while not generated():
        time.sleep(0.002)
    assert httpx.post(f"{url}/pause", params={"mode": "keep"},
                      headers=CONTROL_AUTH).status_code == 200
    frozen = generated()
    time.sleep(0.2)
    assert generated() == frozen < 60
    assert httpx.get(f"{url}/is_paused", headers=AUTH).json() == {"is_paused": True}
    httpx.post(f"{url}/pause", params={"mode": "abort"}, headers=CONTROL_AUTH)
    worker.join(60)
    assert results[0].choices[0].finish_reason == "abort"
    assert results[0].usage.completion_tokens == frozen

    worker = request()
    time.sleep(0.2)
    assert not engine.has_unfinished_requests()  # held until /resume
    httpx.post(f"{url}/resume", headers=CONTROL_AUTH)
    worker.join(60)
    assert results[1].choices[0].finish_reason == "length"
    wait_until_idle(engine)
    assert engine.stats()["kv_blocks_used"] == 0


def test_sleep_refuses_generation_until_wake_up(served):
    url, _ = served
    assert httpx.post(f"{url}/sleep", params={"level": 1},
                      headers=CONTROL_AUTH).status_code == 200
    assert httpx.get(f"{url}/is_sleeping", headers=AUTH).json() == {"is_sleeping": True}
    asleep = httpx.post(f"{url}/v1/completions", headers=AUTH, json={"prompt": "x"})
    assert asleep.status_code == 409 and "wake_up" in asleep.json()["error"]["message"]
    assert httpx.post(f"{url}/wake_up", params={"tags": ["weights", "kv_cache"]},
                      headers=CONTROL_AUTH).status_code == 200
    assert httpx.post(f"{url}/reset_prefix_cache", headers=CONTROL_AUTH).status_code == 200
    assert httpx.post(f"{url}/v1/completions", headers=AUTH,
                      json={"prompt": "x", "max_tokens": 2}).status_code == 200
    assert httpx.post(f"{url}/release_kv_cache_memory",
                      headers=CONTROL_AUTH).status_code == 200
    assert httpx.get(f"{url}/is_sleeping", headers=AUTH).json() == {"is_sleeping": True}
    assert httpx.post(f"{url}/wake_up", headers=CONTROL_AUTH).status_code == 200
    assert httpx.get(f"{url}/is_sleeping", headers=AUTH).json() == {"is_sleeping": False}
    assert httpx.post(f"{url}/sleep", params={"level": 3},
                      headers=CONTROL_AUTH).status_code == 400


def test_serve_freezes_what_start_up_loaded_until_it_shuts_down(llama_dir):
    gc.unfreeze()  # another test's server may have frozen objects: start from none
    with running_uvicorn(llama_dir) as (url, _, _, _):
        assert gc.get_freeze_count() > 0
        response = httpx.post(f"{url}/v1/completions", headers=AUTH,
                              json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
        assert response.status_code == 200
    assert gc.get_freeze_count() == 0


def test_models_lists_the_served_name(served):
    models = openai_client(served[0]).models.list()
    assert [model.id for model in models.data] == [MODEL]


def test_serve_options_build_both_configs_and_bind_localhost_by_default(llama_dir):
    args = build_parser().parse_args(["serve", str(llama_dir), "--api-key", "k", "--max-n",
                                      "4", "--no-enable-prefix-caching", "--max-model-len",
                                      "128"])
    engine_config = config_from_arguments(EngineConfig, args)
    server_config = config_from_arguments(ServerConfig, args)
    assert engine_config.model == str(llama_dir) and engine_config.max_model_len == 128
    assert engine_config.enable_prefix_caching is False
    assert (server_config.host, server_config.api_key, server_config.max_n) == (HOST, "k", 4)
    assert server_config.enable_weight_transfer is False


@contextmanager
def serve_command(folder, *options: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """``tandem serve folder --port P *options`` in a subprocess, once it answers /health;
    the process and its address (SIGTERM and a wait end it, if the test did not)."""
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "serve", str(folder), "--port", str(port),
         "--num-kv-blocks", "64", *options],
        env=os.environ | {"OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE)
    url = f"http://{HOST}:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield process, url
    finally:
        process.terminate()
        process.wait(30)


def test_tandem_serve_command_answers_on_localhost(llama_dir):
    # Its engine core has a process of its own (--engine-core process, the default).
    with serve_command(llama_dir, "--max-model-len", "128") as (_, url):
        models = httpx.get(f"{url}/v1/models").json()
        answer = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "prompt": PROMPTS[1], "max_tokens": 5, "seed": 3, "ignore_eos": True})
    assert models["data"][0]["id"] == str(llama_dir)
    expected = LLM(str(llama_dir), num_kv_blocks=64, max_model_len=128).generate(
        [PROMPTS[1]], SamplingParams(max_tokens=5, seed=3, ignore_eos=True), use_tqdm=False)
    assert answer.json()["choices"][0]["text"] == expected[0].outputs[0].text


@pytest.mark.parametrize("prompts", [[None], [1.5], ["a", None], [[True, False]]])
def test_rollouts_refuse_prompts_that_are_not_text_or_token_ids(served, prompts):
    url, engine = served
    answer = httpx.post(f"{url}/v1/rollouts", headers=AUTH, json={"prompts": prompts})
    assert answer.status_code == 400, answer.text
    assert "prompt" in answer.json()["error"]["message"]
    assert engine.stats()["kv_blocks_used"] == 0


def test_chat_max_tokens_0_is_refused_not_taken_as_unset(served):
    url, _ = served
    answer = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0})
    assert answer.status_code == 400 and "max_tokens=0" in answer.json()["error"]["message"]


def test_metrics_are_open_to_scrapers_and_server_info_never_shows_the_key(served):
    url, _ = served
    assert httpx.get(f"{url}/metrics").status_code == 200  # no key, as vLLM's
    info = httpx.get(f"{url}/server_info", headers=AUTH).json()["server_config"]
    assert info["api_key_set"] is True and "api_key" not in info
    assert API_KEY not in json.dumps(info)


def test_metrics_can_require_the_api_key():
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    guarded = GuardMiddleware(app, "k", 1024, open_paths=frozenset({"/health"}))
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": "/metrics", "headers": []}
    asyncio.run(guarded(scope, receive, send))
    assert sent[0]["status"] == 401


def served_schema(url: str) -> dict:
    return httpx.get(f"{url}/openapi.json", headers=AUTH).json()


def test_health_answers_the_json_body_its_schema_documents(served):
    url, _ = served
    documented = served_schema(url)["paths"]["/health"]["get"]["responses"]["200"]["content"]
    answer = httpx.get(f"{url}/health")
    assert list(documented) == ["application/json"]
    assert answer.headers["content-type"] == "application/json"
    assert answer.json() == {"status": "ok"}


def test_metrics_are_documented_and_served_as_prometheus_text(served):
    url, _ = served
    documented = served_schema(url)["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert documented == {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}
    assert httpx.get(f"{url}/metrics").headers["content-type"] == CONTENT_TYPE_LATEST


def test_schema_lists_openai_400_for_every_validating_route_and_never_422(served):
    url, _ = served
    schema = served_schema(url)
    operations = {(method, path): operation for path, item in schema["paths"].items()
                  for method, operation in item.items()}
    validating = {key for key, operation in operations.items()
                  if "requestBody" in operation or operation.get("parameters")}
    assert {("post", "/v1/completions"), ("post", "/v1/chat/completions"),
            ("post", "/v1/rollouts"), ("post", "/pause"), ("post", "/sleep")} <= validating
    error_body = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    for key in validating:
        assert operations[key]["responses"]["400"]["content"] == error_body, key
    assert not [key for key, operation in operations.items() if "422" in operation["responses"]]
    components = schema["components"]["schemas"]
    assert "HTTPValidationError" not in components
    assert set(components["ErrorDetail"]["properties"]) == {"message", "type", "param", "code"}
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/rollouts"):
        assert {"400", "401", "413", "503", "504"} <= set(operations["post", path]["responses"])
    answer = httpx.post(f"{url}/v1/chat/completions", headers=AUTH, json={"messages": "hi"})
    assert answer.status_code == 400
    assert set(answer.json()) == {"error"} and set(answer.json()["error"]) == set(
        components["ErrorDetail"]["properties"])


def test_schema_types_chat_messages_by_role_with_text_or_text_part_content(served):
    components = served_schema(served[0])["components"]["schemas"]
    messages = components["ChatCompletionRequest"]["properties"]["messages"]["items"]
    assert messages["discriminator"]["propertyName"] == "role"
    assert set(messages["discriminator"]["mapping"]) == {"system", "developer", "user",
                                                         "assistant", "tool"}
    content = components["UserMessage"]["properties"]["content"]["anyOf"]
    assert content == [{"type": "string"}, {"type": "array", "items": {
        "$ref": "#/components/schemas/TextContentPart"}}]
    assert "tool_calls" in components["AssistantMessage"]["properties"]
    assert "tool_call_id" in components["ToolMessage"]["properties"]


TYPED_CONVERSATION = [
    {"role": "system", "content": "Be brief.", "name": "rules"},
    {"role": "developer", "content": [{"type": "text", "text": "Use digits."}]},
    {"role": "user", "content": [{"type": "text", "text": "3*4"},
                                 {"type": "text", "text": "?", "cache_control": {}}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "multiply", "arguments": '{"a": 3, "b": 4}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "12"},
    {"role": "assistant", "content": "12", "reasoning_content": "3*4=12"},
]
# As the chat template reads them: what was sent, content as text, arguments decoded.
RENDERED_CONVERSATION = [
    {"role": "system", "content": "Be brief.", "name": "rules"},
    {"role": "developer", "content": "Use digits."},
    {"role": "user", "content": "3*4?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "12"},
    {"role": "assistant", "content": "12", "reasoning_content": "3*4=12"},
]


def test_typed_messages_reach_the_chat_template_as_sent():
    request = ChatCompletionRequest.model_validate({"messages": TYPED_CONVERSATION})
    assert request.conversation() == RENDERED_CONVERSATION


@pytest.mark.parametrize("message", [
    {"content": "no role"}, {"role": "robot", "content": "hi"}, {"role": "user"},
    {"role": "user", "content": 5},
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
    {"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]},
], ids=["no-role", "unknown-role", "no-content", "number", "image-part", "no-arguments"])
def test_malformed_messages_are_refused_with_400_naming_messages(served, message):
    url, engine = served
    answer = httpx.post(f"{url}/v1/chat/completions", headers=AUTH,
                        json={"messages": [message], "max_tokens": 2})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "messages"
    assert engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_top_logprobs_of_dropped_tokens_are_json(llama_dir, stream):
    """Found by the soak: top log-probs beyond top_k's kept set are -inf, which is not JSON;
    they are sent as vLLM's -9999.0, streamed or not, as are the rollouts' thresholds."""
    with running_server(llama_dir) as (url, engine):
        body = {"model": MODEL, "prompt": "The quick", "max_tokens": 4, "logprobs": 3,
                "top_k": 2, "stream": stream}
        response = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=60)
        assert response.status_code == 200
        if stream:
            chunks = [line[6:] for line in response.text.splitlines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
            tops = [entry for chunk in chunks for choice in json.loads(chunk)["choices"]
                    for entry in (choice["logprobs"] or {}).get("top_logprobs") or []]
        else:
            tops = response.json()["choices"][0]["logprobs"]["top_logprobs"]
        assert tops and all(sorted(top.values())[0] == -9999.0 for top in tops)
        rollout = httpx.post(f"{url}/v1/rollouts", headers=AUTH, timeout=60, json={
            "prompts": ["The quick"], "sampling_params": {"max_tokens": 3, "min_p": 1e-9,
                                                          "logprobs": 3}})
        assert rollout.status_code == 200, rollout.text
        completion = rollout.json()["outputs"][0]["outputs"][0]
        assert completion["sampling_thresholds"] == [-9999.0] * 3  # min_p drops nothing
