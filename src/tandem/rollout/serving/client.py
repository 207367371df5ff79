"""``TandemClient``: a trainer's handle on a ``tandem serve`` server, shaped like ``LLM``.

``generate`` and ``chat`` return ``RequestOutput``s as ``LLM`` does; ``update_weights``
pushes tensors over a torch.distributed group (``tandem.sync.WeightSender``, gloo on CPU,
NCCL across GPUs) while driving the server's weight-transfer endpoints. Generation sends the
inference key (the server's ``--api-key``); the engine controls (sleep, pause, weight
transfer) send the control key (its ``--control-api-key``). Only the standard library speaks
HTTP here, so a trainer needs no server dependencies.
"""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Collection, Iterable
from collections.abc import Sequence as Seq
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import torch

from tandem.sync import WeightSender, WeightUpdateError
from tandem.sync.distributed import DEFAULT_BUCKET_BYTES, DEFAULT_TIMEOUT

from ..outputs import RequestOutput
from ..sampling_params import SamplingParams

Prompt = str | list[int]


class ServerError(RuntimeError):
    """The server refused a call; ``status`` is the HTTP status, the message the server's."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class TandemClient:
    """Talks to one Tandem server.

    Args:
        base_url: e.g. ``http://127.0.0.1:8000``.
        api_key: the server's ``--api-key``, if it has one: sent on generation and the
            read-only routes.
        timeout: seconds to wait for any one HTTP call.
        control_api_key: the server's ``--control-api-key``, if it has one: sent on the
            routes that control the engine (sleep, wake up, pause, resume, reset the prefix
            cache, weight transfer), which a server without one guards with ``api_key``.
    """

    def __init__(self, base_url: str, api_key: str | None = None,
                 timeout: float = 600.0, *, control_api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.control_api_key = control_api_key
        self.timeout = timeout
        self.sender: WeightSender | None = None

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """``LLM.generate`` on the server: outputs in input order, with weight versions.

        Raises:
            ServerError: for a refused request (e.g. status 400 naming the invalid field).
        """
        if isinstance(sampling_params, SamplingParams):
            fields: Any = asdict(sampling_params)
        elif sampling_params is not None:
            fields = [asdict(p) for p in sampling_params]
        else:
            fields = None
        answer = self.post("/v1/rollouts", {"prompts": prompts, "sampling_params": fields})
        return [RequestOutput.from_dict(output) for output in answer["outputs"]]

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                       version: int | None = None, full: bool = True) -> int:
        """``LLM.update_weights`` across processes: returns the new weight version.

        Needs ``init_weight_transfer`` first. Generation goes on during the update; it
        commits between two steps.

        Raises:
            WeightUpdateError: when the engine refused the update (it keeps its weights).
            ServerError: when the server refused a call.
        """
        if self.sender is None:
            raise RuntimeError("call init_weight_transfer() before update_weights().")
        tensors = [(name, tensor.detach()) for name, tensor in named_tensors]
        self.post("/start_weight_update", {"is_checkpoint_format": True}, control=True)
        announced = {"names": [name for name, _ in tensors],
                     "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
                     "shapes": [list(t.shape) for _, t in tensors]}
        answers: list[int] = []
        try:
            self._alongside(lambda: answers.append(self.post(
                "/update_weights", {"update_info": announced},
                control=True)["weight_version"]),
                lambda: self.sender.send(tensors, version, full))
        finally:
            self.post("/finish_weight_update", control=True)
        return answers[0]

    def init_weight_transfer(self, master_address: str = "127.0.0.1", master_port: int = 0,
                             device: str | torch.device = "cpu",
                             bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                             timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        """Build this trainer's ``WeightSender`` (rank 0, hosting the group's store on
        ``master_address:master_port``) and have the server join it as rank 1.

        ``master_port`` 0 picks a free port. ``device`` is where tensors are packed (CPU:
        gloo). The server must run with ``--enable-weight-transfer``.
        """
        port = master_port or _free_port(master_address)
        init_info = {"master_address": master_address, "master_port": port,
                     "rank_offset": 1, "world_size": 2}
        senders: list[WeightSender] = []
        self._alongside(
            lambda: self.post("/init_weight_transfer_engine", {"init_info": init_info},
                              control=True),
            lambda: senders.append(WeightSender(master_address, port, 2, device,
                                                bucket_bytes, timeout)))
        self.sender = senders[0]

    def sleep(self, level: int = 1) -> None:
        """Put the server to sleep at vLLM's ``level`` (1: weights to CPU, KV pool freed;
        2: both discarded, a full weight update must follow) while the trainer steps."""
        self.post(f"/sleep?level={level}", control=True)

    def release_kv_cache_memory(self) -> None:
        """Free the server's KV pool alone (its weights stay) until ``wake_up``."""
        self.post("/release_kv_cache_memory", control=True)

    def wake_up(self, tags: Collection[str] | None = None) -> None:
        """Restore what ``sleep`` freed (``tags``: only ``weights`` or ``kv_cache``)."""
        query = urllib.parse.urlencode([("tags", tag) for tag in tags or []])
        self.post(f"/wake_up?{query}" if query else "/wake_up", control=True)

    def reset_prefix_cache(self) -> None:
        """Forget the server's cached prefix blocks."""
        self.post("/reset_prefix_cache", control=True)

    def pause(self, mode: str = "abort") -> None:
        """Pause generation (``abort``, ``wait`` or ``keep`` the requests in flight)."""
        self.post(f"/pause?mode={mode}", control=True)

    def resume(self) -> None:
        """Resume generation after ``pause``."""
        self.post("/resume", control=True)

    def server_info(self) -> dict[str, Any]:
        """The server's model, weight version, limits and engine configuration."""
        return self.get("/server_info")

    def get(self, path: str) -> Any:
        """GET ``path``; the JSON answer.

        Raises:
            ServerError: for an error status.
        """
        return self._call(urllib.request.Request(self.base_url + path, method="GET"))

    def post(self, path: str, payload: dict[str, Any] | None = None,
             control: bool = False) -> Any:
        """POST ``payload`` as JSON to ``path`` (with the control key when ``control``, for
        a route that controls the engine); the JSON answer.

        Raises:
            ServerError: for an error status.
        """
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(self.base_url + path, data=data, method="POST",
                                         headers={"Content-Type": "application/json"})
        return self._call(request, control)

    def _call(self, request: urllib.request.Request, control: bool = False) -> Any:
        key = self.control_api_key if control and self.control_api_key is not None \
            else self.api_key
        if key is not None:
            request.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                body = response.read()
        except urllib.error.HTTPError as exc:
            raise _refusal(exc.code, exc.read()) from None
        return json.loads(body) if body else None

    def _alongside(self, http_call: Callable[[], Any], torch_call: Callable[[], Any]) -> None:
        """Run ``torch_call`` (which waits for the server's side) in a thread while
        ``http_call`` runs here.

        An HTTP error is raised at once: the thread then ends at the group's timeout.
        """
        errors: list[BaseException] = []

        def run() -> None:
            try:
                torch_call()
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        http_call()
        thread.join()
        if errors:
            raise errors[0]


def _refusal(status: int, body: bytes) -> Exception:
    """The exception for an error answer: ``WeightUpdateError`` for a refused update (the
    engine keeps its weights), else ``ServerError``."""
    try:
        error = json.loads(body)["error"]
        message, error_type = error["message"], error["type"]
    except (ValueError, KeyError, TypeError):
        message, error_type = body.decode(errors="replace"), None
    if error_type == "weight_update_error":
        return WeightUpdateError(message)
    return ServerError(status, message)


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]
