"""A model's parameters in one releasable region, offloaded to host memory in one copy.

``sleep(1)`` hands the weights' device memory to the trainer. Parameter by parameter
(``model.to("cpu")``) that is hundreds of copies through pageable memory, and the weights
come back at new addresses, so the decode graphs must be captured again. Here every
parameter is a view into one ``ReleasableMemory``: offloading is one copy into a pinned host
buffer, reloading one copy back to the same addresses, and the graphs stay valid (vLLM's
``CuMemAllocator`` offloads its "weights" tag the same way). ``sleep(2)`` releases the
region without a copy, and it comes back zeroed for the next full update to fill.
"""

from __future__ import annotations

import torch
from torch import nn

from .releasable_memory import ReleasableMemory, synchronize, typed_view

ALIGNMENT = 256  # each parameter starts at a multiple (what CUDA's allocator gives)


def parameter_offsets(parameters: list[nn.Parameter]) -> tuple[list[int], int]:
    """Each parameter's byte offset in one buffer (``ALIGNMENT``-aligned), and its size."""
    offsets, end = [], 0
    for param in parameters:
        start = -(-end // ALIGNMENT) * ALIGNMENT
        offsets.append(start)
        end = start + param.numel() * param.element_size()
    return offsets, end


class OffloadableWeights:
    """Every parameter of ``model`` (a tied one once) moved into one releasable region.

    ``offload`` copies the region into a pinned host buffer (made on first use, then kept),
    releases the region and points each parameter at its host copy, so a weight update
    while asleep lands there; ``reload`` restores the region, copies the buffer back and
    points the parameters at the region again, at their old addresses. Buffers (rotary
    tables, LoRA factors) stay where they are.
    """

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        parameters = list(model.parameters())
        self.offsets, num_bytes = parameter_offsets(parameters)
        self.region = ReleasableMemory(num_bytes, device)
        self.device_views = self._views(self.region.tensor, parameters)
        self.host: torch.Tensor | None = None
        self.host_views: list[torch.Tensor] = []
        self.discarded = False  # released without a copy (see discard)
        with torch.no_grad():
            for view, param in zip(self.device_views, parameters):
                view.copy_(param)
        self._point(model, self.device_views)

    @property
    def offloaded(self) -> bool:
        """True while the weights are off the device: in the host buffer, or discarded."""
        return self.region.released

    def holds(self, model: nn.Module) -> bool:
        """True while every parameter of ``model`` is still its view here (on the device or,
        offloaded, on the host): an alias update that adopted a trainer's tensor ends that."""
        views = self.host_views if self.offloaded and not self.discarded else self.device_views
        parameters = list(model.parameters())
        return len(parameters) == len(views) and all(
            param.data_ptr() == view.data_ptr() for param, view in zip(parameters, views))

    def offload(self, model: nn.Module) -> None:
        """Copy the weights to the host buffer in one copy and release their device memory
        (a no-op when offloaded)."""
        if self.offloaded:
            return
        if self.host is None:
            self.host = torch.empty(self.region.num_bytes, dtype=torch.uint8,
                                    pin_memory=self.region.device.type == "cuda")
            self.host_views = self._views(self.host, list(model.parameters()))
        self.host.copy_(self.region.tensor)
        self.region.release()
        self._point(model, self.host_views)

    def discard(self) -> None:
        """Release the weights' device memory without a copy (``sleep(2)``): until
        ``reload`` maps zeroed memory back, the parameters point at unmapped addresses and
        nothing may read or write them. Weights already offloaded stay in the host buffer."""
        if not self.offloaded:
            self.region.release()
            self.discarded = True

    def reload(self, model: nn.Module) -> None:
        """Take the device memory again and copy the weights back in one copy (a no-op
        unless offloaded; after ``discard`` the memory comes back zeroed, for an update to
        fill)."""
        if not self.offloaded:
            return
        self.region.restore()
        if not self.discarded:
            self.region.tensor.copy_(self.host, non_blocking=True)
            synchronize(self.region.device)
        self.discarded = False
        self._point(model, self.device_views)

    def _views(self, buffer: torch.Tensor, parameters: list[nn.Parameter]) -> list[torch.Tensor]:
        return [typed_view(buffer, offset, param.shape, param.dtype)
                for offset, param in zip(self.offsets, parameters)]

    @staticmethod
    def _point(model: nn.Module, views: list[torch.Tensor]) -> None:
        for param, view in zip(model.parameters(), views):
            param.data = view
