"""The server under load and at its end: past ``max_num_waiting`` a request gets 503 with
Retry-After while every accepted one finishes; a request past its deadline is aborted (504,
or an error event then [DONE]) and leaves no KV block held; shutdown lets running requests
finish for at most ``shutdown_timeout``, aborts the rest, refuses new ones and exits 0."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from tandem.rollout import LLMEngine
from tandem.rollout.serving.config import ServerConfig

from .test_server import (
    AUTH,
    ENGINE_OPTIONS,
    PROMPTS,
    recorded_request_ids,
    running_uvicorn,
    serve_command,
    wait_until_idle,
)

STEP_SECONDS = 0.02  # each engine step slowed to this, so a long request stays running
LONG = {"max_tokens": 200, "ignore_eos": True}  # ~4 s at STEP_SECONDS a step


def slow_steps(engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every engine step take at least ``STEP_SECONDS``."""
    step = engine.step

    def slow_step():
        time.sleep(STEP_SECONDS)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)


def wait_for(condition: Callable[[], bool], seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.005)


def in_thread(post: Callable[[], httpx.Response]) -> Callable[[], httpx.Response]:
    """Start ``post`` in a thread; the returned call joins it and gives its answer."""
    answers: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: answers.append(post()))
    worker.start()

    def answer() -> httpx.Response:
        worker.join(60)
        return answers[0]

    return answer


def completion(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=60,
                      json={"prompt": PROMPTS[0], "max_tokens": 30, "ignore_eos": True} | body)


def assert_no_block_held(engine: LLMEngine) -> None:
    wait_until_idle(engine)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    stats = engine.stats()
    assert stats["kv_blocks_used"] == stats["num_running"] == stats["num_waiting"] == 0


def sse_events(lines: list[str]) -> list[dict | str]:
    """The ``data:`` payloads of a stream: each JSON event as a dict, ``[DONE]`` as is."""
    payloads = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


def test_past_max_num_waiting_new_requests_get_503_and_accepted_ones_all_finish(
        llama_dir, monkeypatch):
    options = ENGINE_OPTIONS | {"max_num_seqs": 2}
    with running_uvicorn(llama_dir, options, max_num_waiting=2) as (url, engine, server, _):
        admission = server.config.app.state.server.async_engine.admission
        slow_steps(engine, monkeypatch)
        request_ids = recorded_request_ids(engine, monkeypatch)
        running = in_thread(lambda: completion(url, n=2, max_tokens=60))  # fills the batch
        wait_for(lambda: request_ids and engine.num_output_tokens(request_ids[0]))
        group = in_thread(lambda: completion(url, n=2))  # a group waits as one request
        wait_for(lambda: admission.num_waiting == 1)
        single = in_thread(lambda: completion(url))
        wait_for(lambda: admission.num_waiting == 2)

        refused = completion(url, max_tokens=2)
        assert refused.status_code == 503 and refused.headers["Retry-After"].isdigit()
        error = refused.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert "max_num_waiting=2" in error["message"] and "--max-num-waiting" in error["message"]
        too_many = httpx.post(f"{url}/v1/rollouts", headers=AUTH, json={"prompts": ["a"] * 3})
        assert too_many.status_code == 400 and "--max-num-waiting" in too_many.text

        answers = [running(), group(), single()]
        assert [a.status_code for a in answers] == [200, 200, 200]
        assert [[c["finish_reason"] for c in a.json()["choices"]] for a in answers] == [
            ["length"] * 2, ["length"] * 2, ["length"]]
        assert_no_block_held(engine)
        assert admission.num_waiting == 0
        assert completion(url, max_tokens=2).status_code == 200


def test_a_request_arriving_during_a_step_joins_the_very_next_step(llama_dir, monkeypatch):
    """Its prompt is tokenized while the step runs, not after it, so its add is queued
    before the next step rather than behind it."""
    with running_uvicorn(llama_dir) as (url, engine, server, _):
        admission = server.config.app.state.server.async_engine.admission
        request_ids = recorded_request_ids(engine, monkeypatch)
        gate, gated, holding = threading.Event(), threading.Event(), threading.Event()
        scheduled: list[set[str]] = []  # the running requests after each step
        step = engine.step

        def gated_step():
            if holding.is_set():
                holding.clear()
                gated.set()
                gate.wait(30)
            outputs = step()
            scheduled.append({seq.request_id for seq in engine.scheduler.running})
            return outputs

        monkeypatch.setattr(engine, "step", gated_step)
        running = in_thread(lambda: completion(url, **LONG))
        try:
            wait_for(lambda: request_ids and engine.num_output_tokens(request_ids[0]))
            holding.set()
            wait_for(gated.is_set)
            arriving = in_thread(lambda: completion(url, prompt=PROMPTS[1], max_tokens=3))
            wait_for(lambda: admission.num_queued == 1, seconds=10)  # tokenized, being added
            time.sleep(0.2)
            gated_index = len(scheduled)
        finally:
            gate.set()
        assert arriving().status_code == 200
        assert request_ids[1] in scheduled[gated_index + 1]
        running()


def test_max_num_waiting_defaults_to_16_times_max_num_seqs(llama_dir):
    with running_uvicorn(llama_dir, ENGINE_OPTIONS | {"max_num_seqs": 4}) as (_, _, server, _):
        assert server.config.app.state.server.async_engine.admission.max_num_waiting == 64


@pytest.mark.parametrize("name,value", [("max_num_waiting", 0), ("request_timeout", 0),
                                        ("request_timeout", -1.0), ("shutdown_timeout", -1)])
def test_server_config_refuses_bad_bounds_naming_the_field(name, value):
    with pytest.raises(ValueError, match=name):
        ServerConfig(**{name: value})


def test_a_request_past_its_deadline_is_aborted_with_504_and_frees_its_blocks(llama_dir,
                                                                              monkeypatch):
    with running_uvicorn(llama_dir, request_timeout=0.4) as (url, engine, _, _):
        slow_steps(engine, monkeypatch)
        server_bound = completion(url, timeout=60, **LONG)  # the server's 0.4 s is smaller
        assert server_bound.status_code == 504, server_bound.text
        assert "0.4 s" in server_bound.json()["error"]["message"]
        assert_no_block_held(engine)
        own_bound = httpx.post(f"{url}/v1/rollouts", headers=AUTH, timeout=60, json={
            "prompts": PROMPTS, "sampling_params": {"n": 2, **LONG}, "timeout": 0.2})
        assert own_bound.status_code == 504 and "0.2 s" in own_bound.json()["error"]["message"]
        assert_no_block_held(engine)
        assert completion(url, max_tokens=3, timeout=30).status_code == 200
        assert completion(url, timeout=0).status_code == 400


def test_a_stream_past_its_deadline_ends_with_an_error_event_then_done(llama_dir,
                                                                     monkeypatch):
    with running_uvicorn(llama_dir) as (url, engine, _, _):
        slow_steps(engine, monkeypatch)
        with httpx.stream("POST", f"{url}/v1/chat/completions", headers=AUTH, timeout=60, json={
                "messages": [{"role": "user", "content": "Hi"}], "stream": True,
                "timeout": 0.5, **LONG}) as stream:
            assert stream.status_code == 200
            events = sse_events(list(stream.iter_lines()))
        *chunks, error, done = events
        assert done == "[DONE]" and chunks and all("choices" in c for c in chunks)
        assert error["error"]["code"] == 504 and "deadline" in error["error"]["message"]
        assert_no_block_held(engine)


def test_a_request_held_by_a_pause_past_its_deadline_is_refused_and_never_queued(
        llama_dir, monkeypatch):
    with running_uvicorn(llama_dir) as (url, engine, _, _):
        request_ids = recorded_request_ids(engine, monkeypatch)
        assert httpx.post(f"{url}/pause", params={"mode": "wait"},
                          headers=AUTH).status_code == 200
        assert completion(url, timeout=0.2).status_code == 504
        httpx.post(f"{url}/resume", headers=AUTH)
        assert request_ids == []


def test_shutdown_lets_running_requests_finish_within_the_bound_and_aborts_the_rest(
        llama_dir, monkeypatch):
    with running_uvicorn(llama_dir, shutdown_timeout=2) as (url, engine, server, thread):
        slow_steps(engine, monkeypatch)
        request_ids = recorded_request_ids(engine, monkeypatch)
        long = in_thread(lambda: completion(url, stream=True, **LONG))
        wait_for(lambda: request_ids and engine.num_output_tokens(request_ids[0]))
        short = in_thread(lambda: completion(url, max_tokens=10))
        # None once finished: a short request done before the shutdown is no failure.
        wait_for(lambda: len(request_ids) == 2 and engine.num_output_tokens(request_ids[1]) != 0)
        started = time.monotonic()
        server.should_exit = True  # what uvicorn's SIGTERM handler does
        thread.join(30)
        assert time.monotonic() - started < 2 + 3
        assert short().json()["choices"][0]["finish_reason"] == "length"
        *_, last, done = sse_events(long().text.splitlines())
        assert done == "[DONE]" and last["choices"][0]["finish_reason"] == "abort"
        with pytest.raises(httpx.TransportError):
            completion(url, max_tokens=2)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_sigterm_ends_the_serve_command_with_exit_0_and_every_stream_ended(llama_dir):
    with serve_command(llama_dir, "--max-model-len", "512", "--shutdown-timeout", "1") as (
            process, url):
        lines: list[str] = []

        def stream() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={
                    "prompt": PROMPTS[0], "max_tokens": 500, "ignore_eos": True,
                    "stream": True}) as response:
                lines.extend(response.iter_lines())

        worker = threading.Thread(target=stream)
        worker.start()
        wait_for(lambda: len(lines) >= 3)
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
        assert time.monotonic() - started < 1 + 10  # the bound, and an interpreter's exit
        worker.join(30)
        *_, last, done = sse_events(lines)
        assert done == "[DONE]" and last["choices"][0]["finish_reason"] in ("length", "abort")
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health")
