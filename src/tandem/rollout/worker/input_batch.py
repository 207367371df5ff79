"""A step's input tensors, built from the running batch's block tables kept across steps.

As vLLM v1's persistent batch: each sequence of a step holds a row of one block-table
tensor for as long as it stays in consecutive steps, and a step writes only the entries
that changed since the last, in one indexed write. A decode's table changes only at its
end (a block added, or its last block copied on write) between two steps; a prefill chunk's
row is written whole (any of its blocks may have changed: a cache hit, a resumed
continuation, a recompute after preemption). The step's ``block_tables`` are the rows of its
sequences, its ``slot_mapping`` gathered from them for every position, both in tensor ops;
Python touches each sequence a few times per step, never each of its blocks. With KV groups
(``core/kv_groups.py``) each group has a table tensor of its own, its rows the same
sequences', written by the same updates; the other groups' slot mappings and tables go in
``AttentionMetadata.kv_groups``. A sliding group's entries before its window may be stale
(a page dropped since the row was written): no kernel reads a page wholly before a
query's window unmasked, and the writes land in this step's blocks, which are current.

A step's inputs are built in host memory (pinned for a CUDA device) and go to the device
when a rank runs them (``StepInputs.on_device``), so a tensor-parallel driver sends what the
host knows without reading anything back from the device (which would wait for the step
before).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

import torch

from tandem.kernels import AttentionMetadata

from ..core.scheduled_batch import ScheduledBatch
from ..core.sequence import Sequence
from .attention_layout import cascade_layout, long_tensor, to_device

HOST = torch.device("cpu")

ScoredPositions = list[tuple[int, int, int]]  # (batch row, first, end) prompt positions
# rows, columns and, per KV group, the values of table entries
Updates = tuple[list[int], list[int], list[list[int]]]


@dataclass(slots=True)
class StepInputs:
    """One step's tensors, all a rank needs to run it: the flat token stream, its attention
    metadata, the rows whose logits are needed (the sampling rows, then the prompt
    positions scored for prompt log-probs) and the copy-on-write block copies
    (``[2, copies]``: sources, destinations).

    Built in host memory, as the host knows them: a decode whose token is pending (sampled
    by the last step, not yet read) holds the token before it in ``input_ids``, its row is
    in ``pending_rows``, and ``pending_ids`` holds those tokens (int64) on the device: taken
    from the runner's own samples, or on a tensor-parallel worker broadcast by the driver
    over the device group (None until then). ``on_device`` writes them in there.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logit_rows: torch.Tensor
    copies: torch.Tensor
    pending_rows: list[int] = field(default_factory=list)
    pending_ids: torch.Tensor | None = None

    def on_device(self, device: torch.device) -> StepInputs:
        """This step on ``device`` (host tensors copied without waiting for the device), its
        pending decodes' inputs filled in from ``pending_ids`` there; ``self`` unchanged."""
        step = _map_tensors(self, lambda tensor: to_device(tensor, device)
                            if tensor.device.type == "cpu" else tensor)
        if self.pending_rows:
            rows = long_tensor(self.pending_rows, device)
            step.input_ids = step.input_ids.index_put((rows,), self.pending_ids)
        return step


def _map_tensors(value: Any, convert: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``value`` with ``convert`` applied to each tensor in it, through dataclasses."""
    if isinstance(value, torch.Tensor):
        return convert(value)
    if is_dataclass(value):
        return type(value)(**{f.name: _map_tensors(getattr(value, f.name), convert)
                              for f in fields(value)})
    return value


class InputBatch:
    """The block tables of the last step's sequences, one row each, and the step inputs.

    Args:
        block_size: tokens per KV block.
        device: where the steps run: on CUDA their host tensors are pinned, so that the
            copies there wait for nothing queued before them (see ``to_device``).
        cascade: lay the decodes out for cascade attention (the torch kernels).
        num_groups: the KV groups, each with its table per sequence.
    """

    def __init__(self, block_size: int, device: torch.device, cascade: bool,
                 num_groups: int = 1) -> None:
        self.block_size = block_size
        self.device = device
        self.cascade = cascade
        # per KV group: [rows, widest table so far]
        self.tables = [torch.zeros(0, 0, dtype=torch.long) for _ in range(num_groups)]
        self.row_of: dict[int, int] = {}  # seq_id -> its row, for the last step's sequences
        self.free_rows: list[int] = []
        self.lengths: list[int] = []  # per row: its table's length (entries past it are 0)
        # per row: its tables' last blocks (-1: none)
        self.last_blocks: list[int | tuple[int, ...]] = []

    def prepare(self, batch: ScheduledBatch) -> tuple[StepInputs, int, ScoredPositions]:
        """The step's inputs in host memory (no pending rows marked: the runner knows where
        their tokens are), how many of its logit rows sample, and the prompt positions it
        scores (see ``scored_positions``)."""
        seqs, num_new = batch.seqs, batch.num_new_tokens
        num_decodes = batch.num_decodes
        starts = [seq.num_computed_tokens for seq in seqs]
        input_ids = [seq.token_ids[-1] for seq in seqs[:num_decodes]]
        sample_rows = list(range(num_decodes))
        end = num_decodes
        for seq, start, count in zip(seqs[num_decodes:], starts[num_decodes:],
                                     num_new[num_decodes:]):
            input_ids += seq.token_ids[start:start + count]
            end += count
            if start + count == seq.num_tokens:
                sample_rows.append(end - 1)
        num_new_t, starts_t = torch.tensor(num_new), torch.tensor(starts)
        cu_seqlens_q = torch.zeros(len(seqs) + 1, dtype=torch.long)
        torch.cumsum(num_new_t, 0, out=cu_seqlens_q[1:])
        rows, block_tables = self.block_tables(seqs, num_decodes)
        if len(seqs) == num_decodes:
            positions, token_rows = starts_t, rows
        else:
            offsets = torch.repeat_interleave(cu_seqlens_q[:-1] - starts_t, num_new_t)
            positions = torch.arange(end) - offsets
            token_rows = torch.repeat_interleave(rows, num_new_t)
        groups = [AttentionMetadata(
            slot_mapping=self.slot_mapping(token_rows, positions, group), block_tables=tables,
            context_lens=starts_t + num_new_t, cu_seqlens_q=cu_seqlens_q,
            num_decodes=num_decodes, max_query_len=max(num_new))
            for group, tables in enumerate(block_tables)]
        metadata = groups[0]
        metadata.kv_groups = groups[1:]
        if self.cascade and num_decodes:
            metadata.cascade = cascade_layout(batch, self.block_size, HOST)
        scored = scored_positions(batch)
        chunk_starts = cu_seqlens_q.tolist() if scored else []
        prompt_rows = [chunk_starts[i] - starts[i] + position
                       for i, first, last in scored for position in range(first, last)]
        copies = long_tensor([list(c) for c in zip(*batch.copies)], HOST).view(2, -1)
        step = StepInputs(long_tensor(input_ids, HOST), positions, metadata,
                          long_tensor(sample_rows + prompt_rows, HOST), copies)
        if self.device.type == "cuda":
            step = _map_tensors(step, torch.Tensor.pin_memory)
        return step, len(sample_rows), scored

    def block_tables(self, seqs: list[Sequence], num_decodes: int
                     ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Bring the rows up to date with ``seqs``' block tables (the first ``num_decodes``
        of them decodes); return each sequence's row and, per KV group, their tables padded
        with 0 to the longest."""
        self._release_rows_of_others(seqs)
        updates: Updates = ([], [], [])
        row_of, lengths, last_blocks = self.row_of, self.lengths, self.last_blocks
        rows = []
        for seq in seqs[:num_decodes]:
            table, row = seq.block_table, row_of.get(seq.seq_id)
            if row is None or len(table) != lengths[row] or _last(seq) != last_blocks[row]:
                row = self._write_row(seq, row, False, updates)
            rows.append(row)
        rows += [self._write_row(seq, row_of.get(seq.seq_id), True, updates)
                 for seq in seqs[num_decodes:]]
        self._apply(updates)
        rows_t = torch.tensor(rows)
        width = max(map(lengths.__getitem__, rows))
        return rows_t, [tables[rows_t, :width] for tables in self.tables]

    def slot_mapping(self, token_rows: torch.Tensor, positions: torch.Tensor,
                     group: int = 0) -> torch.Tensor:
        """The pool slot of each position of the sequence in row ``token_rows``, in KV
        group ``group``'s pages."""
        blocks = self.tables[group][token_rows, positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def _release_rows_of_others(self, seqs: list[Sequence]) -> None:
        """Free the rows of the sequences not in this step (finished, preempted or left
        out): a sequence that comes back gets a row written whole."""
        gone = self.row_of.keys() - {seq.seq_id for seq in seqs}
        for seq_id in gone:
            self.free_rows.append(self.row_of.pop(seq_id))

    def _take_row(self) -> int:
        if not self.free_rows:
            num_rows, width = self.tables[0].shape
            grown = max(2 * num_rows, 8)
            self.tables = [torch.cat([tables, torch.zeros(grown - num_rows, width,
                                                          dtype=torch.long)])
                           for tables in self.tables]
            self.free_rows = list(range(grown - 1, num_rows - 1, -1))
            self.lengths += [0] * (grown - num_rows)
            self.last_blocks += [-1] * (grown - num_rows)
        return self.free_rows.pop()

    def _write_row(self, seq: Sequence, row: int | None, whole: bool, updates: Updates) -> int:
        """Queue the writes that bring ``seq``'s row (a new one for None) up to date with
        its block tables: all of them when ``whole`` or new, else from their old last entry
        on; zeros over the rest of the row's old tables. Returns the row."""
        table = seq.block_table
        if row is None:
            row = self.row_of[seq.seq_id] = self._take_row()
            whole = True
        old_length = self.lengths[row]
        first = 0 if whole else max(min(len(table), old_length) - 1, 0)
        rows, columns, values = updates
        columns += range(first, max(len(table), old_length))
        if not values:
            values += [[] for _ in self.tables]
        for group_values, group_table in zip(values, seq.tables(), strict=True):
            group_values += group_table[first:]
            group_values += [0] * (old_length - len(table))
        rows += [row] * (len(columns) - len(rows))
        self.lengths[row] = len(table)
        self.last_blocks[row] = _last(seq) if table else -1
        return row

    def _apply(self, updates: Updates) -> None:
        """Write the queued entries in one indexed write (widening the rows if needed)."""
        rows, columns, values = updates
        if not rows:
            return
        num_rows, old_width = self.tables[0].shape
        width = max(columns) + 1
        if width > old_width:
            self.tables = [torch.cat([tables, torch.zeros(
                num_rows, width - old_width, dtype=torch.long)], dim=1)
                for tables in self.tables]
        rows_t, columns_t = torch.tensor(rows), torch.tensor(columns)
        for tables, group_values in zip(self.tables, values, strict=True):
            tables[rows_t, columns_t] = torch.tensor(group_values)


def _last(seq: Sequence) -> int | tuple[int, ...]:
    """The last entry of ``seq``'s block table, with every other KV group's: what a decode's
    step changes when it adds a block or copies its last one on write."""
    if not seq.group_tables:
        return seq.block_table[-1]
    return tuple(table[-1] for table in seq.tables())


def scored_positions(batch: ScheduledBatch) -> ScoredPositions:
    """``(batch row, start, end)`` of the prompt positions each chunk scores that were not
    scored before (a recompute after preemption scores none; a decode never scores)."""
    scored = []
    for i in range(batch.num_decodes, len(batch.seqs)):
        seq = batch.seqs[i]
        if not seq.needs_prompt_logprobs:
            continue
        start = max(seq.num_computed_tokens, len(seq.prompt_logprobs))
        end = min(seq.num_computed_tokens + batch.num_new_tokens[i], seq.num_prompt_tokens - 1)
        if start < end:
            scored.append((i, start, end))
    return scored
