"""``WeightSender``: the trainer's end (rank 0) of a cross-process weight update."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

from ..protocol import WeightUpdateError
from .group import CUDA_IPC, DEFAULT_TIMEOUT, TransferGroup, resolve_device, share_buffers
from .layout import ALIGNMENT, Layout

DEFAULT_BUCKET_BYTES = 128 << 20

NamedTensors = Iterable[tuple[str, torch.Tensor]]


class WeightSender:
    """The trainer's end (rank 0): pushes named tensors into every engine, all or nothing.

    Args:
        host: the address this sender's store listens on (the receivers connect to it).
        port: a free port for that store.
        world_size: 1 + the number of engines.
        device: where the trainer's tensors are packed into buckets (and, for the mode,
            which device this rank is on; see ``tandem.sync.distributed``).
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
        self.group = TransferGroup(host, port, world_size, 0, resolve_device(device), timeout)
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
        for key in (f"layout/{self.layout_number}", f"ipc/{self.layout_number}"):
            self.group.store.delete_key(key)
        self._signature = signature
        self.layout = Layout.plan(tensors, self.bucket_bytes)
        self.layout_number += 1
        self._buffers = self.group.new_buffers(self.layout.buffer_bytes)
        if self.group.mode == CUDA_IPC:
            self.group.store.set(f"ipc/{self.layout_number}", share_buffers(self._buffers))
        self.group.store.set(f"layout/{self.layout_number}", self.layout.to_json())

    def _stream(self, tensors: dict[str, torch.Tensor]) -> str | None:
        """Pack and post every bucket; the reason packing failed, if it did."""
        failure = None
        pending: deque[dist.Work] = deque()
        for index, bucket in enumerate(self.layout.buckets):
            if len(pending) == self.group.in_flight:
                self.group.wait(pending.popleft())
            buffer = self._buffers[index % 2][:bucket.nbytes]
            if failure is None:
                failure = bucket.pack(buffer, tensors)
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
