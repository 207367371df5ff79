"""A step's rows split into micro-batches (gradient accumulation), whole groups together
when the forward shares prefixes.

A forward that computes each shared prefix once (``ExactForward`` with ``shared_prefix``)
shares it only among the rows of one micro-batch, so ``group_slices`` keeps each group's
rows (a run of equal group ids: the completions of one prompt) together and packs groups by
their cost: the prefix once plus the suffixes, and each row's kept positions (``C + 1``
through the LM head and the log-softmax, whose tensors grow per row). The budget is the
cost of ``micro_batch_size`` rows computed whole, so a micro-batch never holds more work
than an unshared one; a group over it alone is split by rows. Without sharing the rows are
cut every ``micro_batch_size`` (``row_slices``).
"""

from __future__ import annotations

import torch

from tandem.rollout.worker.shared_prefix import token_stream

from .policy import TokenBatch


def row_slices(num_rows: int, size: int) -> list[slice]:
    """``num_rows`` rows in slices of ``size`` (the last shorter)."""
    return [slice(start, min(start + size, num_rows)) for start in range(0, num_rows, size)]


def stream_costs(batch: TokenBatch, group_ids: torch.Tensor, share: bool) -> torch.Tensor:
    """``[B]`` each row's cost in a micro-batch: its kept positions (``C + 1``) plus the
    tokens it adds to the forward's stream: with ``share`` those past its longest common
    prefix with the row before in its group (``token_stream``), else all of its tokens."""
    groups = group_ids.to(batch.input_ids)[:, None].expand_as(batch.input_ids)
    keys = torch.stack([batch.input_ids, batch.position_ids, groups], -1)
    added = token_stream(keys, batch.attention_mask, share).added
    return (added + batch.num_completion_slots + 1).cpu()


def group_slices(batch: TokenBatch, group_ids: torch.Tensor, size: int) -> list[slice]:
    """Slices of ``batch``'s rows for a forward that shares prefixes: whole groups (runs
    of equal ``group_ids``), packed in order while a slice costs (``stream_costs``) at
    most ``size`` average rows computed whole; a group over that alone cut by rows, each
    piece's first row counted whole."""
    shared, whole = (stream_costs(batch, group_ids, share) for share in (True, False))
    budget = size * float(whole.float().mean())
    totals = torch.cat([shared.new_zeros(1), shared.cumsum(0)]).tolist()
    extra = (whole - shared).tolist()  # a slice's first row is computed whole

    def cost(start: int, end: int) -> float:
        return totals[end] - totals[start] + extra[start]

    slices, start = [], 0
    for unit_start, unit_end in _groups(group_ids):
        if unit_start > start and cost(start, unit_end) > budget:
            slices.append(slice(start, unit_start))
            start = unit_start
        for row in range(max(start, unit_start) + 1, unit_end):  # a group over it alone
            if cost(start, row + 1) > budget:
                slices.append(slice(start, row))
                start = row
    return [*slices, slice(start, len(shared))] if len(shared) else slices


def _groups(group_ids: torch.Tensor) -> list[tuple[int, int]]:
    """The runs of equal consecutive ``group_ids``, as (start, end) rows."""
    ids = group_ids.tolist()
    starts = [row for row in range(len(ids)) if row == 0 or ids[row] != ids[row - 1]]
    return list(zip(starts, [*starts[1:], len(ids)]))
