"""Block manager invariants under random admission, chunked prefill, decode growth, fork,
free, preemption, eviction and weight updates.

The machine keeps its own model of the pool, independent of the block manager's hashing:
which token each slot holds, written only where the block manager says a sequence may
write, and, for each full block, the whole prefix (from the first token) and the weight
version it was computed under. Every cache hit must serve a block whose recorded prefix and
version equal the sequence's own.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tandem.rollout.core import block_manager
from tandem.rollout.core.block_manager import NULL_PAGE, BlockManager, num_blocks_for
from tandem.rollout.core.sequence import Sequence
from tandem.rollout.sampling_params import SamplingParams

NUM_BLOCKS, BLOCK_SIZE = 16, 4
# A three-letter alphabet makes shared prefixes, and so cache hits, common.
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=3 * BLOCK_SIZE + 1)
BUDGETS = st.integers(1, 3 * BLOCK_SIZE + 1)


def make_seq(seq_id: int, token_ids: list[int]) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=str(seq_id), index=0, token_ids=list(token_ids),
                    num_prompt_tokens=len(token_ids), sampling_params=SamplingParams())


class BlockManagerMachine(RuleBasedStateMachine):
    """Sequences come, grow, fork, get preempted and go; the accounting must always add up.

    ``WINDOWS`` are the KV groups' sliding windows (``kv_groups.py``): one full group here;
    the subclasses below add a full and a sliding group, or a window under a block."""

    WINDOWS: tuple[int | None, ...] = (None,)
    NUM_BLOCKS = NUM_BLOCKS

    def __init__(self) -> None:
        super().__init__()
        self.manager = BlockManager(self.NUM_BLOCKS, BLOCK_SIZE, windows=self.WINDOWS)
        self.reserved = self.manager.num_reserved
        self.version = 0
        self.seqs: list[Sequence] = []
        self.content: dict[int, list[int | None]] = {
            b: [None] * BLOCK_SIZE for b in range(self.NUM_BLOCKS)}
        self.prefix_of_block: dict[int, tuple[int, tuple[int, ...]]] = {}
        self.next_id = 0

    def write(self, seq: Sequence, start: int, end: int) -> None:
        """Compute tokens [start, end) of ``seq`` into its blocks (each group's page), as
        the model would."""
        for position in range(start, end):
            for table in seq.tables():
                block_id = table[position // BLOCK_SIZE]
                assert block_id != NULL_PAGE or not self.reserved, "write into a dropped page"
                assert self.manager.blocks[block_id].ref_count == 1, "write into a shared block"
                offset = position % BLOCK_SIZE
                if offset == 0:
                    self.prefix_of_block.pop(block_id, None)
                self.content[block_id][offset] = seq.token_ids[position]
                if offset == BLOCK_SIZE - 1:
                    self.prefix_of_block[block_id] = (self.version,
                                                      tuple(seq.token_ids[:position + 1]))
        seq.num_computed_tokens = end

    def first_needed(self, window: int | None, position: int) -> int:
        """The first block a sliding group needs for a token at ``position`` (0: full)."""
        return 0 if window is None else max(position - window + 1, 0) // BLOCK_SIZE

    def allocate_and_compute(self, seq: Sequence, budget: int) -> bool:
        """One scheduled step of ``seq``: allocate, check any cache hit, copy, compute."""
        admitting = not seq.block_table
        free_before = self.manager.num_free_blocks
        lengths = [len(table) for table in seq.tables()]
        allocation = self.manager.allocate_slots(seq, budget)
        if allocation is None:  # nothing taken; pages out of a window may have been dropped
            assert self.manager.num_free_blocks == free_before or \
                self.reserved and self.manager.num_free_blocks > free_before
            assert [len(table) for table in seq.tables()] == lengths or admitting
            assert (seq.block_table == []) == admitting
            return False
        cached = allocation.num_cached_tokens
        assert cached % BLOCK_SIZE == 0 and cached < seq.num_tokens
        assert cached == 0 or admitting
        for table, window in zip(seq.tables(), self.WINDOWS, strict=True):
            for index in range(self.first_needed(window, cached), cached // BLOCK_SIZE):
                expected = (self.version, tuple(seq.token_ids[:(index + 1) * BLOCK_SIZE]))
                assert self.prefix_of_block[table[index]] == expected
        for source, destination in allocation.copies:
            self.content[destination] = list(self.content[source])
        start = seq.num_computed_tokens + cached
        for table, window in zip(seq.tables(), self.WINDOWS, strict=True):
            first = self.first_needed(window, start)  # a sliding group: only from its window
            assert table[:first] == [NULL_PAGE] * first and NULL_PAGE not in table[first:] \
                or not self.reserved
        assert 1 <= allocation.num_new_tokens <= min(budget, seq.num_tokens - start)
        self.write(seq, start, start + allocation.num_new_tokens)
        return True

    @rule(token_ids=TOKENS, budget=BUDGETS)
    def admit(self, token_ids: list[int], budget: int) -> None:
        self.next_id += 1
        seq = make_seq(self.next_id, token_ids)
        if self.allocate_and_compute(seq, budget):
            self.seqs.append(seq)

    @precondition(lambda self: any(s.num_uncomputed_tokens for s in self.seqs))
    @rule(data=st.data(), budget=BUDGETS)
    def continue_prefill(self, data: st.DataObject, budget: int) -> None:
        seq = data.draw(st.sampled_from([s for s in self.seqs if s.num_uncomputed_tokens]))
        assert self.allocate_and_compute(seq, budget), "a running prefill holds its blocks"

    @precondition(lambda self: any(not s.num_uncomputed_tokens for s in self.seqs))
    @rule(data=st.data(), token=st.integers(0, 2))
    def decode(self, data: st.DataObject, token: int) -> None:
        seq = data.draw(st.sampled_from([s for s in self.seqs if not s.num_uncomputed_tokens]))
        seq.token_ids.append(token)
        in_place = self.manager.appends_in_place(seq)
        before = ([list(t) for t in seq.tables()], list(seq.block_hashes),
                  self.manager.num_free_blocks, dict(self.manager.cached_block_ids))
        assert not (in_place and self.drops_pages(seq))
        if not self.allocate_and_compute(seq, 1):
            seq.token_ids.pop()
        elif in_place:  # the scheduler skips allocate_slots: it must have changed nothing
            assert before == (seq.tables(), seq.block_hashes, self.manager.num_free_blocks,
                              self.manager.cached_block_ids)

    def drops_pages(self, seq: Sequence) -> bool:
        """True when ``allocate_slots`` would drop a page out of a window of ``seq``
        (which a decode appending in place may leave for later)."""
        return any(table[:self.first_needed(window, seq.num_computed_tokens)].count(NULL_PAGE)
                   < min(self.first_needed(window, seq.num_computed_tokens), len(table))
                   for table, window in zip(seq.tables(), self.WINDOWS, strict=True))

    @precondition(lambda self: any(not s.num_uncomputed_tokens for s in self.seqs))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from([s for s in self.seqs if not s.num_uncomputed_tokens]))
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
    @rule(data=st.data(), budget=BUDGETS)
    def preempt_and_readmit(self, data: st.DataObject, budget: int) -> None:
        seq = self.drop(data)
        seq.num_computed_tokens = 0
        if self.allocate_and_compute(seq, budget):
            self.seqs.append(seq)

    @rule()
    def reset_prefix_cache(self) -> None:
        self.manager.reset_prefix_cache()
        assert self.manager.num_cached_free_blocks == 0

    @rule()
    def update_weights(self) -> None:
        self.version += 1
        self.manager.extra_key = (self.version, None)

    @invariant()
    def reference_counts_match_holders(self) -> None:
        holders = [0] * self.NUM_BLOCKS
        for seq in self.seqs:
            for table in seq.tables():
                for block_id in table:
                    holders[block_id] += block_id != NULL_PAGE or not self.reserved
                assert len(table) == num_blocks_for(seq.num_tokens, BLOCK_SIZE)
        assert [block.ref_count for block in self.manager.blocks] == holders
        empty, cached = self.manager.empty_block_ids, self.manager.cached_free_block_ids
        free = set(empty) | set(cached)
        assert len(free) == self.manager.num_free_blocks == len(empty) + len(cached)
        assert free == {b for b in range(self.reserved, self.NUM_BLOCKS) if holders[b] == 0}
        blocks = self.manager.blocks
        assert all(blocks[b].block_hash is None and blocks[b].owner is None for b in empty)
        assert all(blocks[b].block_hash is not None or blocks[b].owner is not None
                   for b in cached)

    @invariant()
    def cached_blocks_hold_full_recorded_content(self) -> None:
        for block_id in self.manager.cached_block_ids.values():
            block = self.manager.blocks[block_id]
            assert block_id in self.prefix_of_block
            assert block.token_ids == tuple(self.content[block_id])
            assert self.prefix_of_block[block_id][1][-BLOCK_SIZE:] == block.token_ids
            for group, page in enumerate(block.pages or [], 1):
                if page is not None:  # another group's page of the same tokens, tied back
                    assert self.prefix_of_block[page] == self.prefix_of_block[block_id]
                    assert self.manager.blocks[page].owner == (block_id, group)

    @invariant()
    def sequences_see_their_own_tokens(self) -> None:
        # Every group holds what the next token attends: a sliding one its window.
        for seq in self.seqs:
            computed = seq.num_computed_tokens
            for table, window in zip(seq.tables(), self.WINDOWS, strict=True):
                first = 0 if window is None else max(computed - window + 1, 0)
                for position in range(first, computed):
                    block_id = table[position // BLOCK_SIZE]
                    assert self.content[block_id][position % BLOCK_SIZE] == \
                        seq.token_ids[position]

    def teardown(self) -> None:
        for seq in self.seqs:
            self.manager.free(seq)
        assert self.manager.num_free_blocks == self.NUM_BLOCKS - self.reserved
        assert all(block.ref_count == 0 for block in self.manager.blocks)


TestBlockManager = BlockManagerMachine.TestCase
TestBlockManager.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class SlidingGroupsMachine(BlockManagerMachine):
    """Group 0, another full group and a sliding group of a window over a block."""

    WINDOWS = (None, None, 6)
    NUM_BLOCKS = 40


class NarrowWindowMachine(BlockManagerMachine):
    """A sliding group whose window is shorter than a block."""

    WINDOWS = (None, 3)
    NUM_BLOCKS = 28


class EverySlidingMachine(BlockManagerMachine):
    """Every layer slides: group 0's table drops pages too (Mistral, Phi-3)."""

    WINDOWS = (6,)
    NUM_BLOCKS = 16


class EverySlidingNarrowMachine(BlockManagerMachine):
    """Group 0 slides with a window under a block: a block's parent may be dropped before
    the block fills (it is then not cached)."""

    WINDOWS = (3, 3)
    NUM_BLOCKS = 24


TestEverySliding = EverySlidingMachine.TestCase
TestEverySliding.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
TestEverySlidingNarrow = EverySlidingNarrowMachine.TestCase
TestEverySlidingNarrow.settings = settings(max_examples=80, stateful_step_count=40,
                                           deadline=None)
TestSlidingGroups = SlidingGroupsMachine.TestCase
TestSlidingGroups.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
TestNarrowWindow = NarrowWindowMachine.TestCase
TestNarrowWindow.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


def weak_hash(parent: bytes | None, extra_key: object, token_ids: tuple[int, ...]) -> bytes:
    """A block hash that collides all the time (3 values): the seam for collision tests."""
    return bytes([sum(token_ids) % 3])


def test_colliding_hashes_never_serve_foreign_kv(monkeypatch):
    """The machine's own content model checks every hit; under a hash with constant
    collisions (across tokens, chains and weight versions) each hit must still serve the
    sequence's own prefix under the current version."""
    monkeypatch.setattr(block_manager, "block_hash", weak_hash)
    run_state_machine_as_test(BlockManagerMachine, settings=settings(
        max_examples=100, stateful_step_count=40, deadline=None))


def test_colliding_block_is_a_miss_and_the_true_owner_still_hits(monkeypatch):
    monkeypatch.setattr(block_manager, "block_hash", lambda *args: b"same")
    manager = BlockManager(8, BLOCK_SIZE)
    first = make_seq(0, [1, 2, 3, 4, 5])
    manager.allocate_slots(first, first.num_tokens)
    foreign = make_seq(1, [4, 3, 2, 1, 5])  # the same digest, other tokens
    assert manager.allocate_slots(foreign, foreign.num_tokens).num_cached_tokens == 0
    assert foreign.block_table[0] != first.block_table[0]
    again = make_seq(2, [1, 2, 3, 4, 6])
    assert manager.allocate_slots(again, again.num_tokens).num_cached_tokens == BLOCK_SIZE
    assert again.block_table[0] == first.block_table[0]


def test_child_of_an_evicted_parent_is_not_served(monkeypatch):
    """The head of a cached chain is evicted and reused for other tokens. Under a seam whose
    digest ignores the parent, the old second block still matches by digest and tokens, but
    it followed the head's old occupancy, so it is a miss."""
    monkeypatch.setattr(block_manager, "block_hash", lambda parent, key, tokens: bytes(tokens))
    manager = BlockManager(6, BLOCK_SIZE)
    seq = make_seq(0, [1, 1, 1, 1, 2, 2, 2, 2, 3])
    manager.allocate_slots(seq, seq.num_tokens)
    head, second, _ = seq.block_table
    manager.free(seq)
    manager.cached_free_block_ids.move_to_end(second)  # evict the head first
    filler = make_seq(1, [5] * (4 * BLOCK_SIZE - 1))  # holds every block without content
    manager.allocate_slots(filler, filler.num_tokens)
    other = make_seq(2, [7, 7, 7, 7])
    manager.allocate_slots(other, other.num_tokens)
    assert other.block_table == [head]
    manager.free(other)
    manager.free(filler)
    query = make_seq(3, [7, 7, 7, 7, 2, 2, 2, 2, 9])
    assert manager.allocate_slots(query, query.num_tokens).num_cached_tokens == BLOCK_SIZE
    assert query.block_table[0] == head


def test_double_free_is_refused():
    manager = BlockManager(4, BLOCK_SIZE)
    seq = make_seq(0, [1, 2, 3])
    manager.allocate_slots(seq, seq.num_tokens)
    table = list(seq.block_table)
    manager.free(seq)
    seq.block_table = table
    with pytest.raises(RuntimeError, match="double free"):
        manager.free(seq)


def test_short_pool_refuses_allocation_and_changes_nothing():
    manager = BlockManager(2, BLOCK_SIZE)
    seq = make_seq(0, list(range(3 * BLOCK_SIZE)))
    assert manager.allocate_slots(seq, seq.num_tokens) is None
    assert seq.block_table == [] and manager.num_free_blocks == 2
    assert manager.num_queried_tokens == 0


@pytest.mark.parametrize("caching", [True, False])
def test_a_decode_appends_in_place_unless_it_starts_fills_or_shares_a_block(caching):
    manager = BlockManager(8, BLOCK_SIZE, enable_prefix_caching=caching)
    seq = make_seq(0, list(range(BLOCK_SIZE + 1)))
    manager.allocate_slots(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens

    def decode() -> bool:
        seq.token_ids.append(7)
        in_place = manager.appends_in_place(seq)
        manager.allocate_slots(seq, 1)
        seq.num_computed_tokens += 1
        return in_place

    assert [decode() for _ in range(BLOCK_SIZE)] == [True] * (BLOCK_SIZE - 2) + [
        not caching, False]  # the last fills the block (registered), the next starts one
    child = make_seq(1, seq.token_ids)
    manager.fork(seq, child)
    assert not decode()  # the partly filled last block is shared: copy-on-write
    assert decode()


def test_empty_blocks_go_before_cached_ones_which_are_evicted_lru_tail_first():
    manager = BlockManager(5, BLOCK_SIZE)
    seq = make_seq(0, list(range(3 * BLOCK_SIZE)))
    manager.allocate_slots(seq, seq.num_tokens)
    head, middle, tail = seq.block_table
    manager.free(seq)
    assert manager.num_cached_free_blocks == 3
    other = make_seq(1, [99] * BLOCK_SIZE)
    assert manager.allocate_slots(other, other.num_tokens).num_cached_tokens == 0
    assert other.block_table == [3]  # a never-used block, not a cached one
    more = make_seq(2, [98] * (2 * BLOCK_SIZE))
    manager.allocate_slots(more, more.num_tokens)
    assert more.block_table == [4, tail]  # then the least recently used cached block: the tail
    again = make_seq(3, list(range(3 * BLOCK_SIZE)))
    assert manager.allocate_slots(again, again.num_tokens) is None  # no block left for it
    manager.free(other)
    assert manager.allocate_slots(again, again.num_tokens).num_cached_tokens == 2 * BLOCK_SIZE
    assert again.block_table[:2] == [head, middle]


def test_freed_empty_block_is_reused_before_a_cached_one():
    """A block freed without cached content (a sequence's partial last block) is handed out
    again before any cached block is evicted, and before blocks never used."""
    manager = BlockManager(4, BLOCK_SIZE)
    seq = make_seq(0, list(range(BLOCK_SIZE + 1)))
    manager.allocate_slots(seq, seq.num_tokens)
    full, partial = seq.block_table
    manager.free(seq)
    other = make_seq(1, [99])
    manager.allocate_slots(other, other.num_tokens)
    assert other.block_table == [partial] and manager.num_cached_free_blocks == 1


def test_prompts_a_a_b_a_hit_on_the_last_a():
    """Four long prompts A, A, B, A, each freed when done: B takes free blocks without
    evicting A's, so the last A hits all of A's full blocks, as the second A did."""
    manager = BlockManager(16, BLOCK_SIZE)
    prompt_a, prompt_b = list(range(5 * BLOCK_SIZE)), list(range(100, 100 + 5 * BLOCK_SIZE))
    hits = []
    for seq_id, prompt in enumerate((prompt_a, prompt_a, prompt_b, prompt_a)):
        seq = make_seq(seq_id, prompt)
        hits.append(manager.allocate_slots(seq, seq.num_tokens).num_cached_tokens)
        manager.free(seq)
    assert hits == [0, 4 * BLOCK_SIZE, 0, 4 * BLOCK_SIZE]


def test_group_decodes_share_their_full_prompt_blocks():
    manager = BlockManager(8, BLOCK_SIZE)
    parent = make_seq(0, list(range(2 * BLOCK_SIZE + 1)))
    manager.allocate_slots(parent, parent.num_tokens)
    parent.num_computed_tokens = parent.num_tokens
    child = make_seq(1, parent.token_ids)
    manager.fork(parent, child)
    child.num_computed_tokens = parent.num_computed_tokens
    for seq, token in ((parent, 7), (child, 8)):
        seq.token_ids.append(token)
        manager.allocate_slots(seq, 1)
    assert manager.shared_prefix_blocks([parent, child]) == 2
    assert parent.block_table[2] != child.block_table[2]  # the partial block was copied
