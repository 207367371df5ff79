"""``WeightReceiver``: an engine's end (rank 1..N) of a cross-process weight update."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..protocol import WeightUpdate, WeightUpdateError
from .group import CUDA_IPC, DEFAULT_TIMEOUT, TransferGroup, rebuild_buffers, resolve_device
from .layout import Bucket, Layout, TensorEntry
from .wire import expect, expect_keys, parse_json


class WeightReceiver:
    """An engine's end (rank 1..N): applies each update a ``WeightSender`` pushes.

    Args:
        engine: an ``LLM`` or ``LLMEngine`` (anything with ``weight_update`` and
            ``weight_version``; an ``LLM``'s ``engine`` is used).
        host: the sender's store's host.
        port: the sender's store's port.
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
        self.group = TransferGroup(host, port, world_size, rank, resolve_device(device),
                                   timeout)
        self.update_number = 0
        self.layout_number = 0
        self.layout = Layout(())
        self._buffers: list[torch.Tensor] = []

    def receive(self, wait: timedelta | None = None,
                expected: list[TensorEntry] | None = None) -> int:
        """Block for the next update, apply it, and return the new weight version.

        ``wait`` bounds the wait for the sender to begin the update (default: the
        timeout); from then on every step waits at most the timeout. ``expected``, when
        given, is the update's announced ``(name, dtype name, shape)`` list: an update that
        carries anything else is refused (both ends raise, naming the difference).

        Raises:
            WeightUpdateError: when no update began within ``wait`` (call again), this
                engine or another refused a tensor, the update differs from ``expected``,
                the sender aborted, the sender was lost (past the timeout) or its header,
                layout or buffer handles in the store are malformed (then rebuild the
                pair). The engine keeps serving its previous weights.
        """
        payload = self._next_header(self.group.timeout if wait is None else wait)
        update: WeightUpdate | None = None
        try:
            header = _parse_header(payload)
            update, failure = self._begin(header)
            self._read_layout(header["layout"])
            failure = failure or self.layout.difference(expected)
            failure = self._stream(update, failure)
            return self._finish(update, failure)
        except WeightUpdateError:
            raise
        except (RuntimeError, ValueError) as exc:  # ValueError: a malformed store entry
            if update is not None:
                update.abort()
            self.group.abort()
            raise WeightUpdateError(self._broken_pair(exc)) from exc

    def _broken_pair(self, exc: Exception) -> str:
        cause = (f"the sender's store holds a malformed entry ({exc})"
                 if isinstance(exc, ValueError) else f"lost the sender ({exc})")
        return (f"{cause} during weight update {self.update_number}; the engine keeps serving "
                f"weight version {self.engine.weight_version}; build a new sender and "
                "receivers.")

    def _next_header(self, wait: timedelta) -> bytes:
        key = f"update/{self.update_number + 1}"
        try:
            self.group.store.wait([key], wait)
        except RuntimeError as exc:
            raise WeightUpdateError(f"no weight update began within {wait} ({exc}); call "
                                    "receive again, or rebuild the pair if the sender is "
                                    "gone.") from exc
        self.update_number += 1
        return self.group.store.get(key)

    def _begin(self, header: dict[str, Any]) -> tuple[WeightUpdate | None, str | None]:
        try:
            return self.engine.weight_update(header["version"], header["full"]), None
        except ValueError as exc:
            return None, str(exc)

    def _read_layout(self, number: int) -> None:
        if number == self.layout_number:
            return
        self.layout = Layout.from_json(self.group.store.get(f"layout/{number}"))
        if self.group.mode == CUDA_IPC:
            self._buffers = rebuild_buffers(self.group.store.get(f"ipc/{number}"),
                                            self.layout.buffer_bytes, self.group.device)
        else:
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


def _parse_header(payload: bytes) -> dict[str, Any]:
    """An update's header from the store: its layout number, version and ``full``.

    Raises:
        ValueError: naming the field when the header is not such a JSON object.
    """
    header = expect_keys(parse_json(payload, "the update header"), {"layout", "version", "full"},
                         "the update header")
    expect(header["layout"], int, "the update header's layout")
    if header["version"] is not None:
        expect(header["version"], int, "the update header's version")
    expect(header["full"], bool, "the update header's full")
    return header


def _load(update: WeightUpdate, bucket: Bucket, buffer: torch.Tensor) -> str | None:
    """Stage a bucket's tensors; the reason the engine refused them, if it did."""
    try:
        update.load(bucket.views(buffer))
    except RuntimeError as exc:  # a refusal (WeightUpdateError) or, say, out of memory
        return str(exc)
    return None


def _commit(update: WeightUpdate) -> tuple[int, str | None]:
    try:
        return update.commit(), None
    except WeightUpdateError as exc:
        return -1, str(exc)
