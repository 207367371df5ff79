"""Block manager invariants under random allocate / grow / free sequences (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from tandem.rollout.block_manager import BlockManager, num_blocks_for
from tandem.rollout.sampling_params import SamplingParams
from tandem.rollout.sequence import Sequence

NUM_BLOCKS, BLOCK_SIZE = 12, 4


class BlockManagerMachine(RuleBasedStateMachine):
    """Sequences come, grow and go; the pool's accounting must always add up."""

    def __init__(self) -> None:
        super().__init__()
        self.manager = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.seqs: list[Sequence] = []
        self.next_id = 0

    @rule(num_tokens=st.integers(1, 3 * BLOCK_SIZE + 1))
    def allocate(self, num_tokens: int) -> None:
        seq = Sequence(seq_id=self.next_id, request_id="r", index=0, token_ids=[0] * num_tokens,
                       num_prompt_tokens=num_tokens, sampling_params=SamplingParams())
        self.next_id += 1
        if self.manager.can_allocate(seq, num_tokens):
            self.manager.allocate(seq, num_tokens)
            self.seqs.append(seq)
        else:
            with pytest.raises(RuntimeError):
                self.manager.allocate(seq, num_tokens)
            assert seq.block_table == []

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), extra=st.integers(1, BLOCK_SIZE + 1))
    def grow(self, data: st.DataObject, extra: int) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        seq.token_ids += [0] * extra
        if self.manager.can_allocate(seq, seq.num_tokens):
            self.manager.allocate(seq, seq.num_tokens)
        else:
            seq.token_ids = seq.token_ids[:-extra]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        self.seqs.remove(seq)
        self.manager.free(seq)
        assert seq.block_table == []

    @invariant()
    def accounting_adds_up(self) -> None:
        held = [b for seq in self.seqs for b in seq.block_table]
        assert len(held) == len(set(held)), "a block is held by two sequences"
        assert all(count >= 0 for count in self.manager.ref_counts)
        assert set(held).isdisjoint(self.manager.free_block_ids)
        assert len(held) + self.manager.num_free_blocks == NUM_BLOCKS
        for seq in self.seqs:
            assert len(seq.block_table) == num_blocks_for(seq.num_tokens, BLOCK_SIZE)

    def teardown(self) -> None:
        for seq in self.seqs:
            self.manager.free(seq)
        assert self.manager.num_free_blocks == NUM_BLOCKS


TestBlockManager = BlockManagerMachine.TestCase


def test_double_free_is_refused():
    manager = BlockManager(4, BLOCK_SIZE)
    seq = Sequence(seq_id=0, request_id="r", index=0, token_ids=[1, 2, 3], num_prompt_tokens=3,
                   sampling_params=SamplingParams())
    manager.allocate(seq, 3)
    table = list(seq.block_table)
    manager.free(seq)
    seq.block_table = table
    with pytest.raises(RuntimeError, match="double free"):
        manager.free(seq)
