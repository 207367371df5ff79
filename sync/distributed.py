"""Weight updates across processes: the staged protocol over a dedicated torch.distributed group.

The trainer runs a ``WeightSender`` (rank 0); each engine process runs a ``WeightReceiver``
(ranks 1..N) around its ``LLM`` or ``LLMEngine``. The pair builds its own ``TCPStore`` (the
sender hosts it) and constructs its process groups directly, so it never calls
``init_process_group`` and never touches either side's default group.

One update, in order:

1. Header, through the store: update number, layout number, version, full. The layout
   (every tensor's name, dtype, shape, bucket and byte offset) is published once under its
   number and reused while the names, shapes and dtypes stay the same.
2. Buckets: the tensors packed into flat byte buffers of ``bucket_bytes`` (a larger tensor
   gets a bucket of its own), two buffers alternating so the sender fills one while the
   other is in flight. Each engine ``load``s a bucket's views as it arrives: the staged
   protocol of ``tandem.sync.protocol``, streamed bucket by bucket.
3. Vote, the control message: an all-reduce of one slot per rank. The sender's slot says
   commit (everything packed) or abort; each engine's says whether its loads passed. Every
   engine commits only on a unanimous vote, so engines never end on different weights.
4. Result: an all-reduce of each engine's committed version (-1 where its commit failed).

A refusal's reason goes through the store, so both ends raise ``WeightUpdateError`` naming
the engine and the reason; the engines keep serving their previous weights.

Transport modes, agreed at construction from every rank's device (the device passed in):

- ``gloo``: some rank is on CPU; buckets live on CPU and go through gloo broadcasts.
- ``nccl``: every rank on a GPU of its own; buckets are broadcast by NCCL.
- ``cuda_ipc``: every rank on the same GPU (same UUID), where NCCL refuses two ranks. The
  sender's two bucket buffers are shared once per layout as CUDA IPC handles
  (``torch.multiprocessing.reductions.reduce_tensor``, through the store, as verl and
  OpenRLHF do); a gloo all-reduce per bucket is the barrier that says "filled" to the
  engines and "read" (of the bucket before) to the sender.

Some ranks on the trainer's GPU and others elsewhere is refused (``ValueError``).

Every collective waits at most ``timeout``, so a sender that dies mid-update is detected
within it: the receiver aborts the update, the engine keeps serving its old weights, and
``WeightUpdateError`` says so. After a lost peer the pair's groups are aborted: build a new
sender and new receivers (on a fresh port) to go on.
"""

from __future__ import annotations

import json
import math
import pickle
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from .protocol import WeightUpdate, WeightUpdateError

DEFAULT_BUCKET_BYTES = 128 << 20
DEFAULT_TIMEOUT = timedelta(minutes=5)
# Every tensor starts at a multiple of this many bytes, so a bucket's bytes can be viewed
# as any dtype.
ALIGNMENT = 16
GLOO, NCCL, CUDA_IPC = "gloo", "nccl", "cuda_ipc"
# Position of the storage's device index in ``reduce_tensor``'s arguments for
# ``rebuild_cuda_tensor``: the receiver numbers devices its own way.
IPC_DEVICE_ARGUMENT = 6

NamedTensors = Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """Where one tensor lies in its bucket."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        """The tensor's size in bytes."""
        return math.prod(self.shape) * self.dtype.itemsize

    def view(self, buffer: torch.Tensor) -> torch.Tensor:
        """The tensor as a view into a bucket's byte buffer."""
        return buffer[self.offset:self.offset + self.nbytes].view(self.dtype).view(self.shape)


@dataclass(frozen=True, slots=True)
class Bucket:
    """One flat buffer's worth of tensors."""

    nbytes: int
    slots: tuple[TensorSlot, ...]


@dataclass(frozen=True, slots=True)
class Layout:
    """Every tensor's bucket and offset: the metadata sent once and reused."""

    buckets: tuple[Bucket, ...]

    @classmethod
    def plan(cls, tensors: dict[str, torch.Tensor], bucket_bytes: int) -> Layout:
        """Pack ``tensors`` in order into buckets of at most ``bucket_bytes`` (a larger
        tensor alone in its own)."""
        buckets: list[Bucket] = []
        slots: list[TensorSlot] = []
        end = 0
        for name, tensor in tensors.items():
            offset = _aligned(end)
            if slots and offset + tensor.nbytes > bucket_bytes:
                buckets.append(Bucket(end, tuple(slots)))
                slots, offset = [], 0
            slots.append(TensorSlot(name, tensor.dtype, tuple(tensor.shape), offset))
            end = offset + tensor.nbytes
        if slots:
            buckets.append(Bucket(end, tuple(slots)))
        return cls(tuple(buckets))

    def tensors(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """Every tensor's ``(name, dtype name, shape)``, in order (dtype as ``"float32"``)."""
        return [(slot.name, _dtype_name(slot.dtype), slot.shape)
                for bucket in self.buckets for slot in bucket.slots]

    @property
    def buffer_bytes(self) -> int:
        """The size of a buffer that holds any of the buckets."""
        return max((bucket.nbytes for bucket in self.buckets), default=0)

    def to_json(self) -> str:
        """The layout as JSON: per bucket, its bytes and ``[name, dtype, shape, offset]``s."""
        return json.dumps([[bucket.nbytes, [[slot.name, _dtype_name(slot.dtype),
                                              slot.shape, slot.offset] for slot in bucket.slots]]
                           for bucket in self.buckets])

    @classmethod
    def from_json(cls, text: str | bytes) -> Layout:
        """The layout ``to_json`` wrote."""
        return cls(tuple(Bucket(nbytes, tuple(
            TensorSlot(name, getattr(torch, dtype), tuple(shape), offset)
            for name, dtype, shape, offset in slots)) for nbytes, slots in json.loads(text)))


class _Group:
    """The store and process groups one sender (rank 0) and its receivers share."""

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
        # Broadcast modes keep both buffers in flight; an IPC buffer is free again only once
        # the engines have passed the next bucket's barrier.
        self.in_flight = 1 if self.mode == CUDA_IPC else 2

    def _agree_mode(self, device: torch.device) -> str:
        self.store.set(f"device/{self.rank}", _device_key(device))
        keys = [f"device/{rank}" for rank in range(self.world_size)]
        self.store.wait(keys, self.timeout)
        return _mode([self.store.get(key).decode() for key in keys])

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
        return self.data.broadcast([buffer], options)

    def wait(self, work: dist.Work) -> None:
        """Wait for ``work`` at most the timeout (raises ``RuntimeError`` past it)."""
        work.wait(self.timeout)

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


class WeightSender:
    """The trainer's end (rank 0): pushes named tensors into every engine, all or nothing.

    Args:
        host: the address this sender's store listens on (the receivers connect to it).
        port: a free port for that store.
        world_size: 1 + the number of engines.
        device: where the trainer's tensors are packed into buckets (and, for the mode,
            which device this rank is on; see the module docstring).
        bucket_bytes: the size of a bucket; a tensor larger than it gets a bucket of its own.
        timeout: the longest wait of any step (connecting, every collective).

    Blocks until every receiver has connected.

    Raises:
        ValueError: for ``bucket_bytes`` below 16, ``world_size`` below 2, or devices that
            fit no mode.
    """

    def __init__(self, host: str, port: int, world_size: int,
                 device: str | torch.device = "cpu", bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        if bucket_bytes < ALIGNMENT:
            raise ValueError(f"bucket_bytes={bucket_bytes} is too small: pass at least "
                             f"{ALIGNMENT} (e.g. the default {DEFAULT_BUCKET_BYTES}).")
        self.bucket_bytes = bucket_bytes
        self.group = _Group(host, port, world_size, 0, _resolve(device), timeout)
        self.update_number = 0
        self.layout_number = 0
        self._signature: list[tuple[str, tuple[int, ...], torch.dtype]] | None = None
        self.layout = Layout(())
        self._buffers: list[torch.Tensor] = []

    def send(self, named_tensors: NamedTensors, version: int | None = None,
             full: bool = True) -> int:
        """Push one update to every engine; returns the weight version they committed.

        The layout is sent the first time and whenever the names, shapes or dtypes differ
        from the previous call's (then under a new layout number, with new buffers); an
        unchanged one costs nothing. ``version`` None moves each engine to its current
        version + 1 (engines that started together stay in step; the highest is returned).
        ``full`` as in ``WeightUpdate``: False lets the update carry a subset.

        Raises:
            WeightUpdateError: when an engine refused the update (a tensor it rejects, an
                incomplete full update, a version not above its own), when a tensor cannot
                be packed, or when an engine was lost (then rebuild the pair). Every engine
                keeps serving its previous weights.
        """
        tensors = {name: tensor.detach() for name, tensor in named_tensors}
        self._publish_layout(tensors)
        self.update_number += 1
        header = {"layout": self.layout_number, "version": version, "full": full}
        self.group.store.set(f"update/{self.update_number}", json.dumps(header))
        try:
            return self._finish(self._stream(tensors))
        except WeightUpdateError:
            raise
        except RuntimeError as exc:
            self.group.abort()
            raise WeightUpdateError(f"lost an engine during weight update {self.update_number}"
                                    f" ({exc}); build a new sender and receivers.") from exc

    def _publish_layout(self, tensors: dict[str, torch.Tensor]) -> None:
        signature = [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
        if signature == self._signature:
            return
        self.group.store.delete_key(f"layout/{self.layout_number}")
        self._signature = signature
        self.layout = Layout.plan(tensors, self.bucket_bytes)
        self.layout_number += 1
        self._buffers = self.group.new_buffers(self.layout.buffer_bytes)
        payload = self.layout.to_json().encode()
        if self.group.mode == CUDA_IPC:
            payload = pickle.dumps((payload, [reduce_tensor(b) for b in self._buffers]))
        self.group.store.set(f"layout/{self.layout_number}", payload)

    def _stream(self, tensors: dict[str, torch.Tensor]) -> str | None:
        """Pack and post every bucket; the reason packing failed, if it did."""
        failure = None
        pending: deque[dist.Work] = deque()
        for index, bucket in enumerate(self.layout.buckets):
            if len(pending) == self.group.in_flight:
                self.group.wait(pending.popleft())
            buffer = self._buffers[index % 2][:bucket.nbytes]
            if failure is None:
                failure = _pack(bucket, buffer, tensors)
            # The engines expect every bucket, so after a failure the rest still go out
            # (unpacked) and the vote aborts the update.
            pending.append(self.group.post(buffer))
        for work in pending:
            self.group.wait(work)
        return failure

    def _finish(self, failure: str | None) -> int:
        votes = self.group.exchange(self.group.report(self.update_number, failure))
        self.group.forget(self.update_number - 1)
        if failure is not None:
            raise WeightUpdateError(f"{failure}; the engines aborted weight update "
                                    f"{self.update_number} and keep their weights.")
        if 0 in votes:
            raise WeightUpdateError(
                f"weight update {self.update_number} was refused by "
                f"{self.group.reasons(self.update_number, votes, 0)}; every engine keeps its "
                "previous weights.")
        versions = self.group.exchange(0)
        if -1 in versions:
            raise WeightUpdateError(
                f"weight update {self.update_number} failed to commit on "
                f"{self.group.reasons(self.update_number, versions, -1)}; those engines keep "
                "their previous weights.")
        return max(versions[1:])


class WeightReceiver:
    """An engine's end (rank 1..N): applies each update a ``WeightSender`` pushes.

    Args:
        engine: an ``LLM`` or ``LLMEngine`` (anything with ``weight_update`` and
            ``weight_version``; an ``LLM``'s ``engine`` is used).
        host, port: the sender's store.
        world_size: 1 + the number of engines.
        rank: this engine's rank, 1..world_size - 1.
        device: this rank's device for the mode (default: the engine's); buckets land there
            (on CPU in gloo mode) and ``load`` copies them into the engine's dtype.
        timeout: the longest wait of any step once an update has begun.

    Blocks until the sender and every receiver have connected.

    Raises:
        ValueError: for a rank outside 1..world_size - 1 or devices that fit no mode.
    """

    def __init__(self, engine: Any, host: str, port: int, world_size: int, rank: int,
                 device: str | torch.device | None = None,
                 timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        if not 0 < rank < world_size:
            raise ValueError(f"rank={rank}: an engine's rank is 1..{world_size - 1} (the "
                             "sender is rank 0).")
        self.engine = getattr(engine, "engine", engine)
        if device is None:
            device = next(iter(self.engine.weight_parameters().values())).device
        self.group = _Group(host, port, world_size, rank, _resolve(device), timeout)
        self.update_number = 0
        self.layout_number = 0
        self.layout = Layout(())
        self._buffers: list[torch.Tensor] = []

    def receive(self, wait: timedelta | None = None,
                expected: list[tuple[str, str, tuple[int, ...]]] | None = None) -> int:
        """Block for the next update, apply it, and return the new weight version.

        ``wait`` bounds the wait for the sender to begin the update (default: the
        timeout); from then on every step waits at most the timeout. ``expected``, when
        given, is the update's announced ``(name, dtype name, shape)`` list: an update that
        carries anything else is refused (both ends raise, naming the difference).

        Raises:
            WeightUpdateError: when no update began within ``wait`` (call again), this
                engine or another refused a tensor, the update differs from ``expected``,
                the sender aborted, or the sender was lost (past the timeout; then rebuild
                the pair). The engine keeps serving its previous weights.
        """
        header = self._next_header(self.group.timeout if wait is None else wait)
        update, failure = self._begin(header)
        try:
            self._read_layout(header["layout"])
            failure = failure or _difference(self.layout, expected)
            failure = self._stream(update, failure)
            return self._finish(update, failure)
        except WeightUpdateError:
            raise
        except RuntimeError as exc:
            if update is not None:
                update.abort()
            self.group.abort()
            raise WeightUpdateError(
                f"lost the sender during weight update {self.update_number} ({exc}); the "
                f"engine keeps serving weight version {self.engine.weight_version}; build a "
                "new sender and receivers.") from exc

    def _next_header(self, wait: timedelta) -> dict[str, Any]:
        key = f"update/{self.update_number + 1}"
        try:
            self.group.store.wait([key], wait)
        except RuntimeError as exc:
            raise WeightUpdateError(f"no weight update began within {wait} ({exc}); call "
                                    "receive again, or rebuild the pair if the sender is "
                                    "gone.") from exc
        self.update_number += 1
        return json.loads(self.group.store.get(key))

    def _begin(self, header: dict[str, Any]) -> tuple[WeightUpdate | None, str | None]:
        try:
            return self.engine.weight_update(header["version"], header["full"]), None
        except ValueError as exc:
            return None, str(exc)

    def _read_layout(self, number: int) -> None:
        if number == self.layout_number:
            return
        payload = self.group.store.get(f"layout/{number}")
        if self.group.mode == CUDA_IPC:
            payload, handles = pickle.loads(payload)
            self._buffers = [_rebuild(handle, self.group.device) for handle in handles]
        self.layout = Layout.from_json(payload)
        if self.group.mode != CUDA_IPC:
            self._buffers = self.group.new_buffers(self.layout.buffer_bytes)
        self.layout_number = number

    def _stream(self, update: WeightUpdate | None, failure: str | None) -> str | None:
        """Load every bucket as it arrives (after a refusal, only drain them)."""
        for bucket, buffer in self._arrivals():
            if failure is None:
                failure = _load(update, bucket, buffer)
        return failure

    def _arrivals(self) -> Iterator[tuple[Bucket, torch.Tensor]]:
        buckets = self.layout.buckets
        pending: deque[dist.Work] = deque()
        posted = 0
        for index, bucket in enumerate(buckets):
            while posted < len(buckets) and len(pending) < self.group.in_flight:
                pending.append(self.group.post(self._buffer(posted)))
                posted += 1
            self.group.wait(pending.popleft())
            yield bucket, self._buffer(index)

    def _buffer(self, index: int) -> torch.Tensor:
        return self._buffers[index % 2][:self.layout.buckets[index].nbytes]

    def _finish(self, update: WeightUpdate | None, failure: str | None) -> int:
        number = self.update_number
        votes = self.group.exchange(self.group.report(number, failure))
        if 0 in votes:
            if update is not None:
                update.abort()
            raise WeightUpdateError(
                f"weight update {number} was not applied ({self.group.reasons(number, votes, 0)});"
                f" the engine keeps serving weight version {self.engine.weight_version}.")
        version, failure = _commit(update)
        self.group.report(number, failure)
        self.group.exchange(version)
        if failure is not None:
            raise WeightUpdateError(f"weight update {number} failed to commit ({failure}); the "
                                    f"engine keeps serving weight version "
                                    f"{self.engine.weight_version}.")
        return version


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _difference(layout: Layout, expected: list[tuple[str, str, tuple[int, ...]]] | None
                ) -> str | None:
    """Why the layout is not the announced one (None when it is, or none was announced)."""
    if expected is None:
        return None
    sent = layout.tensors()
    expected = [(name, dtype, tuple(shape)) for name, dtype, shape in expected]
    if sent == expected:
        return None
    first = next((i for i, (a, b) in enumerate(zip(sent, expected)) if a != b),
                 min(len(sent), len(expected)))
    return (f"the update carries {len(sent)} tensors but {len(expected)} were announced; "
            f"they first differ at tensor {first}: sent "
            f"{sent[first] if first < len(sent) else None}, announced "
            f"{expected[first] if first < len(expected) else None}")


def _aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


def _resolve(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _device_key(device: torch.device) -> str:
    """``cpu`` for any device off CUDA; a GPU by its UUID (the same across processes)."""
    if device.type != "cuda":
        return "cpu"
    return f"cuda:{torch.cuda.get_device_properties(device).uuid}"


def _mode(device_keys: list[str]) -> str:
    if "cpu" in device_keys:
        return GLOO
    if len(set(device_keys)) == 1:
        return CUDA_IPC
    if len(set(device_keys)) == len(device_keys):
        return NCCL
    raise ValueError(f"ranks on devices {device_keys}: put every engine on the trainer's GPU "
                     "(CUDA IPC), every rank on a GPU of its own (NCCL), or pass "
                     "device='cpu' on some rank (gloo).")


def _pack(bucket: Bucket, buffer: torch.Tensor, tensors: dict[str, torch.Tensor]) -> str | None:
    """Copy a bucket's tensors into ``buffer``; the reason it failed, if it did."""
    for slot in bucket.slots:
        try:
            slot.view(buffer).copy_(tensors[slot.name])
        except (RuntimeError, TypeError) as exc:
            return f"could not pack tensor {slot.name!r} ({exc})"
    return None


def _load(update: WeightUpdate, bucket: Bucket, buffer: torch.Tensor) -> str | None:
    """Stage a bucket's tensors; the reason the engine refused them, if it did."""
    try:
        update.load((slot.name, slot.view(buffer)) for slot in bucket.slots)
    except RuntimeError as exc:  # a refusal (WeightUpdateError) or, say, out of memory
        return str(exc)
    return None


def _commit(update: WeightUpdate) -> tuple[int, str | None]:
    try:
        return update.commit(), None
    except WeightUpdateError as exc:
        return -1, str(exc)


def _rebuild(handle: tuple[Any, tuple[Any, ...]], device: torch.device) -> torch.Tensor:
    """Map the sender's buffer from its CUDA IPC handle onto this process's ``device``."""
    rebuild, arguments = handle
    arguments = list(arguments)
    arguments[IPC_DEVICE_ARGUMENT] = device.index
    return rebuild(*arguments)
