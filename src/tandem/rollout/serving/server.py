"""``tandem serve``: an OpenAI-compatible HTTP server with RL and weight-transfer endpoints.

``build_app`` puts the pieces together: the guard (which key each path wants, body size)
around every request, the error handlers, and the groups of routes sharing one
``TandemServer``: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
``/health``, ``/metrics`` (``openai_routes``); ``/tokenize``, ``/detokenize``
(``tokenize_routes``); ``/v1/rollouts`` (Tandem's:
``LLM.generate``'s shapes over HTTP), ``/is_sleeping``, ``/is_paused``, ``/server_info``,
``/get_world_size`` (``rl_routes``); and the routes that control the engine, under the
control key: with ``enable_control_routes``, ``/reset_prefix_cache``, ``/sleep``,
``/release_kv_cache_memory``, ``/wake_up``, ``/pause``, ``/resume`` (``control_routes``),
with ``enable_weight_transfer``, ``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights``, ``/finish_weight_update`` (``weight_transfer_routes``). Its
``/openapi.json`` says what it answers (openapi.py).

``serve`` shuts down gracefully on SIGTERM: uvicorn stops listening, the loop refuses new
requests (503) and gives the running ones ``shutdown_timeout`` seconds, then aborts the rest
(their streams end with finish_reason "abort" and [DONE]), and the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

import uvicorn
from fastapi import FastAPI

from ..config import EngineConfig
from ..engine import LLMEngine
from .async_engine import AsyncLLMEngine
from .config import ServerConfig
from .errors import add_error_handlers
from .middleware import GuardMiddleware
from .openai_routes import openai_routes
from .openapi import install_openapi
from .rl_routes import CONTROL_PATHS, control_routes, rl_routes
from .state import TandemServer
from .tokenize_routes import tokenize_routes
from .weight_transfer_routes import WEIGHT_TRANSFER_PATHS, weight_transfer_routes

# uvicorn's own deadline, past the drain's: the aborted requests' last bytes get written.
SHUTDOWN_MARGIN_SECONDS = 5.0

logger = logging.getLogger(__name__)


def build_app(engine: LLMEngine | EngineConfig, config: ServerConfig) -> FastAPI:
    """The FastAPI application serving ``engine``: an engine, stepped by a core on a thread
    of this process, or the configuration of one its core builds (in a process of its own
    unless ``config.engine_core`` is "thread"). Start it with uvicorn, or ``serve``.

    Raises:
        Exception: what building the engine raised.
    """
    server = TandemServer(engine, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await server.start()
        yield
        await server.shutdown()

    app = FastAPI(title="Tandem", lifespan=lifespan)
    app.state.server = server
    _guard(app, config)
    add_error_handlers(app)
    app.include_router(control_routes(server))
    for routes in (openai_routes, tokenize_routes, rl_routes, weight_transfer_routes):
        app.include_router(routes(server))
    return app


def _guard(app: FastAPI, config: ServerConfig) -> None:
    """Put the guard around ``app`` and have its schema say which key each path wants: none
    for /health, /tokenize and /detokenize (and /metrics unless ``metrics_require_api_key``),
    as vLLM's server guards only its /v1 routes (its benchmark client calls /tokenize
    without a key), the control key for the served routes that control the engine, the API
    key for the rest. A control group not served answers 404 naming the option that serves
    it."""
    open_paths = frozenset({"/health", "/tokenize", "/detokenize"}
                           | (set() if config.metrics_require_api_key else {"/metrics"}))
    control_paths, unserved_paths = set(), {}
    for paths, served, option in (
            (CONTROL_PATHS, config.enable_control_routes, "--enable-control-routes"),
            (WEIGHT_TRANSFER_PATHS, config.enable_weight_transfer, "--enable-weight-transfer")):
        if served:
            control_paths |= paths
        else:
            unserved_paths |= dict.fromkeys(paths, option)
    if control_paths and config.control_api_key is None:
        logger.warning("The engine-control routes are served without --control-api-key (on "
                       "loopback only): any client of this machine holding --api-key (or any, "
                       "without it) can sleep, pause or re-weight the engine.")
    app.add_middleware(GuardMiddleware, api_key=config.api_key,
                       max_body_bytes=config.max_body_bytes, open_paths=open_paths,
                       control_api_key=config.control_api_key,
                       control_paths=frozenset(control_paths), unserved_paths=unserved_paths)
    install_openapi(app, config.api_key is not None, open_paths, frozenset(control_paths),
                    control_guarded=config.control_api_key is not None)


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose shutdown drains the engine first: it stops listening, the
    loop refuses new requests, the running ones get ``shutdown_timeout`` seconds and the
    rest are aborted, so every response ends before uvicorn closes the connections.

    Args:
        config: uvicorn's configuration (its ``timeout_graceful_shutdown`` the backstop).
        async_engine: the loop to drain.
        shutdown_timeout: seconds the running requests get.
    """

    def __init__(self, config: uvicorn.Config, async_engine: AsyncLLMEngine,
                 shutdown_timeout: float) -> None:
        super().__init__(config)
        self.async_engine = async_engine
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Drain (concurrently with uvicorn's wait for the connections), then uvicorn's
        shutdown: close the connections, run the lifespan's end."""
        drain = asyncio.ensure_future(self.async_engine.drain(self.shutdown_timeout))
        try:
            await super().shutdown(sockets)
        finally:
            drain.cancel()


def uvicorn_server(engine: LLMEngine | EngineConfig, config: ServerConfig,
                   log_level: str = "info") -> DrainingServer:
    """The uvicorn server of ``build_app(engine, config)`` on ``config.host:config.port``,
    draining on shutdown (start it with ``run()``, or ``run(sockets=...)``)."""
    app = build_app(engine, config)
    uvicorn_config = uvicorn.Config(
        app, host=config.host, port=config.port, log_level=log_level,
        timeout_graceful_shutdown=config.shutdown_timeout + SHUTDOWN_MARGIN_SECONDS)
    return DrainingServer(uvicorn_config, app.state.server.async_engine,
                          config.shutdown_timeout)


def serve(engine: LLMEngine | EngineConfig, config: ServerConfig) -> None:
    """Serve ``engine`` on ``config.host:config.port`` until SIGTERM or Ctrl-C, then shut
    down gracefully (``DrainingServer``) and return."""
    with _sigterm_returns():
        uvicorn_server(engine, config).run()


@contextmanager
def _sigterm_returns() -> Iterator[None]:
    """Make a SIGTERM that uvicorn handled end ``serve`` normally (so the process exits 0).

    After a graceful shutdown uvicorn raises the signal again under the handler it found;
    Python's default handler would then kill the process (exit 143). uvicorn installs its
    own handler while it serves, so this one only ever sees that second signal.
    """
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
