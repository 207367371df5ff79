"""The store and process groups one weight sender (rank 0) and its receivers share: the
transport mode agreed from every rank's device, bucket moves, votes and refusal reasons."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

DEFAULT_TIMEOUT = timedelta(minutes=5)
GLOO, NCCL, CUDA_IPC = "gloo", "nccl", "cuda_ipc"
# Position of the storage's device index in ``reduce_tensor``'s arguments for
# ``rebuild_cuda_tensor``: the receiver numbers devices its own way.
IPC_DEVICE_ARGUMENT = 6

IpcHandle = tuple[Any, tuple[Any, ...]]


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


def share_buffers(buffers: list[torch.Tensor]) -> list[IpcHandle]:
    """CUDA IPC handles of the sender's bucket buffers (``reduce_tensor``), for the store."""
    return [reduce_tensor(buffer) for buffer in buffers]


def rebuild_buffer(handle: IpcHandle, device: torch.device) -> torch.Tensor:
    """Map the sender's buffer from its CUDA IPC handle onto this process's ``device``."""
    rebuild, arguments = handle
    arguments = list(arguments)
    arguments[IPC_DEVICE_ARGUMENT] = device.index
    return rebuild(*arguments)


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
