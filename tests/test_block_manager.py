"""Block manager invariants under random admit / append / fork / free / preempt / evict.

The machine keeps its own model of the pool's content (which token each slot holds), written
only where the block manager says a sequence may write, and checks every cache hit and every
cached hash against it.
"""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tandem.rollout.block_manager import BlockManager, block_hash, num_blocks_for
from tandem.rollout.sampling_params import SamplingParams
from tandem.rollout.sequence import Sequence

NUM_BLOCKS, BLOCK_SIZE = 16, 4
# A three-letter alphabet makes shared prefixes, and so cache hits, common.
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=3 * BLOCK_SIZE + 1)


def make_seq(seq_id: int, token_ids: list[int]) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=str(seq_id), index=0, token_ids=list(token_ids),
                    num_prompt_tokens=len(token_ids), sampling_params=SamplingParams())


class BlockManagerMachine(RuleBasedStateMachine):
    """Sequences come, grow, fork, get preempted and go; the accounting must always add up."""

    def __init__(self) -> None:
        super().__init__()
        self.manager = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.seqs: list[Sequence] = []
        self.content: dict[int, list[int | None]] = {
            b: [None] * BLOCK_SIZE for b in range(NUM_BLOCKS)}
        self.tokens_of_hash: dict[int, tuple[int, ...]] = {}
        self.next_id = 0

    def write(self, seq: Sequence, start: int, end: int) -> None:
        """Compute tokens [start, end) of ``seq`` into its blocks, as the model would."""
        for position in range(start, end):
            block_id = seq.block_table[position // BLOCK_SIZE]
            assert self.manager.blocks[block_id].ref_count == 1, "write into a shared block"
            self.content[block_id][position % BLOCK_SIZE] = seq.token_ids[position]
        seq.num_computed_tokens = end

    def register(self, seq: Sequence, num_tokens: int) -> None:
        self.manager.register_full_blocks(seq, num_tokens)
        parent = None
        for index in range(num_tokens // BLOCK_SIZE):
            tokens = tuple(seq.token_ids[index * BLOCK_SIZE:(index + 1) * BLOCK_SIZE])
            parent = block_hash(parent, self.manager.extra_key, tokens)
            self.tokens_of_hash[parent] = tokens

    def admit_and_prefill(self, seq: Sequence) -> bool:
        free_before = self.manager.num_free_blocks
        num_hit_tokens = self.manager.admit(seq)
        if num_hit_tokens is None:
            assert self.manager.num_free_blocks == free_before and seq.block_table == []
            return False
        assert num_hit_tokens % BLOCK_SIZE == 0 and num_hit_tokens < seq.num_tokens
        for position in range(num_hit_tokens):
            block_id = seq.block_table[position // BLOCK_SIZE]
            assert self.content[block_id][position % BLOCK_SIZE] == seq.token_ids[position]
        self.register(seq, seq.num_tokens)
        self.write(seq, num_hit_tokens, seq.num_tokens)
        self.seqs.append(seq)
        return True

    @rule(token_ids=TOKENS)
    def admit(self, token_ids: list[int]) -> None:
        self.next_id += 1
        self.admit_and_prefill(make_seq(self.next_id, token_ids))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), token=st.integers(0, 2))
    def append(self, data: st.DataObject, token: int) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        seq.token_ids.append(token)
        if not self.manager.can_append(seq, seq.num_tokens):
            seq.token_ids.pop()
            return
        copy = self.manager.append(seq, seq.num_tokens)
        if copy is not None:
            source, destination = copy
            self.content[destination] = list(self.content[source])
        self.register(seq, seq.num_tokens)
        self.write(seq, seq.num_tokens - 1, seq.num_tokens)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self.seqs))
        self.next_id += 1
        child = make_seq(self.next_id, parent.token_ids)
        self.manager.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        self.seqs.append(child)

    def drop(self, data: st.DataObject) -> Sequence:
        seq = data.draw(st.sampled_from(self.seqs))
        self.seqs.remove(seq)
        self.manager.free(seq)
        assert seq.block_table == []
        return seq

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self.drop(data)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def preempt_and_readmit(self, data: st.DataObject) -> None:
        seq = self.drop(data)
        seq.num_computed_tokens = 0
        self.admit_and_prefill(seq)

    @rule()
    def reset_prefix_cache(self) -> None:
        self.manager.reset_prefix_cache()
        assert self.manager.num_cached_free_blocks == 0

    @invariant()
    def reference_counts_match_holders(self) -> None:
        holders = [0] * NUM_BLOCKS
        for seq in self.seqs:
            for block_id in seq.block_table:
                holders[block_id] += 1
            assert len(seq.block_table) == num_blocks_for(seq.num_tokens, BLOCK_SIZE)
        assert [block.ref_count for block in self.manager.blocks] == holders
        free = set(self.manager.free_block_ids) | set(self.manager.untouched_block_ids)
        assert len(free) == self.manager.num_free_blocks
        assert free == {b for b in range(NUM_BLOCKS)
                                                    if holders[b] == 0}

    @invariant()
    def cached_hashes_point_at_their_tokens(self) -> None:
        for hash_value, block_id in self.manager.cached_block_ids.items():
            block = self.manager.blocks[block_id]
            assert block.block_hash == hash_value
            assert tuple(self.content[block_id]) == self.tokens_of_hash[hash_value]

    @invariant()
    def sequences_see_their_own_tokens(self) -> None:
        for seq in self.seqs:
            for position in range(seq.num_computed_tokens):
                block_id = seq.block_table[position // BLOCK_SIZE]
                assert self.content[block_id][position % BLOCK_SIZE] == seq.token_ids[position]

    def teardown(self) -> None:
        for seq in self.seqs:
            self.manager.free(seq)
        assert self.manager.num_free_blocks == NUM_BLOCKS
        assert all(block.ref_count == 0 for block in self.manager.blocks)


TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_double_free_is_refused():
    manager = BlockManager(4, BLOCK_SIZE)
    seq = make_seq(0, [1, 2, 3])
    manager.admit(seq)
    table = list(seq.block_table)
    manager.free(seq)
    seq.block_table = table
    with pytest.raises(RuntimeError, match="double free"):
        manager.free(seq)


def test_eviction_takes_least_recently_freed_block_chain_tail_first():
    manager = BlockManager(5, BLOCK_SIZE)
    seq = make_seq(0, list(range(3 * BLOCK_SIZE)))
    manager.admit(seq)
    manager.register_full_blocks(seq, seq.num_tokens)
    head, middle, tail = seq.block_table
    manager.free(seq)
    assert manager.num_cached_free_blocks == 3
    other = make_seq(1, [99] * BLOCK_SIZE)
    assert manager.admit(other) == 0
    assert other.block_table == [tail]  # freed blocks before untouched ones, the tail first
    assert manager.num_cached_free_blocks == 2
    again = make_seq(2, list(range(3 * BLOCK_SIZE)))
    assert manager.admit(again) == 2 * BLOCK_SIZE
    assert again.block_table[:2] == [head, middle]
    assert again.block_table[2] == 3 and manager.untouched_block_ids == deque([4])
