"""The attention tensors the model runner builds from a scheduled batch.

``cascade_layout`` lays out cascade attention over the scheduler's decode groups: the
scheduler says which decodes share which leading blocks, this module only turns that into
tensors (``tandem.kernels.CascadeLayout``).
"""

from __future__ import annotations

import torch

from tandem.kernels import CascadeLayout, block_runs

from ..core.scheduled_batch import ScheduledBatch


def long_tensor(values: list, device: torch.device) -> torch.Tensor:
    """``values`` (nested lists of ints) as an int64 tensor on ``device`` (see
    ``to_device``)."""
    return to_device(torch.tensor(values, dtype=torch.long), device)


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``, without waiting for the device: to CUDA through pinned
    memory and a non-blocking copy (a plain ``.to`` waits for every kernel queued before
    it, which would end the overlap of host and device work; see ``engine.py``)."""
    if device.type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def padded_tensor(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """``rows`` as one int64 tensor, each padded with 0 to the longest."""
    width = max(map(len, rows))
    return long_tensor([row + [0] * (width - len(row)) for row in rows], device)


def cascade_layout(batch: ScheduledBatch, block_size: int,
                   device: torch.device) -> CascadeLayout:
    """The tensors of cascade attention over ``batch``'s decode groups.

    Each group's shared blocks form one shared run; the decodes of groups that share
    nothing form the last group, with an empty shared run. Without any sharing, only each
    decode's own run.
    """
    decodes = batch.seqs[:batch.num_decodes]
    groups = [(g.members, g.num_shared_blocks) for g in batch.decode_groups
              if g.num_shared_blocks]
    skipped = [0] * len(decodes)
    for members, num_shared in groups:
        for d in members:
            skipped[d] = num_shared
    own = block_runs(
        padded_tensor([seq.block_table[n:] for seq, n in zip(decodes, skipped)], device),
        long_tensor([seq.num_tokens - n * block_size for seq, n in zip(decodes, skipped)],
                    device), block_size)
    if not groups:
        return CascadeLayout(own)
    alone = [d for g in batch.decode_groups if not g.num_shared_blocks for d in g.members]
    if alone:
        groups.append((alone, 0))
    width = max(len(members) for members, _ in groups)
    member_slots = [0] * len(decodes)
    for g, (members, _) in enumerate(groups):
        for i, d in enumerate(members):
            member_slots[d] = g * width + i
    shared = block_runs(
        padded_tensor([decodes[members[0]].block_table[:n] for members, n in groups], device),
        long_tensor([n * block_size for _, n in groups], device), block_size)
    return CascadeLayout(
        own, shared,
        long_tensor([members + members[:1] * (width - len(members)) for members, _ in groups],
                    device),
        long_tensor(member_slots, device))
