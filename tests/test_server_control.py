"""Only the trainer controls the engine: the routes that sleep, wake, pause, resume or reset
it, and the weight-transfer ones, are served only when asked for (else 404 naming the
option, and absent from /openapi.json), want a control key of their own (401 without a
valid key, 403 with the inference key), and a server that serves them beyond loopback
without that key refuses to start."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator

import httpx
import pytest

from tandem.cli import build_parser
from tandem.cli.arguments import config_from_arguments
from tandem.rollout import LLM, SamplingParams
from tandem.rollout.serving.client import ServerError, TandemClient
from tandem.rollout.serving.config import ServerConfig
from tandem.rollout.serving.middleware import GuardMiddleware
from tandem.rollout.serving.rl_routes import CONTROL_PATHS, CONTROL_TAG
from tandem.rollout.serving.weight_transfer_routes import (
    WEIGHT_TRANSFER_PATHS,
    WEIGHT_TRANSFER_TAG,
)

from .test_server import (
    API_KEY,
    AUTH,
    CONTROL_AUTH,
    CONTROL_KEY,
    CONTROL_OPTIONS,
    ENGINE_OPTIONS,
    MODEL,
    PROMPTS,
    running_server,
    wait_until_idle,
)

# Each control route with a harmless request (pause "wait" returns at once when idle).
CONTROL_REQUESTS = {"/reset_prefix_cache": {}, "/sleep": {"level": 1},
                    "/release_kv_cache_memory": {}, "/wake_up": {}, "/pause": {"mode": "wait"},
                    "/resume": {}}
INFO_PATHS = ("/is_sleeping", "/is_paused", "/server_info", "/get_world_size")
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def completion(url: str, headers: dict = AUTH) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers=headers, timeout=60, json={
        "model": MODEL, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0,
        "ignore_eos": True})


def served_schema(url: str) -> dict:
    return httpx.get(f"{url}/openapi.json", headers=AUTH).json()


@pytest.fixture(scope="module")
def controlled(llama_dir) -> Iterator[tuple[str, object]]:
    """A trainer's server: control and weight-transfer routes served under the control key."""
    with running_server(llama_dir, enable_weight_transfer=True, **CONTROL_OPTIONS) as served:
        yield served


@pytest.fixture(scope="module")
def offline_text(llama_dir) -> str:
    """The greedy completion of ``PROMPTS[0]``, offline (the independent reference)."""
    llm = LLM(str(llama_dir), **ENGINE_OPTIONS)
    return llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].text


def test_control_routes_are_off_by_default_and_answer_404_naming_the_option(llama_dir):
    assert ServerConfig().enable_control_routes is False
    assert ServerConfig().enable_weight_transfer is False
    with running_server(llama_dir, enable_control_routes=False) as (url, engine):
        off = {path: httpx.post(f"{url}{path}", headers=AUTH, params=params)
               for path, params in CONTROL_REQUESTS.items()}
        transfer_off = {path: httpx.post(f"{url}{path}", headers=AUTH, json={})
                        for path in WEIGHT_TRANSFER_PATHS}
        keyless = httpx.post(f"{url}/sleep")
        info = {path: httpx.get(f"{url}{path}", headers=AUTH) for path in INFO_PATHS}
        documented = set(served_schema(url)["paths"])
        assert not engine.is_sleeping
    for option, answers in (("--enable-control-routes", off),
                            ("--enable-weight-transfer", transfer_off)):
        for path, answer in answers.items():
            assert answer.status_code == 404, (path, answer.text)
            error = answer.json()["error"]
            assert error["code"] == "route_not_served" and option in error["message"], path
    assert keyless.status_code == 401  # as any route: the key comes first
    assert all(answer.status_code == 200 for answer in info.values())
    assert not documented & (CONTROL_PATHS | WEIGHT_TRANSFER_PATHS)
    assert set(INFO_PATHS) <= documented


@pytest.mark.parametrize("path", sorted(CONTROL_PATHS | WEIGHT_TRANSFER_PATHS))
def test_the_inference_key_gets_403_naming_the_control_key_and_no_key_401(controlled, path):
    url, engine = controlled
    with_inference_key = httpx.post(f"{url}{path}", headers=AUTH, params=CONTROL_REQUESTS.get(
        path, {}), json={})
    without_key = httpx.post(f"{url}{path}", json={})
    with_wrong_key = httpx.post(f"{url}{path}", json={},
                                headers={"Authorization": "Bearer wrong"})
    assert with_inference_key.status_code == 403, with_inference_key.text
    error = with_inference_key.json()["error"]
    assert error["code"] == "control_key_required" and "--control-api-key" in error["message"]
    for answer in (without_key, with_wrong_key):
        assert answer.status_code == 401 and answer.headers["www-authenticate"] == "Bearer"
        assert "--control-api-key" in answer.json()["error"]["message"]
    assert not engine.is_sleeping


def test_the_inference_key_cannot_sleep_release_or_pause_the_engine_for_everyone(
        controlled, offline_text):
    """Found by a fuzzer holding the API key: /release_kv_cache_memory left the server
    answering 409 to every client. Now such a call is refused and generation goes on."""
    url, engine = controlled
    for path, params in (("/sleep", {"level": 2}), ("/release_kv_cache_memory", {}),
                         ("/pause", {"mode": "keep"})):
        assert httpx.post(f"{url}{path}", headers=AUTH, params=params).status_code == 403
    assert not engine.is_sleeping and not engine.weights_stale
    assert httpx.get(f"{url}/is_paused", headers=AUTH).json() == {"is_paused": False}
    answer = completion(url)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == offline_text


def test_the_control_key_drives_a_round_trip_and_generation_works_after(controlled,
                                                                        offline_text):
    url, engine = controlled

    def control(path: str, **params) -> int:
        return httpx.post(f"{url}{path}", headers=CONTROL_AUTH, params=params,
                          timeout=60).status_code

    assert control("/sleep", level=1) == 200
    assert httpx.get(f"{url}/is_sleeping", headers=AUTH).json() == {"is_sleeping": True}
    assert completion(url).status_code == 409
    assert control("/wake_up") == 200 and control("/reset_prefix_cache") == 200
    assert control("/release_kv_cache_memory") == 200 and engine.is_sleeping
    assert control("/wake_up", tags="kv_cache") == 200 and not engine.is_sleeping
    assert control("/pause", mode="wait") == 200
    assert httpx.get(f"{url}/is_paused", headers=AUTH).json() == {"is_paused": True}
    assert control("/resume") == 200
    answer = completion(url)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == offline_text
    # Past the guard, a weight-transfer call meets the transfer's own state (no group yet).
    assert httpx.post(f"{url}/start_weight_update", headers=CONTROL_AUTH,
                      json={"is_checkpoint_format": True}).status_code == 409
    wait_until_idle(engine)


def test_the_control_key_opens_only_the_control_routes(controlled):
    url, _ = controlled
    assert completion(url, CONTROL_AUTH).status_code == 401
    assert httpx.get(f"{url}/is_sleeping", headers=CONTROL_AUTH).status_code == 401


def test_the_client_sends_the_control_key_on_controls_and_the_api_key_on_generation(
        controlled, offline_text):
    url, engine = controlled
    trainer = TandemClient(url, api_key=API_KEY, control_api_key=CONTROL_KEY)
    trainer.sleep(level=1)
    assert engine.is_sleeping
    trainer.wake_up()
    trainer.reset_prefix_cache()
    trainer.pause(mode="wait")
    trainer.resume()
    assert trainer.generate(PROMPTS[:1], GREEDY)[0].outputs[0].text == offline_text
    info = trainer.server_info()["server_config"]
    assert info["control_api_key_set"] is True and "control_api_key" not in info
    assert CONTROL_KEY not in json.dumps(info) and API_KEY not in json.dumps(info)
    with pytest.raises(ServerError, match="--control-api-key") as refused:
        TandemClient(url, api_key=API_KEY).sleep(level=2)
    assert refused.value.status == 403 and not engine.is_sleeping


def test_schema_lists_the_control_routes_under_their_own_security_scheme(controlled):
    schema = served_schema(controlled[0])
    tagged = {tag: {path for path, item in schema["paths"].items()
                    for operation in item.values() if tag in operation.get("tags", ())}
              for tag in (CONTROL_TAG, WEIGHT_TRANSFER_TAG)}
    assert tagged == {CONTROL_TAG: CONTROL_PATHS, WEIGHT_TRANSFER_TAG: WEIGHT_TRANSFER_PATHS}
    assert set(schema["components"]["securitySchemes"]) == {"APIKey", "ControlKey"}
    for path, item in schema["paths"].items():
        for operation in item.values():
            control = path in CONTROL_PATHS | WEIGHT_TRANSFER_PATHS
            wanted = [] if path in ("/health", "/metrics", "/tokenize", "/detokenize") else [
                {"ControlKey" if control else "APIKey": []}]
            assert operation.get("security", []) == wanted, path
            assert ("403" in operation["responses"]) is control, path


def test_without_a_control_key_on_loopback_the_api_key_guards_them_with_a_warning(
        llama_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="tandem.rollout.serving.server"):
        with running_server(llama_dir, enable_control_routes=True) as (url, engine):
            slept = httpx.post(f"{url}/sleep", headers=AUTH)
            keyless = httpx.post(f"{url}/wake_up")
            woke = httpx.post(f"{url}/wake_up", headers=AUTH)
            schema = served_schema(url)
    assert (slept.status_code, keyless.status_code, woke.status_code) == (200, 401, 200)
    assert not engine.is_sleeping
    assert "without --control-api-key" in caplog.text
    assert schema["paths"]["/sleep"]["post"]["security"] == [{"APIKey": []}]


def guard_answers(guard: GuardMiddleware, path: str, key: str | None) -> int:
    """The status ``guard`` answers a POST of ``path`` with ``key`` as its Bearer key."""
    headers = [] if key is None else [(b"authorization", f"Bearer {key}".encode())]
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    asyncio.run(guard(scope, receive, send))
    return sent[0]["status"]


async def answer_200(scope: dict, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


@pytest.mark.parametrize("api_key, path, key, status", [
    (API_KEY, "/sleep", CONTROL_KEY, 200), (API_KEY, "/sleep", API_KEY, 403),
    (API_KEY, "/sleep", None, 401), (API_KEY, "/v1/completions", CONTROL_KEY, 401),
    (API_KEY, "/v1/completions", API_KEY, 200), (API_KEY, "/health", None, 200),
    (API_KEY, "/update_weights", API_KEY, 404),
    # Without an API key generation is open, and the control routes still want theirs.
    (None, "/v1/completions", None, 200), (None, "/sleep", None, 401),
    (None, "/sleep", "anything", 401), (None, "/sleep", CONTROL_KEY, 200),
])
def test_the_guard_maps_each_path_to_the_key_it_wants(api_key, path, key, status):
    guard = GuardMiddleware(answer_200, api_key, 1024, control_api_key=CONTROL_KEY,
                            control_paths=CONTROL_PATHS,
                            unserved_paths=dict.fromkeys(WEIGHT_TRANSFER_PATHS,
                                                         "--enable-weight-transfer"))
    assert guard_answers(guard, path, key) == status


@pytest.mark.parametrize("host", ["0.0.0.0", "10.0.0.5", "::", "trainer-0.cluster", ""])
@pytest.mark.parametrize("option", ["enable_control_routes", "enable_weight_transfer"])
def test_serving_controls_beyond_loopback_without_a_control_key_is_refused(host, option):
    with pytest.raises(ValueError, match="needs control_api_key.*--control-api-key"):
        ServerConfig(host=host, api_key=API_KEY, **{option: True})
    assert ServerConfig(host=host, api_key=API_KEY, control_api_key=CONTROL_KEY,
                        **{option: True}).control_api_key == CONTROL_KEY


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost", "LocalHost"])
def test_serving_controls_on_loopback_without_a_control_key_is_allowed(host):
    assert ServerConfig(host=host, enable_control_routes=True,
                        enable_weight_transfer=True).control_api_key is None


@pytest.mark.parametrize("control_api_key", ["", API_KEY])
def test_a_control_key_that_is_empty_or_the_api_key_is_refused(control_api_key):
    with pytest.raises(ValueError, match="control_api_key is invalid"):
        ServerConfig(api_key=API_KEY, control_api_key=control_api_key)


def test_serve_takes_the_control_options_and_never_shows_the_keys(llama_dir):
    args = build_parser().parse_args(["serve", str(llama_dir), "--host", "0.0.0.0",
                                      "--api-key", "k", "--enable-control-routes",
                                      "--control-api-key", "c"])
    config = config_from_arguments(ServerConfig, args)
    assert (config.enable_control_routes, config.control_api_key) == (True, "c")
    assert "'c'" not in repr(config) and "'k'" not in repr(config)
