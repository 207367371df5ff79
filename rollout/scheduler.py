"""Continuous batching: which sequences run in the next step, and how many tokens each.

The scheduler fills a token budget per step: running decodes first (one token each), then
prefill chunks of admitted and waiting sequences, mixed in one step. When blocks run out it
preempts the newest running sequence (recompute: its blocks are freed with their hashes
kept, so its recompute hits the prefix cache). A group's prompt is prefilled once by its
first sequence; when it completes, the other sequences fork from it. It never touches a
tensor; the model runner turns its ``ScheduledBatch`` into one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work: ``seqs[i]`` computes its next ``num_new_tokens[i]`` tokens.

    The first ``num_decodes`` sequences are decodes (one token each); the rest are prefill
    chunks. A sequence samples a token when its chunk reaches its last token. ``copies`` are
    the ``(source, destination)`` KV blocks to copy before the step (copy-on-write).
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_decodes: int = 0
    copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        """Tokens computed in this step."""
        return sum(self.num_new_tokens)

    def samples(self, i: int) -> bool:
        """True when ``seqs[i]`` samples a token at the end of this step."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] == seq.num_tokens

    def sampling_groups(self) -> list[list[Sequence]]:
        """The sequences sampling from each sampling row's logits, in batch order.

        A row's group is its sequence and, when a group's prompt completes, the children that
        fork from it.
        """
        return [[seq, *_live(seq.pending_children)]
                for i, seq in enumerate(self.seqs) if self.samples(i)]

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        """Schedule ``num_new_tokens`` of ``seq``."""
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)


class Scheduler:
    """Admits, batches, preempts and retires sequences under a token and a block budget."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int,
                 max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence at the back of the waiting queue."""
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's sequences: decodes, then running prefills, then admissions."""
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        for seq in [s for s in self.running if s.num_uncomputed_tokens == 1]:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop to make room for an older sequence
            if self._reserve_decode_slot(seq, batch):
                batch.add(seq, 1)
                budget -= 1
        batch.num_decodes = len(batch.seqs)
        for seq in [s for s in self.running if s.num_uncomputed_tokens > 1]:
            if budget == 0:
                break
            self._schedule_chunk(batch, seq, budget)
            budget -= batch.num_new_tokens[-1]
        while budget > 0 and self.waiting and self._admit(self.waiting[0]):
            self._schedule_chunk(batch, self.waiting.popleft(), budget)
            budget -= batch.num_new_tokens[-1]
        return batch

    def _schedule_chunk(self, batch: ScheduledBatch, seq: Sequence, budget: int) -> None:
        chunk = min(seq.num_uncomputed_tokens, budget)
        self.block_manager.register_full_blocks(seq, seq.num_computed_tokens + chunk)
        batch.add(seq, chunk)

    def _admit(self, seq: Sequence) -> bool:
        """Give ``seq`` (and room for its group) blocks for all its tokens, cache hits first."""
        group_size = 1 + len(seq.pending_children)
        if len(self.running) + group_size > self.max_num_seqs:
            return False
        num_hit_tokens = self.block_manager.admit(seq)
        if num_hit_tokens is None:
            return False
        seq.num_computed_tokens = num_hit_tokens
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return True

    def _reserve_decode_slot(self, seq: Sequence, batch: ScheduledBatch) -> bool:
        """Make ``seq``'s next token writable, preempting the newest sequences if needed.

        Returns False when ``seq`` itself had to be preempted.
        """
        while not self.block_manager.can_append(seq, seq.num_tokens):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        copy = self.block_manager.append(seq, seq.num_tokens)
        if copy is not None:
            batch.copies.append(copy)
        self.block_manager.register_full_blocks(seq, seq.num_tokens)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and requeue it at the front; it is recomputed later."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def update(self, batch: ScheduledBatch, sampled_token_ids: list[int],
               weight_version: int) -> list[Sequence]:
        """Advance each scheduled sequence, fork completed group prompts, append tokens.

        ``sampled_token_ids`` holds one token per sequence of ``batch.sampling_groups()``, in
        that order. Returns the sequences that received a token, in the same order.
        """
        sampled: list[Sequence] = []
        tokens = iter(sampled_token_ids)
        for i, seq in enumerate(batch.seqs):
            samples = batch.samples(i)
            seq.num_computed_tokens += batch.num_new_tokens[i]
            if samples:
                for member in self._fork(seq):
                    member.append_token(next(tokens), weight_version)
                    sampled.append(member)
        return sampled

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Start ``parent``'s pending children on its blocks; return the whole group."""
        children = _live(parent.pending_children)
        parent.pending_children = []
        for child in children:
            self.block_manager.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
        return [parent, *children]

    def finish(self, seq: Sequence, finish_reason: str) -> None:
        """Retire ``seq`` (done or aborted) and return its blocks to the pool."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        # a FORK_PENDING child holds nothing; its parent will skip it
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = finish_reason


def _live(seqs: list[Sequence]) -> list[Sequence]:
    return [seq for seq in seqs if not seq.is_finished]
