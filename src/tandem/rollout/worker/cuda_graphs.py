"""CUDA graphs of pure-decode steps: a ladder of batch sizes over static input buffers.

A decode step of a small model is mostly kernel launches; replaying a captured graph
launches the whole forward pass at once. One graph is captured per batch size of the ladder
(largest first, all sharing one memory pool, since only one replays at a time). A step of
``n`` sequences replays the smallest captured size ``>= n``: its inputs are copied into the
static buffers, and the rows past ``n`` are padding (slot -1, so nothing is written to the
KV pool, and context length 0, so nothing is read). The attention backend owns the
metadata's static buffers (``AttentionBackend.decode_buffers``); logits and sampling stay
outside.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch
from torch import nn

from tandem.kernels import AttentionBackend, AttentionMetadata

SMALL_SIZES = (1, 2, 4)
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The ladder: 1, 2, 4, multiples of 8 up to 64, then of 16, and ``max_num_seqs``."""
    ladder = [*SMALL_SIZES, *range(8, 64, 8), *range(64, max_num_seqs, 16)]
    return sorted({size for size in ladder if size < max_num_seqs} | {max_num_seqs})


def graph_addresses(model: nn.Module, kv_cache: torch.Tensor) -> tuple[int, ...]:
    """What the decode graphs of ``model`` hold besides their own buffers: the KV pool's,
    the rotary tables' and every parameter's and buffer's address. Graphs captured over
    other addresses would read stale memory: a capture is due."""
    rotary = model.rotary_emb
    tensors = [kv_cache, rotary.cos, rotary.sin, *model.parameters(), *model.buffers()]
    return tuple(tensor.data_ptr() for tensor in tensors)


def padded_batch_size(batch_sizes: list[int], num_seqs: int) -> int | None:
    """The smallest of the sorted ``batch_sizes`` that holds ``num_seqs`` (None: none does)."""
    index = bisect.bisect_left(batch_sizes, num_seqs)
    return batch_sizes[index] if index < len(batch_sizes) else None


class DecodeGraphs:
    """Captured decode graphs and the static buffers they read (their one owner).

    ``stage`` copies a step's inputs into the buffers and pads them; ``capture`` and
    ``replay`` need CUDA, ``stage`` does not (so padding is testable anywhere).
    """

    def __init__(self, batch_sizes: list[int], max_blocks_per_seq: int,
                 device: torch.device, backend: AttentionBackend, num_groups: int = 1) -> None:
        self.batch_sizes = batch_sizes
        max_size = batch_sizes[-1]
        self.input_ids = torch.zeros(max_size, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_size, dtype=torch.long, device=device)
        self.buffers = backend.decode_buffers(max_size, max_blocks_per_seq, device, num_groups)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def fits(self, num_seqs: int) -> bool:
        """True when a captured graph can run a decode step of ``num_seqs`` sequences."""
        return bool(self.graphs) and num_seqs <= self.batch_sizes[-1]

    def metadata(self, size: int) -> AttentionMetadata:
        """The attention metadata of a ``size``-sequence decode step, over the buffers."""
        return self.buffers.metadata(size)

    def stage(self, input_ids: torch.Tensor, positions: torch.Tensor,
              metadata: AttentionMetadata) -> int:
        """Copy a decode step's inputs into the buffers, pad them; return the graph's size.

        Raises:
            ValueError: when no captured size holds the step.
        """
        num_seqs = input_ids.shape[0]
        size = padded_batch_size(self.batch_sizes, num_seqs)
        if size is None:
            raise ValueError(f"no decode graph holds {num_seqs} sequences (largest: "
                             f"{self.batch_sizes[-1]}).")
        self.input_ids[:num_seqs].copy_(input_ids)
        self.positions[:num_seqs].copy_(positions)
        self.buffers.stage(metadata, size)
        return size

    def capture(self, forward: Forward) -> None:
        """Capture ``forward`` for every batch size, largest first, in one memory pool.

        Each size runs once uncaptured first, so kernels compile outside the capture. The
        buffers hold padding meanwhile: nothing touches the KV pool. Other threads may use
        the device during the capture.
        """
        pool = None
        self.buffers.pad()
        for size in reversed(self.batch_sizes):
            args = (self.input_ids[:size], self.positions[:size], self.metadata(size))
            forward(*args)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            # A threaded weight receive allocates and runs NCCL work outside the engine's
            # lock, which a capture holds: in the default "global" mode an unsafe call of
            # another thread (cudaMalloc, a synchronize) would invalidate the capture;
            # "thread_local" refuses only this thread's.
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                hidden = forward(*args)
            pool = graph.pool()
            self.graphs[size] = (graph, hidden)

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor,
               metadata: AttentionMetadata) -> torch.Tensor:
        """Run a decode step through its graph; the hidden states ``[num_seqs, hidden]``."""
        size = self.stage(input_ids, positions, metadata)
        graph, hidden = self.graphs[size]
        graph.replay()
        return hidden[:input_ids.shape[0]]
