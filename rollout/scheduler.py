"""Continuous batching: which sequences run in the next step, and how many tokens each.

The scheduler fills a token budget per step: running decodes first (one token each), then
prefill chunks of admitted and waiting sequences, mixed in one step. It never touches a
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
    chunks. A sequence samples a token when its chunk reaches its last token.
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_decodes: int = 0

    @property
    def num_batched_tokens(self) -> int:
        """Tokens computed in this step."""
        return sum(self.num_new_tokens)

    def samples(self, i: int) -> bool:
        """True when ``seqs[i]`` samples a token at the end of this step."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] == seq.num_tokens

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

    def has_unfinished(self) -> bool:
        """True while any sequence waits or runs."""
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Pick this step's sequences: decodes, then running prefills, then admissions."""
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        for seq in [s for s in self.running if s.num_uncomputed_tokens == 1]:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop to make room for an older sequence
            if self._reserve_decode_slot(seq):
                batch.add(seq, 1)
                budget -= 1
        batch.num_decodes = len(batch.seqs)
        for seq in [s for s in self.running if s.num_uncomputed_tokens > 1]:
            if budget == 0:
                break
            chunk = min(seq.num_uncomputed_tokens, budget)
            batch.add(seq, chunk)
            budget -= chunk
        while budget > 0 and self.waiting and len(self.running) < self.max_num_seqs:
            chunk = self._admit(self.waiting[0], budget)
            if chunk == 0:
                break
            batch.add(self.waiting.popleft(), chunk)
            budget -= chunk
        return batch

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Give ``seq`` blocks for all its tokens and a first chunk; 0 when blocks lack."""
        if not self.block_manager.can_allocate(seq, seq.num_tokens):
            return 0
        self.block_manager.allocate(seq, seq.num_tokens)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return min(seq.num_uncomputed_tokens, budget)

    def _reserve_decode_slot(self, seq: Sequence) -> bool:
        """Make room for ``seq``'s next token, preempting the newest sequences if needed.

        Returns False when ``seq`` itself had to be preempted.
        """
        while not self.block_manager.can_allocate(seq, seq.num_tokens):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        self.block_manager.allocate(seq, seq.num_tokens)
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
        """Advance each scheduled sequence and append the tokens sampled in this step.

        ``sampled_token_ids`` holds one token per sampling sequence, in batch order.
        Returns the sequences that received a token.
        """
        sampled: list[Sequence] = []
        tokens = iter(sampled_token_ids)
        for i, seq in enumerate(batch.seqs):
            samples = batch.samples(i)
            seq.num_computed_tokens += batch.num_new_tokens[i]
            if samples:
                seq.append_token(next(tokens), weight_version)
                sampled.append(seq)
        return sampled

    def finish(self, seq: Sequence, finish_reason: str) -> None:
        """Retire ``seq`` (done or aborted) and return its blocks to the pool."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = finish_reason
