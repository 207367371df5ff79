"""The driver-to-worker messages of a tensor-parallel engine: JSON and tensors, never pickles.

A message is an operation name and a payload of JSON values, tensors and the dataclasses of
a step's attention metadata. ``send`` (the driver) broadcasts a JSON header describing it
(tensors and dataclasses replaced by typed placeholders), then each tensor; ``receive`` (a
worker) rebuilds the payload from them, its tensors in host memory. The worker's runner puts
each where it is used: a step's through pinned memory (``StepInputs.on_device``), since a
plain copy to a CUDA device would wait for the step queued there before. Only the
dataclasses in ``DATACLASSES`` travel, so a message can name no other code. A worker waits
for a message without a time limit (``IDLE_TIMEOUT``); once one has begun, every part of it
is bounded by the group's timeout.
"""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tandem.kernels.attention import AttentionMetadata, BlockRuns, CascadeLayout

# A worker waits this long for the next message (an engine may idle for hours between
# requests); everything after the header's length is bounded by the group's own timeout. A
# driver that dies closes its connections, which ends the wait at once.
IDLE_TIMEOUT = timedelta(days=30)
DATACLASSES = {cls.__name__: cls for cls in (AttentionMetadata, BlockRuns, CascadeLayout)}
DTYPES = {str(dtype): dtype for dtype in (torch.int32, torch.int64, torch.float32,
                                          torch.bfloat16, torch.float16, torch.uint8,
                                          torch.bool)}


def send(group: Any, op: str, payload: dict[str, Any]) -> None:
    """Broadcast ``op`` and ``payload`` from rank 0 of ``group``."""
    tensors: list[torch.Tensor] = []
    header = json.dumps({"op": op, "payload": _encode(payload, tensors)}).encode()
    _broadcast(group, torch.tensor([len(header)], dtype=torch.int64))
    _broadcast(group, torch.frombuffer(bytearray(header), dtype=torch.uint8))
    for tensor in tensors:
        _broadcast(group, tensor.contiguous().cpu())


def receive(group: Any) -> tuple[str, dict[str, Any]]:
    """The next message broadcast by rank 0 of ``group``, its tensors in host memory."""
    length = torch.empty(1, dtype=torch.int64)
    _broadcast(group, length, IDLE_TIMEOUT)
    raw = torch.empty(int(length.item()), dtype=torch.uint8)
    _broadcast(group, raw)
    message = json.loads(raw.numpy().tobytes())
    return message["op"], _decode(message["payload"], group)


def _broadcast(group: Any, tensor: torch.Tensor, timeout: timedelta | None = None) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    if timeout is not None:
        options.timeout = timeout
    group.broadcast([tensor], options).wait()


def _encode(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` as JSON, its tensors appended to ``tensors`` and left as placeholders."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {"tensor": [str(value.dtype), list(value.shape)]}
    if dataclasses.is_dataclass(value) and type(value).__name__ in DATACLASSES:
        return {"dataclass": type(value).__name__,
                "fields": {f.name: _encode(getattr(value, f.name), tensors)
                           for f in dataclasses.fields(value)}}
    if isinstance(value, dict):
        return {"dict": {key: _encode(item, tensors) for key, item in value.items()}}
    if isinstance(value, list | tuple):
        return [_encode(item, tensors) for item in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"a tensor-parallel message cannot carry {type(value).__name__}")


def _decode(value: Any, group: Any) -> Any:
    """The value ``_encode`` described, its tensors received in order."""
    if isinstance(value, list):
        return [_decode(item, group) for item in value]
    if not isinstance(value, dict):
        return value
    if "tensor" in value:
        dtype, shape = value["tensor"]
        tensor = torch.empty(shape, dtype=DTYPES[dtype])
        _broadcast(group, tensor)
        return tensor
    if "dataclass" in value:
        fields = {name: _decode(item, group) for name, item in value["fields"].items()}
        return DATACLASSES[value["dataclass"]](**fields)
    return {key: _decode(item, group) for key, item in value["dict"].items()}
