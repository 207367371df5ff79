"""The server's engine core on a thread and in a process of its own: served outputs equal
offline generation, streamed chunks add up to the whole answer, a stream that lags gets
every token that became ready in one chunk, and in a core process aborts, deadlines and a
dead core behave as the server promises."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest

from tandem.rollout import LLM, EngineConfig, LLMEngine, SamplingParams
from tandem.rollout.serving.async_engine import AsyncLLMEngine
from tandem.rollout.serving.config import ServerConfig
from tandem.rollout.serving.core_client import ThreadCore
from tandem.rollout.serving.metrics import ServerMetrics
from tandem.rollout.serving.responses import DeltaTracker
from tandem.rollout.serving.server import uvicorn_server

from .test_server import (
    API_KEY,
    AUTH,
    CONTROL_AUTH,
    CONTROL_OPTIONS,
    ENGINE_OPTIONS,
    HOST,
    LIMITS,
    MODEL,
    PROMPTS,
    _event,
    assert_equal_to_offline,
    collect,
    metric,
    openai_client,
    running_server,
)

CORES = ["thread", "process"]
LONG_ENGINE_OPTIONS = dict(num_kv_blocks=256, max_model_len=512)


@contextmanager
def running_process_server(folder, engine_options: dict | None = None,
                           **server_options) -> Iterator[tuple[str, object]]:
    """A server whose engine core has a process of its own (``engine_options``, default
    ``ENGINE_OPTIONS``), on a free port of 127.0.0.1, in a thread; its address and
    ``TandemServer``. Its control routes are served under ``CONTROL_KEY``."""
    config = ServerConfig(**{"api_key": API_KEY, "served_model_name": MODEL,
                             "engine_core": "process", **CONTROL_OPTIONS} | server_options)
    listener = socket.socket()
    listener.bind((HOST, 0))
    server = uvicorn_server(EngineConfig(model=str(folder),
                                         **(engine_options or ENGINE_OPTIONS)),
                            config, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://{HOST}:{listener.getsockname()[1]}", server.config.app.state.server
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module", params=CORES)
def served_core(request, llama_dir) -> Iterator[str]:
    """The address of a server whose core runs on a thread, or in a process."""
    if request.param == "thread":
        with running_server(llama_dir, **LIMITS) as (url, _):
            yield url
    else:
        with running_process_server(llama_dir, **LIMITS) as (url, _):
            yield url


@pytest.mark.parametrize("name,value", [("engine_core", "gpu"), ("api_nice", 20),
                                        ("api_nice", -1)])
def test_server_config_refuses_a_bad_engine_core_option_naming_the_field(name, value):
    with pytest.raises(ValueError, match=name):
        ServerConfig(**{name: value})


@pytest.fixture(scope="module")
def offline(llama_dir) -> LLM:
    return LLM(str(llama_dir), **ENGINE_OPTIONS)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_served_completions_equal_offline_generate(served_core, offline, stream):
    params = SamplingParams(n=4, max_tokens=24, seed=5, logprobs=2, stop=[" "])
    expected = offline.generate(PROMPTS, params, use_tqdm=False)
    # Groups whose completions end at different steps (a stop string, the length): a
    # stream then carries one completion's end while the others go on.
    assert {c.finish_reason for c in expected[0].outputs} == {"stop", "length"}
    response = openai_client(served_core).completions.create(
        model=MODEL, prompt=PROMPTS, n=4, max_tokens=24, seed=5, logprobs=2, stop=[" "],
        stream=stream, extra_body={"return_token_ids": True})
    chunks = response if stream else [response]
    assert_equal_to_offline(collect(chunks, lambda choice: choice.text), expected, n=4)


def test_streamed_chunks_add_up_to_the_whole_answer_with_stop_strings(served_core, offline):
    body = {"model": MODEL, "prompt": PROMPTS[1], "n": 3, "max_tokens": 40, "seed": 9,
            "stop": ["e", "th"], "temperature": 1.0}
    expected = offline.generate([PROMPTS[1]], SamplingParams(
        n=3, max_tokens=40, seed=9, stop=["e", "th"]), use_tqdm=False)[0]
    whole = httpx.post(f"{served_core}/v1/completions", headers=AUTH, json=body, timeout=60)
    with httpx.stream("POST", f"{served_core}/v1/completions", headers=AUTH, timeout=60,
                      json=body | {"stream": True}) as stream:
        events = [_event(line) for line in stream.iter_lines()]
    texts = {i: "" for i in range(3)}
    for event in filter(None, events):
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
    assert [c["text"] for c in whole.json()["choices"]] == list(texts.values())
    assert list(texts.values()) == [c.text for c in expected.outputs]


def test_a_lagging_stream_gets_every_ready_token_in_one_chunk(llama_dir):
    """The consumer reads nothing while tokens arrive (the engine is then frozen by
    ``pause(keep)``): its next output carries all of them, equal to the engine's own
    snapshot, and the deltas add up to the final output, equal to offline generation."""
    engine = LLMEngine(EngineConfig(model=str(llama_dir), **ENGINE_OPTIONS))
    params = SamplingParams(max_tokens=30, seed=2, logprobs=1, ignore_eos=True)

    async def run() -> tuple:
        async_engine = AsyncLLMEngine(ThreadCore(engine), ServerMetrics(MODEL, 256))
        async_engine.start()
        prompt = engine.process_prompt(PROMPTS[0])
        [tracked] = await async_engine.add_requests([prompt], [params], stream=True)
        while tracked.num_output_tokens < 3:
            await asyncio.sleep(0.001)
        await async_engine.pause("keep")
        reference = engine.request_output(tracked.request_id)
        outputs = async_engine.outputs(tracked)
        first = await anext(outputs)
        async_engine.resume()
        rest = [output async for output in outputs]
        await async_engine.shutdown()
        return reference, first, rest

    reference, first, rest = asyncio.run(run())
    expected = LLM(str(llama_dir), **ENGINE_OPTIONS).generate([PROMPTS[0]], params,
                                                              use_tqdm=False)[0].outputs[0]
    assert not first.finished and len(first.outputs[0].token_ids) >= 3
    for field in ("token_ids", "text", "logprobs", "top_logprobs", "weight_versions"):
        assert getattr(first.outputs[0], field) == getattr(reference.outputs[0], field)
    tracker = DeltaTracker(hold_back=0)
    deltas = [d for output in (first, *rest) for d in tracker.deltas(output)]
    assert "".join(d.text for d in deltas) == expected.text
    assert [t for d in deltas for t in d.token_ids] == expected.token_ids
    assert rest[-1].outputs[0].logprobs == pytest.approx(expected.logprobs, abs=1e-5)


def kv_blocks_used(url: str) -> float:
    return metric(url, "tandem:kv_cache_blocks_used")


def wait_until(condition, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def process_served(llama_dir) -> Iterator[str]:
    """A core-process server of its own (the tests here abort), for long sequences."""
    with running_process_server(llama_dir, LONG_ENGINE_OPTIONS) as (url, _):
        yield url


def test_a_core_process_frees_the_blocks_of_streams_whose_clients_left(process_served):
    url = process_served

    async def one(client: httpx.AsyncClient, i: int) -> str:
        async with client.stream("POST", f"{url}/v1/completions", headers=AUTH, json={
                "prompt": f"{i}: {PROMPTS[1]}", "max_tokens": 60, "ignore_eos": True,
                "seed": i, "stream": True}) as stream:
            lines = stream.aiter_lines()
            if i % 2 == 0:
                await anext(lines)
                return "left"
            events = [_event(line) async for line in lines]
        return [e for e in events if e][-1]["choices"][0]["finish_reason"]

    async def all_streams() -> list[str]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(one(client, i) for i in range(12)))

    assert asyncio.run(all_streams()) == ["left", "length"] * 6
    wait_until(lambda: kv_blocks_used(url) == 0)
    assert metric(url, "tandem:num_requests_running") == 0


def test_a_stream_past_its_deadline_ends_and_frees_its_blocks(process_served):
    url = process_served
    # 490 steps take far longer than 0.05 s (a step's host work alone is about 1 ms).
    with httpx.stream("POST", f"{url}/v1/completions", headers=AUTH, timeout=60, json={
            "prompt": PROMPTS[0], "max_tokens": 490, "ignore_eos": True, "stream": True,
            "timeout": 0.05}) as stream:
        *_, error, done = filter(None, stream.iter_lines())
    assert done == "data: [DONE]"
    assert _event(error)["error"]["code"] == 504
    wait_until(lambda: kv_blocks_used(url) == 0)
    answer = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=60,
                        json={"prompt": PROMPTS[0], "max_tokens": 3})
    assert answer.json()["choices"][0]["finish_reason"] == "length"


def test_a_dead_core_process_answers_503_and_ends_streams(llama_dir):
    with running_process_server(llama_dir, LONG_ENGINE_OPTIONS) as (url, server):
        with httpx.stream("POST", f"{url}/v1/completions", headers=AUTH, timeout=60, json={
                "prompt": PROMPTS[0], "max_tokens": 490, "ignore_eos": True,
                "stream": True}) as stream:
            lines = filter(None, stream.iter_lines())
            next(lines)
            assert httpx.post(f"{url}/pause", params={"mode": "keep"},
                              headers=CONTROL_AUTH).is_success
            server.async_engine.core.process.kill()
            *_, error, done = list(lines)
        health = httpx.get(f"{url}/health")
        answer = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=60,
                            json={"prompt": PROMPTS[0], "max_tokens": 3})
    assert done == "data: [DONE]" and _event(error)["error"]["code"] == 503
    assert health.status_code == 503 and answer.status_code == 503
    assert "engine core process died" in answer.json()["error"]["message"]
