"""``tandem serve``: an OpenAI-compatible HTTP server with RL and weight-transfer endpoints.

``build_app`` puts the pieces together: the guard (API key, body size) around every
request, the error handlers, and three groups of routes sharing one ``TandemServer``:
``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``
(``openai_routes``); ``/v1/rollouts`` (Tandem's: ``LLM.generate``'s shapes over HTTP),
``/reset_prefix_cache``, ``/sleep``, ``/wake_up``, ``/is_sleeping``, ``/pause``, ``/resume``,
``/is_paused``, ``/server_info``, ``/get_world_size`` (``rl_routes``); and, with
``enable_weight_transfer``, ``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update`` (``weight_transfer_routes``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI

from ..engine import LLMEngine
from .config import ServerConfig
from .errors import add_error_handlers
from .middleware import GuardMiddleware
from .openai_routes import openai_routes
from .rl_routes import rl_routes
from .state import TandemServer
from .weight_transfer_routes import weight_transfer_routes


def build_app(engine: LLMEngine, config: ServerConfig) -> FastAPI:
    """The FastAPI application serving ``engine`` (start with uvicorn, or ``serve``)."""
    server = TandemServer(engine, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.async_engine.start()
        yield
        await server.async_engine.shutdown()

    app = FastAPI(title="Tandem", lifespan=lifespan)
    app.state.server = server
    open_paths = {"/health"} | (set() if config.metrics_require_api_key else {"/metrics"})
    app.add_middleware(GuardMiddleware, api_key=config.api_key,
                       max_body_bytes=config.max_body_bytes, open_paths=frozenset(open_paths))
    add_error_handlers(app)
    for routes in (openai_routes, rl_routes, weight_transfer_routes):
        app.include_router(routes(server))
    return app


def serve(engine: LLMEngine, config: ServerConfig) -> None:
    """Serve ``engine`` until interrupted (uvicorn on ``config.host:config.port``)."""
    uvicorn.run(build_app(engine, config), host=config.host, port=config.port,
                log_level="info", timeout_graceful_shutdown=5)
