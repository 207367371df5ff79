"""The KV pool's bookkeeping: blocks, reference counts, block tables, the prefix cache.

The block manager knows block ids, token ids and hashes, never tensors: the model runner
turns block tables into slot mappings and performs the copy-on-write copies it returns.

Prefix cache: a full block's hash is a sha256 digest chaining its parent's digest, an extra
key (the weight version and LoRA id, so a weight update misses old entries without a scan)
and its token ids. A hit is never trusted on the digest alone (a collision would serve
another prompt's KV, in a shared server another client's: vLLM's CVE-2025-25183): the
cached block must hold the same tokens under the same extra key, and follow the very block
(and the same occupancy of it, its ``generation``) the lookup matched just before. A
freed block keeps its hash, and so its cached content, until it is evicted. Free blocks
that hold no cached content are handed out first (the most recently freed first, whose
memory is resident, then those never used); cached ones only when none is left, least
recently used first, as vLLM's free queue does. A sequence frees its blocks last block
first, so a chain's tail is evicted before its head. The pool's resident memory can so
grow to its configured size: that is what the cache is for.

KV groups (``kv_groups.py``): with sliding layers a sequence holds one table per group,
``block_table`` (group 0: full attention unless every layer slides) and ``group_tables``
(the others), all drawing
pages from one free list, each logical block a page per group. A sliding group's table
drops (to ``NULL_PAGE``, a page never handed out) the pages that fall wholly before its
window when the sequence next allocates; a sequence's pages are all allocated with its
tokens (a half-prefilled one never starves) and the out-of-window ones dropped as its
computation moves on. The prefix cache keys on group 0: a cached block keeps the other
groups' pages of the same tokens (``Block.pages``) while they live, and a hit is cut to
the longest prefix whose pages every group still needs are alive (a sliding group: those
inside the window of the first token left to compute). Copy-on-write copies a shared
logical block's page in every group (a copy moves a whole page, whichever group's).
"""

from __future__ import annotations

import functools
import hashlib
import json
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass

from .sequence import Sequence


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


ExtraKey = tuple[int, int | None]  # (weight_version, lora_id)


def block_hash(parent_hash: bytes | None, extra_key: ExtraKey, token_ids: tuple[int, ...]
               ) -> bytes:
    """The prefix-cache key of a full block: sha256 over a canonical encoding of its
    parent's key (chained), the extra key and its token ids."""
    digest = hashlib.sha256(parent_hash or bytes(32))
    digest.update(_encoded(extra_key))
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


@functools.lru_cache(maxsize=64)
def _encoded(extra_key: ExtraKey) -> bytes:
    """The canonical bytes of an extra key (cached: a pool sees few, and JSON costs half
    a block's hash)."""
    return json.dumps(extra_key).encode()


@dataclass(slots=True)
class SlotAllocation:
    """What ``allocate_slots`` did for one sequence.

    Attributes:
        num_cached_tokens: tokens whose K/V the prefix cache already held (on admission; a
            multiple of block_size, always leaving at least one token to compute).
        num_new_tokens: tokens the sequence computes in this step.
        copies: the ``(source, destination)`` pages to copy before the step (copy-on-write:
            one per KV group, or none).
    """

    num_cached_tokens: int
    num_new_tokens: int
    copies: list[tuple[int, int]]


BlockRef = tuple[int, int]  # (block_id, generation): one occupancy of one block
NULL_PAGE = 0  # a sliding group's entry for a block out of its window (never handed out)


@dataclass(slots=True)
class Block:
    """One KV block: how many sequences hold it and, once full and registered, its hash and
    what a cache hit checks: its tokens, extra key and parent block.

    ``generation`` counts the block's occupancies (it grows each time the block is handed
    out), so a parent reference taken before the parent was evicted and reused no longer
    matches. With KV groups, a cached block of group 0 lists the other groups' ``pages`` of
    its tokens (None where one is gone), and such a page names its ``owner``: that block
    and the group.
    """

    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()
    extra_key: ExtraKey | None = None
    parent: BlockRef | None = None
    generation: int = 0
    pages: list[int | None] | None = None
    owner: tuple[int, int] | None = None


class BlockManager:
    """Owns ``num_blocks`` KV blocks of ``block_size`` tokens each.

    A block is free when its reference count is 0. Sequences in a group share blocks (the
    reference count says how many); a sequence about to write into a shared block first gets
    its own copy (copy-on-write), the last holder writes in place.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: tuple[int | None, ...] = (None,)) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, "
                             f"{block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = windows  # per KV group, its sliding window (None: full)
        self.num_reserved = 1 if any(w is not None for w in windows) else 0  # NULL_PAGE
        # The engine sets this to (weight_version, lora_id) whenever the weights change.
        self.extra_key: ExtraKey = (0, None)
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks without cached content, the most recently freed first (resident
        # memory; on CPU untouched pool pages cost none), then those never used.
        self.empty_block_ids: deque[int] = deque(range(self.num_reserved, num_blocks))
        # Free blocks with cached content, least recently used first: evicted in that order.
        self.cached_free_block_ids: OrderedDict[int, None] = OrderedDict()
        self.cached_block_ids: dict[bytes, int] = {}
        self.num_cow_copies = 0
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that no sequence holds (some may still hold cached content)."""
        return len(self.empty_block_ids) + len(self.cached_free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - self.num_reserved - self.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a registered hash (reusable by a cache hit)."""
        return len(self.cached_free_block_ids)

    def stats(self) -> dict[str, int]:
        """The pool's counters: blocks in all, held and free with cached content
        (``kv_blocks_*``), prompt tokens looked up in and found in the prefix cache
        (``prefix_cache_*_tokens``), and copy-on-write copies (``cow_copies``)."""
        return {
            "kv_blocks_total": self.num_blocks,
            "kv_blocks_used": self.num_used_blocks,
            "kv_blocks_cached_free": self.num_cached_free_blocks,
            "prefix_cache_queried_tokens": self.num_queried_tokens,
            "prefix_cache_hit_tokens": self.num_hit_tokens,
            "cow_copies": self.num_cow_copies,
        }

    def allocate_slots(self, seq: Sequence, token_budget: int,
                       use_cache: bool = True) -> SlotAllocation | None:
        """Make ``seq`` ready to compute its next tokens, at most ``token_budget`` of them.

        One call serves admission and growth. A sequence that holds no blocks first takes
        the cached blocks of its prefix (with ``use_cache``). Every sequence then holds
        blocks for all its tokens (so a half-prefilled one never starves), its own copy of
        a shared block its next write lands in (copy-on-write), and the blocks this step
        fills are hashed and cached (a later request of the same step may hit them: each
        layer writes the step's K/V before any attention of the step reads them).

        With sliding groups, a sequence's pages out of its windows are dropped first (see the
        module docstring), whatever the outcome.

        Returns what was allocated, or None, changing nothing else, when the free blocks do
        not suffice.
        """
        admitting = not seq.block_table
        if admitting:
            seq.group_tables = [[] for _ in self.windows[1:]]
        hits, pages = self._lookup(seq) if admitting and use_cache else self._no_hits()
        num_computed = seq.num_computed_tokens + len(hits) * self.block_size
        if not admitting:
            self._drop_out_of_window(seq, num_computed)
        first = self._first_needed(self.windows[0], num_computed) if hits else 0
        held = [NULL_PAGE] * first + hits[first:]  # group 0's: a sliding one's window only
        shared = self._shared_pages_at(seq, num_computed)
        grow = num_blocks_for(seq.num_tokens, self.block_size) - len(seq.block_table) - len(hits)
        taken = [page for group in (held, *pages) for page in group if self._real(page)]
        taken_free = sum(self.blocks[b].ref_count == 0 for b in taken)
        if max(grow, 0) * len(self.windows) + len(shared) + taken_free > self.num_free_blocks:
            return None
        for block_id in hits:
            seq.block_hashes.append(self.blocks[block_id].block_hash)
        for table, group in zip(seq.tables(), [held, *pages], strict=True):
            for block_id in group:
                if self._real(block_id):
                    self._take(block_id)
                table.append(block_id)
        copies = [self._copy_on_write(table, index) for table, index in shared]
        self._grow(seq, seq.num_tokens)
        num_new_tokens = min(seq.num_tokens - num_computed, token_budget)
        # A pending token (overlapped steps) is not known yet: its block waits to be hashed.
        self._register_full_blocks(seq, min(num_computed + num_new_tokens, len(seq.token_ids)))
        if admitting:
            self.num_queried_tokens += seq.num_tokens
            self.num_hit_tokens += len(hits) * self.block_size
        return SlotAllocation(len(hits) * self.block_size, num_new_tokens, copies)

    def appends_in_place(self, seq: Sequence) -> bool:
        """True when ``seq``'s one uncomputed token (a decode's) lands in a block it holds
        alone (in every KV group), fills no block the prefix cache would register and moves
        no window past a page: ``allocate_slots(seq, 1)``
        would then change nothing and copy nothing, so it need not be called (15 decodes in
        16, asked once per sequence per step)."""
        num_tokens = len(seq.token_ids) + seq.num_pending_tokens
        size = self.block_size
        if num_tokens > len(seq.block_table) * size:
            return False  # a new block is due
        index = (num_tokens - 1) // size
        if any(self.blocks[table[index]].ref_count != 1 for table in seq.tables()):
            return False  # shared: a copy-on-write is due
        if self._drop_due(seq, num_tokens - 1):
            return False  # a page fell out of a window
        return not self.enable_prefix_caching or num_tokens // size <= len(seq.block_hashes)

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Hash and cache the full blocks of ``seq``'s computed, known tokens that are not
        yet (``allocate_slots`` defers a block whose last token is pending)."""
        self._register_full_blocks(seq, min(seq.num_computed_tokens, len(seq.token_ids)))

    def num_tokens_to_compute(self, seq: Sequence, use_cache: bool = True) -> int:
        """The tokens ``seq`` still has to compute: its uncomputed ones, less the cached
        prefix ``allocate_slots`` would give it (changes nothing)."""
        hits = self._lookup(seq)[0] if not seq.block_table and use_cache else []
        return seq.num_uncomputed_tokens - len(hits) * self.block_size

    def shared_prefix_blocks(self, seqs: list[Sequence]) -> int:
        """How many leading blocks all of ``seqs`` hold in common (the same physical blocks)
        that lie wholly before each one's last token (the token a decode writes)."""
        first = seqs[0].block_table
        num_shared = min((seq.num_tokens - 1) // self.block_size for seq in seqs)
        for seq in seqs[1:]:
            table = seq.block_table
            shared = 0
            while shared < num_shared and table[shared] == first[shared] \
                    and self._real(first[shared]):
                shared += 1
            num_shared = shared
        return num_shared

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share every block of ``parent`` (one more reference each), in every
        KV group."""
        for table in parent.tables():
            for block_id in table:
                if self._real(block_id):
                    self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        child.group_tables = [list(table) for table in parent.group_tables]
        child.block_hashes = list(parent.block_hashes)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s reference to each of its blocks (every KV group's), last block
        first.

        Blocks keep their hashes (and so their cached content) until reused.

        Raises:
            RuntimeError: on a double free (a block whose reference count is already 0).
        """
        for table in seq.tables():
            for block_id in reversed(table):
                if self._real(block_id):
                    self._unref(block_id)
        seq.block_table.clear()
        seq.group_tables = []
        seq.block_hashes.clear()

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash; blocks in use keep their content, nothing will hit it."""
        for block_id in self.cached_block_ids.values():
            self._forget(self.blocks[block_id])
        self.cached_block_ids.clear()
        self.empty_block_ids.extendleft(self.cached_free_block_ids)
        self.cached_free_block_ids.clear()

    def _lookup(self, seq: Sequence) -> tuple[list[int], list[list[int]]]:
        """Cached blocks holding ``seq``'s leading full blocks (at least one token left),
        and each other KV group's pages of them (``NULL_PAGE`` before a sliding group's
        window), cut to the longest prefix whose needed pages all live."""
        if not self.enable_prefix_caching:
            return self._no_hits()
        size, parent, hits = self.block_size, None, []
        for index in range((seq.num_tokens - 1) // size):
            tokens = tuple(seq.token_ids[index * size:(index + 1) * size])
            parent = block_hash(parent, self.extra_key, tokens)
            block_id = self.cached_block_ids.get(parent)
            if block_id is None or not self._holds(block_id, tokens, hits):
                break
            hits.append(block_id)
        while hits:
            pages = self._pages_of(hits)
            if pages is not None:
                return hits, pages
            hits.pop()
        return self._no_hits()

    def _no_hits(self) -> tuple[list[int], list[list[int]]]:
        return [], [[] for _ in self.windows[1:]]

    def _pages_of(self, hits: list[int]) -> list[list[int]] | None:
        """Each other KV group's pages of the cached blocks ``hits``: all of a full group's,
        a sliding group's from the block holding the first key the next token attends
        (``NULL_PAGE`` before); None when one of them is gone."""
        num_tokens, found = len(hits) * self.block_size, []
        for group, window in enumerate(self.windows[1:]):
            first = self._first_needed(window, num_tokens)
            pages = [NULL_PAGE] * first
            for block_id in hits[first:]:
                kept = self.blocks[block_id].pages
                if kept is None or kept[group] is None:
                    return None
                pages.append(kept[group])
            found.append(pages)
        return found

    def _first_needed(self, window: int | None, position: int) -> int:
        """The first block a token at ``position`` attends under ``window`` (0: full)."""
        return 0 if window is None else max(position - window + 1, 0) // self.block_size

    def _drop_out_of_window(self, seq: Sequence, position: int) -> None:
        """Release ``seq``'s pages, in each sliding group, of the blocks wholly before the
        window of ``position`` (the first token it computes next): no token from there on
        attends them. Dropped pages form a prefix of the table, so this walks back from
        the window to the last page dropped before."""
        for table, window in zip(seq.tables(), self.windows, strict=True):
            if window is None:
                continue
            index = min(self._first_needed(window, position), len(table)) - 1
            while index >= 0 and table[index] != NULL_PAGE:
                self._unref(table[index])
                table[index] = NULL_PAGE
                index -= 1

    def _real(self, block_id: int) -> bool:
        """True unless ``block_id`` is a dropped page's ``NULL_PAGE`` (with sliding groups,
        block 0 is never handed out)."""
        return block_id != NULL_PAGE or not self.num_reserved

    def _drop_due(self, seq: Sequence, position: int) -> bool:
        """True when a sliding group of ``seq`` holds a page wholly before the window of
        ``position`` (dropped pages form a prefix: the last before the window tells)."""
        for table, window in zip(seq.tables(), self.windows, strict=True):
            if window is not None:
                first = self._first_needed(window, position)
                if first and table[first - 1] != NULL_PAGE:
                    return True
        return False

    def _unref(self, block_id: int) -> None:
        """Drop one reference to ``block_id``, releasing it at the last."""
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"double free of KV block {block_id}")
        block.ref_count -= 1
        if block.ref_count == 0:
            self._release(block)

    def _holds(self, block_id: int, tokens: tuple[int, ...], hits: list[int]) -> bool:
        """True when cached ``block_id`` holds ``tokens`` under the current extra key right
        after the blocks ``hits`` (checked, so a colliding digest never serves foreign KV)."""
        block = self.blocks[block_id]
        return (block.token_ids == tokens and block.extra_key == self.extra_key
                and block.parent == self._ref(hits[-1] if hits else None))

    def _ref(self, block_id: int | None) -> BlockRef | None:
        """The reference to ``block_id``'s current occupancy (None for no block)."""
        return None if block_id is None else (block_id, self.blocks[block_id].generation)

    def _register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Hash and cache each of ``seq``'s blocks that its first ``num_tokens`` tokens fill."""
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        for index in range(len(seq.block_hashes), num_tokens // size):
            tokens = tuple(seq.token_ids[index * size:(index + 1) * size])
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(block_hash(parent, self.extra_key, tokens))
            before = seq.block_table[index - 1] if index else None
            if before is not None and not self._real(before):
                continue  # its parent dropped out of group 0's window: no chain to hang on
            self._register(seq.block_table[index], seq.block_hashes[-1], tokens,
                           self._ref(before), [table[index] for table in seq.group_tables])

    def _register(self, block_id: int, hash_value: bytes, tokens: tuple[int, ...],
                  parent: BlockRef | None, pages: list[int]) -> None:
        """Cache ``block_id`` under ``hash_value``, with the other groups' ``pages`` of the
        same tokens (``NULL_PAGE`` for one already dropped)."""
        if hash_value in self.cached_block_ids:
            return  # the same content is cached in another block already
        block = self.blocks[block_id]
        block.block_hash, block.token_ids = hash_value, tokens
        block.extra_key, block.parent = self.extra_key, parent
        self.cached_block_ids[hash_value] = block_id
        if pages:
            block.pages = [None if page == NULL_PAGE or self.blocks[page].owner is not None
                           else page for page in pages]
            for group, page in enumerate(block.pages, 1):
                if page is not None:
                    self.blocks[page].owner = (block_id, group)

    def _shared_pages_at(self, seq: Sequence, position: int) -> list[tuple[list[int], int]]:
        """The ``(table, index)`` of each of ``seq``'s pages holding ``position`` (one per
        KV group) that it shares with another sequence."""
        index = position // self.block_size
        if index >= len(seq.block_table):
            return []
        return [(table, index) for table in seq.tables()
                if self._real(table[index]) and self.blocks[table[index]].ref_count > 1]

    def _copy_on_write(self, table: list[int], index: int) -> tuple[int, int]:
        source = table[index]
        self.blocks[source].ref_count -= 1
        destination = self._pop_free()
        table[index] = destination
        self.num_cow_copies += 1
        return source, destination

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        """Give every table of ``seq`` a page for each block of its ``num_tokens``."""
        num_blocks = num_blocks_for(num_tokens, self.block_size)
        for table in seq.tables():
            while len(table) < num_blocks:
                table.append(self._pop_free())

    def _release(self, block: Block) -> None:
        """Put a block no sequence holds any more on the free queue its content calls for."""
        if block.block_hash is None and block.owner is None:
            self.empty_block_ids.appendleft(block.block_id)
        else:
            self.cached_free_block_ids[block.block_id] = None

    def _pop_free(self) -> int:
        """A free block without cached content, else the least recently used cached one
        (its content evicted)."""
        if self.empty_block_ids:
            block_id = self.empty_block_ids.popleft()
        else:
            block_id, _ = self.cached_free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.cached_block_ids.get(block.block_hash) == block_id:
                del self.cached_block_ids[block.block_hash]
            self._forget(block)
        if block.owner is not None:  # another group's page of a cached block: gone now
            owner_id, group = block.owner
            self.blocks[owner_id].pages[group - 1] = None
            block.owner = None
        block.ref_count = 1
        block.generation += 1
        return block_id

    def _forget(self, block: Block) -> None:
        """Drop a block's cached content, and its pages' tie to it (a free one no longer
        caches anything: it moves to the empty queue)."""
        block.block_hash, block.token_ids, block.extra_key, block.parent = None, (), None, None
        for page_id in block.pages or ():
            if page_id is None:
                continue
            page = self.blocks[page_id]
            page.owner = None
            if page.ref_count == 0:
                del self.cached_free_block_ids[page_id]
                self.empty_block_ids.appendleft(page_id)
        block.pages = None

    def _take(self, block_id: int) -> None:
        """Add a reference to a cached block, taking it off the free queue if it was free."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.cached_free_block_ids[block_id]
        block.ref_count += 1
