"""The store and process groups one weight sender (rank 0) and its receivers share: the
transport mode agreed from every rank's device, bucket moves, votes and refusal reasons."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from .wire import decode_bytes, encode_bytes, expect, expect_keys, parse_json

DEFAULT_TIMEOUT = timedelta(minutes=5)
GLOO, NCCL, CUDA_IPC = "gloo", "nccl", "cuda_ipc"
# A CUDA IPC handle of a bucket buffer as the store carries it: the variable part of
# ``reduce_tensor``'s arguments for ``rebuild_cuda_tensor``, each field's JSON type (bytes
# travel as base64 text). The rest is fixed on the receiver's side: the tensor and storage
# classes, uint8, a 1-D contiguous shape, no gradient, and its own device index (the
# receiver numbers devices its own way).
IPC_FIELDS: dict[str, type] = {
    "numel": int, "offset": int, "handle": bytes, "storage_size_bytes": int,
    "storage_offset_bytes": int, "ref_counter_handle": bytes, "ref_counter_offset": int,
    "event_handle": bytes, "event_sync_required": bool}


class TransferGroup:
    """The store and process groups one sender (rank 0) and its receivers share.

    Args:
        host, port: the store (rank 0 hosts it).
        world_size: 1 + the number of engines.
        rank: this process's rank (0: the sender).
        device: this rank's device, from which every rank agrees on the mode.
        timeout: the longest wait of any step.

    Raises:
        ValueError: for ``world_size`` below 2 or devices that fit no mode.
    """

    def __init__(self, host: str, port: int, world_size: int, rank: int, device: torch.device,
                 timeout: timedelta) -> None:
        if world_size < 2:
            raise ValueError(f"world_size={world_size}: pass 1 + the number of engines (>= 2).")
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.store = dist.TCPStore(host, port, world_size, rank == 0, timeout)
        self.mode = self._agree_mode(device)
        self.device = torch.device("cpu") if self.mode == GLOO else device
        self.control = dist.ProcessGroupGloo(dist.PrefixStore("control/", self.store), rank,
                                             world_size, timeout)
        self.data = self._nccl_group() if self.mode == NCCL else self.control
        # ``Work.wait`` holds the caller's current stream until NCCL's work is done: on the
        # stream the engine steps on (or the trainer computes on), nothing queued while a
        # bucket is awaited would run until the peer sends it. The group's own stream waits
        # instead (``_on_stream``).
        self.stream = torch.cuda.Stream(self.device) if self.mode == NCCL else None
        # Broadcast modes keep both buffers in flight; an IPC buffer is free again only once
        # the engines have passed the next bucket's barrier.
        self.in_flight = 1 if self.mode == CUDA_IPC else 2

    def _agree_mode(self, device: torch.device) -> str:
        self.store.set(f"device/{self.rank}", _device_key(device))
        keys = [f"device/{rank}" for rank in range(self.world_size)]
        self.store.wait(keys, self.timeout)
        return transport_mode([self.store.get(key).decode() for key in keys])

    def _nccl_group(self) -> Any:
        options = dist.ProcessGroupNCCL.Options()
        # Longer than our own waits, so a lost peer raises here (and the group is aborted)
        # before NCCL's watchdog would tear the process down.
        options._timeout = 2 * self.timeout
        return dist.ProcessGroupNCCL(dist.PrefixStore("data/", self.store), self.rank,
                                     self.world_size, options)

    def new_buffers(self, nbytes: int) -> list[torch.Tensor]:
        """Two zeroed byte buffers of ``nbytes`` on the bucket device."""
        return [torch.zeros(max(nbytes, 1), dtype=torch.uint8, device=self.device)
                for _ in range(2)]

    def post(self, buffer: torch.Tensor) -> dist.Work:
        """Start moving one bucket: a broadcast from rank 0, or (IPC) the bucket's barrier."""
        if self.mode == CUDA_IPC:
            torch.cuda.synchronize(self.device)
            return self.control.allreduce([torch.zeros(1)])
        options = dist.BroadcastOptions()
        options.rootRank = 0
        with self._on_stream():
            return self.data.broadcast([buffer], options)

    def wait(self, work: dist.Work) -> None:
        """Wait for ``work`` at most the timeout (raises ``RuntimeError`` past it); what the
        caller's stream queues next (reading or refilling the bucket) runs after it."""
        with self._on_stream():
            work.wait(self.timeout)

    @contextmanager
    def _on_stream(self) -> Iterator[None]:
        """Run the block's NCCL work on the group's stream, between the caller's stream's:
        after what it queued (a bucket packed, or still read, into the buffer), before what
        it queues next, unless the block raised (a lost peer's work never completes). Off
        NCCL (gloo, CUDA IPC) the block runs as it is.

        The buffers stay the caller's stream's (allocated, packed and read there, and it
        waits for each broadcast of them), so the caching allocator needs no
        ``record_stream``."""
        if self.stream is None:
            yield
            return
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream):
            yield
        caller.wait_stream(self.stream)

    def exchange(self, value: int) -> list[int]:
        """Every rank's ``value``, by rank (each rank fills its slot of an all-reduce)."""
        if self.mode == CUDA_IPC:
            torch.cuda.synchronize(self.device)
        slots = torch.zeros(self.world_size, dtype=torch.int64)
        slots[self.rank] = value
        self.wait(self.control.allreduce([slots]))
        return slots.tolist()

    def report(self, update: int, failure: str | None) -> int:
        """Publish this rank's failure of ``update`` (if any); its vote: 1 ok, 0 refused."""
        if failure is not None:
            self.store.set(f"error/{update}/{self.rank}", failure)
        return int(failure is None)

    def reasons(self, update: int, slots: list[int], failed: int) -> str:
        """Each rank whose slot is ``failed``, with the reason it published."""
        return "; ".join(f"rank {rank}: {self._reason(update, rank)}"
                         for rank, slot in enumerate(slots) if slot == failed)

    def _reason(self, update: int, rank: int) -> str:
        return self.store.get(f"error/{update}/{rank}").decode().rstrip(".")

    def forget(self, update: int) -> None:
        """Delete the store keys of ``update`` (every rank is past reading them)."""
        for key in [f"update/{update}"] + [f"error/{update}/{r}" for r in range(self.world_size)]:
            self.store.delete_key(key)

    def abort(self) -> None:
        """Abort the groups after a lost peer, so nothing waits on them any longer."""
        self.control.abort()
        if self.data is not self.control:
            self.data.abort()


def share_buffers(buffers: list[torch.Tensor]) -> str:
    """The CUDA IPC handles of the sender's 1-D uint8 bucket buffers, as JSON for the store
    (``rebuild_buffers`` reads it)."""
    return json.dumps([_ipc_fields(reduce_tensor(buffer)[1]) for buffer in buffers])


def _ipc_fields(arguments: tuple[Any, ...]) -> dict[str, Any]:
    """The JSON fields (``IPC_FIELDS``) of ``reduce_tensor``'s arguments for
    ``rebuild_cuda_tensor`` of a 1-D buffer."""
    (_, size, _, offset, _, _, _, handle, storage_size_bytes, storage_offset_bytes, _,
     ref_counter_handle, ref_counter_offset, event_handle, event_sync_required) = arguments
    values = {"numel": size[0], "offset": offset, "handle": handle,
              "storage_size_bytes": storage_size_bytes,
              "storage_offset_bytes": storage_offset_bytes,
              "ref_counter_handle": ref_counter_handle, "ref_counter_offset": ref_counter_offset,
              "event_handle": event_handle, "event_sync_required": event_sync_required}
    return {name: encode_bytes(value) if IPC_FIELDS[name] is bytes else value
            for name, value in values.items()}


def rebuild_buffers(payload: str | bytes, nbytes: int, device: torch.device
                    ) -> list[torch.Tensor]:
    """Map the sender's two bucket buffers, from the JSON ``share_buffers`` wrote, onto this
    process's ``device``; each must hold at least ``nbytes``.

    Raises:
        ValueError: naming the buffer and field when ``payload`` is not two such handles.
    """
    handles = expect(parse_json(payload, "the CUDA IPC handles"), list, "the CUDA IPC handles")
    if len(handles) != 2:
        raise ValueError(f"the CUDA IPC handles must be 2 (one per bucket buffer), got "
                         f"{len(handles)}")
    fields = [_decode_ipc_fields(handle, f"CUDA IPC handle {index}")
              for index, handle in enumerate(handles)]
    for index, handle in enumerate(fields):
        if handle["numel"] < nbytes:
            raise ValueError(f"CUDA IPC handle {index} is a buffer of {handle['numel']} bytes, "
                             f"but the layout's largest bucket needs {nbytes}")
    return [_rebuild_buffer(handle, device) for handle in fields]


def _decode_ipc_fields(handle: Any, what: str) -> dict[str, Any]:
    """``handle``'s ``IPC_FIELDS``, checked and with bytes decoded.

    Raises:
        ValueError: naming ``what`` and the field for a missing, extra or mistyped field, or
            a buffer that does not fit in its storage.
    """
    handle = expect_keys(handle, set(IPC_FIELDS), what)
    fields = {name: decode_bytes(handle[name], f"{what}'s {name}") if kind is bytes
              else expect(handle[name], kind, f"{what}'s {name}")
              for name, kind in IPC_FIELDS.items()}
    if fields["offset"] + fields["numel"] > fields["storage_size_bytes"]:
        raise ValueError(f"{what}: {fields['numel']} bytes at offset {fields['offset']} do not "
                         f"fit its storage of {fields['storage_size_bytes']} bytes")
    return fields


def _rebuild_buffer(fields: dict[str, Any], device: torch.device) -> torch.Tensor:
    """Map one sender buffer, from its checked ``_decode_ipc_fields``, onto ``device``: the
    one place a CUDA IPC handle is opened, with every class and type fixed here."""
    return rebuild_cuda_tensor(
        torch.Tensor, (fields["numel"],), (1,), fields["offset"], torch.storage.TypedStorage,
        torch.uint8, device.index, fields["handle"], fields["storage_size_bytes"],
        fields["storage_offset_bytes"], False, fields["ref_counter_handle"],
        fields["ref_counter_offset"], fields["event_handle"], fields["event_sync_required"])


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``, a bare ``"cuda"`` as the current CUDA device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def transport_mode(device_keys: list[str]) -> str:
    """The mode every rank's device key allows: gloo, CUDA IPC or NCCL.

    Raises:
        ValueError: for some ranks on the trainer's GPU and others elsewhere.
    """
    if "cpu" in device_keys:
        return GLOO
    if len(set(device_keys)) == 1:
        return CUDA_IPC
    if len(set(device_keys)) == len(device_keys):
        return NCCL
    raise ValueError(f"ranks on devices {device_keys}: put every engine on the trainer's GPU "
                     "(CUDA IPC), every rank on a GPU of its own (NCCL), or pass "
                     "device='cpu' on some rank (gloo).")


def _device_key(device: torch.device) -> str:
    """``cpu`` for any device off CUDA; a GPU by its UUID (the same across processes)."""
    if device.type != "cuda":
        return "cpu"
    return f"cuda:{torch.cuda.get_device_properties(device).uuid}"
