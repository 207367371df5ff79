"""vLLM's weight-transfer routes: ``/init_weight_transfer_engine``, ``/start_weight_update``,
``/update_weights`` and ``/finish_weight_update``, driving the server's ``WeightTransfer``.

Whoever may call them may replace the served weights, and makes the server connect to the
address an init names. So they are served only with ``enable_weight_transfer`` (else the
guard, middleware.py, answers 404 naming it), under the control key (the guard checks it),
and an init is refused (403) unless that address is among ``weight_transfer_allowed_hosts``,
before any connection is attempted.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from .allowed_hosts import AllowedHosts
from .errors import APIError
from .protocol import InitWeightTransferRequest, StartWeightUpdateRequest, UpdateWeightsRequest
from .state import TandemServer

# These routes, and their tag (their group in /openapi.json).
WEIGHT_TRANSFER_PATHS = frozenset({"/init_weight_transfer_engine", "/start_weight_update",
                                   "/update_weights", "/finish_weight_update"})
WEIGHT_TRANSFER_TAG = "weight transfer"


def weight_transfer_routes(server: TandemServer) -> APIRouter:
    """The router of the weight-transfer endpoints (``WEIGHT_TRANSFER_PATHS``, tagged
    ``WEIGHT_TRANSFER_TAG``); empty unless ``server.config.enable_weight_transfer``."""
    router = APIRouter(tags=[WEIGHT_TRANSFER_TAG])
    if not server.config.enable_weight_transfer:
        return router
    transfer = server.weight_transfer
    allowed_hosts = AllowedHosts.parse(server.config.weight_transfer_allowed_hosts)

    @router.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(body: InitWeightTransferRequest) -> dict[str, Any]:
        info = body.init_info
        if not allowed_hosts.allows(info.master_address):
            raise APIError(403, f"master_address {info.master_address!r} is not among this "
                           "server's weight-transfer hosts "
                           f"({server.config.weight_transfer_allowed_hosts}): a trainer there "
                           "could replace the served weights. To trust it, start the server "
                           "with --weight-transfer-allowed-hosts naming it (a host, an IP "
                           "address or a CIDR network; '*' for any).", param="master_address",
                           code="weight_transfer_host_not_allowed")
        await transfer.init(info.master_address, info.master_port, info.rank_offset,
                            info.world_size)
        return {"message": "weight transfer initialised"}

    @router.post("/start_weight_update")
    async def start_weight_update(body: StartWeightUpdateRequest | None = None
                                  ) -> dict[str, Any]:
        if body is not None and not body.is_checkpoint_format:
            raise APIError(400, "only checkpoint-format (Hugging Face) names are taken: send "
                           "is_checkpoint_format true.", param="is_checkpoint_format")
        transfer.start()
        return {"weight_version": server.engine.weight_version}

    @router.post("/update_weights")
    async def update_weights(body: UpdateWeightsRequest | None = None) -> dict[str, Any]:
        expected = None if body is None else body.update_info.expected()
        return {"weight_version": await transfer.update(expected)}

    @router.post("/finish_weight_update")
    async def finish_weight_update() -> dict[str, Any]:
        return {"weight_version": transfer.finish()}

    return router
