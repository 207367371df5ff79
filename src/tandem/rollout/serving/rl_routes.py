"""Tandem's RL routes: ``/v1/rollouts`` (``LLM.generate``'s shapes over HTTP) and the
engine's state, read-only (``/is_sleeping``, ``/is_paused``, ``/server_info``,
``/get_world_size``), under the API key; and vLLM's engine controls a trainer drives between
steps (``/reset_prefix_cache``, ``/sleep``, ``/release_kv_cache_memory``, ``/wake_up``,
``/pause``, ``/resume``), served only with ``enable_control_routes`` and under the control
key (the guard, middleware.py, checks both)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request

from .errors import error_responses
from .protocol import RolloutRequest
from .responses import json_safe
from .state import TandemServer

# The routes that control the engine, and their tag (their group in /openapi.json).
CONTROL_PATHS = frozenset({"/reset_prefix_cache", "/sleep", "/release_kv_cache_memory",
                           "/wake_up", "/pause", "/resume"})
CONTROL_TAG = "engine control"


def rl_routes(server: TandemServer) -> APIRouter:
    """The router of the RL endpoints a generation client calls (rollouts, the engine's
    state), answering from ``server``."""
    router = APIRouter()
    for group in (_rollout_routes, _info_routes):
        router.include_router(group(server))
    return router


def control_routes(server: TandemServer) -> APIRouter:
    """The router of the endpoints that control ``server``'s engine (``CONTROL_PATHS``: sleep,
    wake up, pause, resume, reset the prefix cache), tagged ``CONTROL_TAG``; empty unless
    ``server.config.enable_control_routes``."""
    router = APIRouter(tags=[CONTROL_TAG])
    if not server.config.enable_control_routes:
        return router
    for group in (_sleep_routes, _pause_routes):
        router.include_router(group(server))
    return router


def _rollout_routes(server: TandemServer) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/rollouts", responses=error_responses(409, 503, 504))
    async def rollouts(body: RolloutRequest, request: Request) -> dict[str, Any]:
        prompts = body.prompt_list()
        params = body.sampling_params_per_prompt(len(prompts))
        for p in params:
            server.check_limits(p)
        processed = await server.process_prompts(prompts)
        outputs = await server.generate(request, processed, params, "rollout", body.timeout)
        return json_safe({"outputs": [o.to_dict() for o in outputs],
                          "weight_version": server.engine.weight_version})

    return router


def _sleep_routes(server: TandemServer) -> APIRouter:
    router = APIRouter()
    async_engine = server.async_engine

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, Any]:
        await async_engine.call("reset_prefix_cache")
        return {}

    @router.post("/sleep")
    async def sleep(level: Annotated[int, Query(ge=1, le=2, description=(
            "vLLM's: 1 moves the weights to CPU and frees the KV pool, 2 discards both (a "
            "full weight update must follow)."))] = 1) -> dict[str, Any]:
        await async_engine.call("sleep", level)
        return {}

    @router.post("/release_kv_cache_memory")
    async def release_kv_cache_memory() -> dict[str, Any]:
        await async_engine.call("release_kv_cache_memory")
        return {}

    @router.post("/wake_up")
    async def wake_up(request: Request) -> dict[str, Any]:
        await async_engine.call("wake_up", request.query_params.getlist("tags") or None)
        return {}

    return router


def _pause_routes(server: TandemServer) -> APIRouter:
    router = APIRouter()
    async_engine = server.async_engine

    @router.post("/pause")
    async def pause(mode: str = "abort") -> dict[str, Any]:
        await async_engine.pause(mode)
        return {}

    @router.post("/resume")
    async def resume() -> dict[str, Any]:
        async_engine.resume()
        return {}

    return router


def _info_routes(server: TandemServer) -> APIRouter:
    router = APIRouter()
    engine, async_engine = server.engine, server.async_engine

    @router.get("/is_sleeping")
    async def is_sleeping() -> dict[str, Any]:
        return {"is_sleeping": engine.is_sleeping}

    @router.get("/is_paused")
    async def is_paused() -> dict[str, Any]:
        return {"is_paused": async_engine.is_paused}

    @router.get("/server_info")
    async def server_info() -> dict[str, Any]:
        engine_config = {k: str(v) if not isinstance(v, int | float | bool | None) else v
                         for k, v in asdict(engine.config).items()}
        return {"model": server.model_name, "max_model_len": engine.max_model_len,
                "weight_version": engine.weight_version, "world_size": 1,
                "engine_config": engine_config,
                "server_config": _public_server_config(server)}

    @router.get("/get_world_size")
    async def get_world_size() -> dict[str, Any]:
        return {"world_size": 1}

    return router


def _public_server_config(server: TandemServer) -> dict[str, Any]:
    """The server's configuration without its keys: whether each is set instead."""
    config = asdict(server.config)
    keys = ("api_key", "control_api_key")
    return ({k: v for k, v in config.items() if k not in keys}
            | {f"{key}_set": config[key] is not None for key in keys})
