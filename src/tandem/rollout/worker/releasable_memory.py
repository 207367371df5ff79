"""Memory whose pages can be handed back and taken again at the same address.

A sleeping engine gives its KV pool (and on CUDA its weights) back to the trainer, but its
decode graphs hold the addresses they were captured over. Memory that comes back at the
same address keeps them valid, so ``wake_up`` captures nothing (vLLM's sleep mode does the
same). On CUDA the driver's virtual memory management (``cuda_driver``) reserves the
addresses once and maps new device memory behind them on each restore; on CPU an anonymous
private mapping hands its pages back with ``madvise(MADV_DONTNEED)`` and reads zero after.
"""

from __future__ import annotations

import logging
import math
import mmap
import weakref
from collections.abc import Callable
from typing import TypeVar

import torch

from . import cuda_driver

logger = logging.getLogger(__name__)
T = TypeVar("T")


def typed_view(buffer: torch.Tensor, offset: int, shape: tuple[int, ...] | torch.Size,
               dtype: torch.dtype) -> torch.Tensor:
    """The ``shape`` tensor of ``dtype`` stored from byte ``offset`` of the flat byte tensor
    ``buffer`` (``offset`` a multiple of the dtype's size)."""
    num_bytes = math.prod(shape) * dtype.itemsize
    return buffer[offset:offset + num_bytes].view(dtype).view(shape)


class ReleasableMemory:
    """``num_bytes`` at a fixed address: the flat byte tensor ``tensor``, to cut typed views
    from (``view``), zero when made.

    ``release`` hands the memory back (after the device's queued work); until ``restore``
    takes new memory at the same address, zeroed, no view may be read or written. Padded
    attention reads past a sequence's end, so a KV pool must never hold NaN garbage: on CPU
    fresh and released pages read zero, on CUDA the memory is zeroed (a memset at the
    device's bandwidth). The memory is freed when this and every view of it are gone.

    Raises:
        CudaDriverError: (CUDA) when the driver refuses a reservation, mapping or release.
    """

    def __init__(self, num_bytes: int, device: torch.device) -> None:
        self.num_bytes = num_bytes
        self.device = device
        self.released = False
        self._pages = _DevicePages(num_bytes, device) if device.type == "cuda" \
            else _HostPages(num_bytes)
        self.tensor = self._pages.tensor()
        self._zero()

    def view(self, offset: int, shape: tuple[int, ...] | torch.Size,
             dtype: torch.dtype) -> torch.Tensor:
        """A typed view of the bytes from ``offset`` (see ``typed_view``)."""
        return typed_view(self.tensor, offset, shape, dtype)

    def release(self) -> None:
        """Hand the memory back; the addresses stay reserved (a no-op when released)."""
        if not self.released:
            synchronize(self.device)
            self._pages.release()
            self.released = True

    def restore(self) -> None:
        """Take memory again at the same address, zeroed (a no-op unless released)."""
        if self.released:
            self._pages.restore()
            self.released = False
            self._zero()

    def _zero(self) -> None:
        if self.device.type == "cuda":  # CPU pages read zero when fresh and once released
            self.tensor.zero_()
            synchronize(self.device)


def releasable_or_none(make: Callable[[], T], what: str) -> T | None:
    """``make()``, or None with a warning where the driver refuses memory at fixed addresses
    (no virtual memory management, as under some virtualisation): the caller then takes
    plain allocations, which come back at new addresses, so each wake captures the decode
    graphs again (``ModelRunner.graphs_current`` notices)."""
    try:
        return make()
    except (cuda_driver.CudaDriverError, OSError) as error:
        logger.warning("%s: no memory at fixed addresses (%s); wake_up will capture the decode "
                       "graphs again.", what, error)
        return None


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _HostPages:
    """An anonymous private mapping: zero, and resident only where written. Not huge pages:
    in the head-major KV pool a block is a short run per layer, KV head and K/V, so one
    2 MiB page would make hundreds of blocks resident per block used."""

    def __init__(self, num_bytes: int) -> None:
        self.mapping = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)

    def tensor(self) -> torch.Tensor:
        return torch.frombuffer(self.mapping, dtype=torch.uint8)

    def release(self) -> None:
        self.mapping.madvise(mmap.MADV_DONTNEED)

    def restore(self) -> None:
        """Nothing to map: a released page is taken again, zero, when next touched."""


class _DevicePages:
    """A reserved range of device addresses with device memory mapped behind it while held.

    It owns every tensor over it (``tensor`` keeps it alive through the CUDA array
    interface), and once the last is gone its finalizer unmaps and frees everything.
    """

    def __init__(self, num_bytes: int, device: torch.device) -> None:
        self.ordinal = torch.cuda.current_device() if device.index is None else device.index
        self.num_bytes = num_bytes
        cuda_driver.ensure_context(self.ordinal)
        granularity = cuda_driver.granularity(self.ordinal)
        self.mapped_bytes = -(-num_bytes // granularity) * granularity
        self.address = cuda_driver.reserve(self.mapped_bytes, granularity)
        self.handle = [0]  # what is mapped (0: nothing), shared with the finalizer
        finalizer = weakref.finalize(self, _free_pages, self.ordinal, self.address,
                                     self.mapped_bytes, self.handle)
        finalizer.atexit = False  # at exit the driver frees it all with the context
        self.restore()

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"version": 3, "typestr": "|u1", "data": (self.address, False),
                "shape": (self.num_bytes,), "strides": None}

    def tensor(self) -> torch.Tensor:
        tensor = torch.as_tensor(self, device=torch.device("cuda", self.ordinal))
        if tensor.data_ptr() != self.address:
            raise RuntimeError("torch copied the mapped device memory instead of viewing it.")
        return tensor

    def release(self) -> None:
        cuda_driver.ensure_context(self.ordinal)
        cuda_driver.unmap_and_release(self.address, self.mapped_bytes, self.handle[0])
        self.handle[0] = 0

    def restore(self) -> None:
        torch.cuda.empty_cache()  # memory torch's allocator caches cannot back a mapping
        cuda_driver.ensure_context(self.ordinal)
        self.handle[0] = cuda_driver.map_new_memory(self.ordinal, self.address,
                                                    self.mapped_bytes)


def _free_pages(ordinal: int, address: int, mapped_bytes: int, handle: list[int]) -> None:
    torch.cuda.synchronize(ordinal)  # no queued kernel may touch the range once unmapped
    cuda_driver.ensure_context(ordinal)
    if handle[0]:
        cuda_driver.unmap_and_release(address, mapped_bytes, handle[0])
    cuda_driver.free_addresses(address, mapped_bytes)
