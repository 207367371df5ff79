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
        copy: the ``(source, destination)`` blocks to copy before the step (copy-on-write).
    """

    num_cached_tokens: int
    num_new_tokens: int
    copy: tuple[int, int] | None


BlockRef = tuple[int, int]  # (block_id, generation): one occupancy of one block


@dataclass(slots=True)
class Block:
    """One KV block: how many sequences hold it and, once full and registered, its hash and
    what a cache hit checks: its tokens, extra key and parent block.

    ``generation`` counts the block's occupancies (it grows each time the block is handed
    out), so a parent reference taken before the parent was evicted and reused no longer
    matches.
    """

    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()
    extra_key: ExtraKey | None = None
    parent: BlockRef | None = None
    generation: int = 0


class BlockManager:
    """Owns ``num_blocks`` KV blocks of ``block_size`` tokens each.

    A block is free when its reference count is 0. Sequences in a group share blocks (the
    reference count says how many); a sequence about to write into a shared block first gets
    its own copy (copy-on-write), the last holder writes in place.
    """

    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, "
                             f"{block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # The engine sets this to (weight_version, lora_id) whenever the weights change.
        self.extra_key: ExtraKey = (0, None)
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks without cached content, the most recently freed first (resident
        # memory; on CPU untouched pool pages cost none), then those never used.
        self.empty_block_ids: deque[int] = deque(range(num_blocks))
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
        return self.num_blocks - self.num_free_blocks

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

        Returns what was allocated, or None, changing nothing, when the free blocks do not
        suffice.
        """
        admitting = not seq.block_table
        hits = self._lookup(seq) if admitting and use_cache else []
        num_computed = seq.num_computed_tokens + len(hits) * self.block_size
        needs_copy = self._shared_block_at(seq, num_computed)
        grow = num_blocks_for(seq.num_tokens, self.block_size) - len(seq.block_table) - len(hits)
        hits_on_free = sum(self.blocks[b].ref_count == 0 for b in hits)
        if max(grow, 0) + needs_copy + hits_on_free > self.num_free_blocks:
            return None
        for block_id in hits:
            self._take(block_id)
            seq.block_table.append(block_id)
            seq.block_hashes.append(self.blocks[block_id].block_hash)
        copy = self._copy_on_write(seq, num_computed) if needs_copy else None
        self._grow(seq, seq.num_tokens)
        num_new_tokens = min(seq.num_tokens - num_computed, token_budget)
        # A pending token (overlapped steps) is not known yet: its block waits to be hashed.
        self._register_full_blocks(seq, min(num_computed + num_new_tokens, len(seq.token_ids)))
        if admitting:
            self.num_queried_tokens += seq.num_tokens
            self.num_hit_tokens += len(hits) * self.block_size
        return SlotAllocation(len(hits) * self.block_size, num_new_tokens, copy)

    def appends_in_place(self, seq: Sequence) -> bool:
        """True when ``seq``'s one uncomputed token (a decode's) lands in a block it holds
        alone and fills no block the prefix cache would register: ``allocate_slots(seq, 1)``
        would then change nothing and copy nothing, so it need not be called (15 decodes in
        16, asked once per sequence per step)."""
        num_tokens = len(seq.token_ids) + seq.num_pending_tokens
        table, size = seq.block_table, self.block_size
        if num_tokens > len(table) * size:
            return False  # a new block is due
        if self.blocks[table[(num_tokens - 1) // size]].ref_count != 1:
            return False  # shared: a copy-on-write is due
        return not self.enable_prefix_caching or num_tokens // size <= len(seq.block_hashes)

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Hash and cache the full blocks of ``seq``'s computed, known tokens that are not
        yet (``allocate_slots`` defers a block whose last token is pending)."""
        self._register_full_blocks(seq, min(seq.num_computed_tokens, len(seq.token_ids)))

    def num_tokens_to_compute(self, seq: Sequence, use_cache: bool = True) -> int:
        """The tokens ``seq`` still has to compute: its uncomputed ones, less the cached
        prefix ``allocate_slots`` would give it (changes nothing)."""
        hits = self._lookup(seq) if not seq.block_table and use_cache else []
        return seq.num_uncomputed_tokens - len(hits) * self.block_size

    def shared_prefix_blocks(self, seqs: list[Sequence]) -> int:
        """How many leading blocks all of ``seqs`` hold in common (the same physical blocks)
        that lie wholly before each one's last token (the token a decode writes)."""
        first = seqs[0].block_table
        num_shared = min((seq.num_tokens - 1) // self.block_size for seq in seqs)
        for seq in seqs[1:]:
            table = seq.block_table
            shared = 0
            while shared < num_shared and table[shared] == first[shared]:
                shared += 1
            num_shared = shared
        return num_shared

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share every block of ``parent`` (one more reference each)."""
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s reference to each of its blocks, last block first.

        Blocks keep their hashes (and so their cached content) until reused.

        Raises:
            RuntimeError: on a double free (a block whose reference count is already 0).
        """
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of KV block {block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._release(block)
        seq.block_table.clear()
        seq.block_hashes.clear()

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash; blocks in use keep their content, nothing will hit it."""
        for block_id in self.cached_block_ids.values():
            self._forget(self.blocks[block_id])
        self.cached_block_ids.clear()
        self.empty_block_ids.extendleft(self.cached_free_block_ids)
        self.cached_free_block_ids.clear()

    def _lookup(self, seq: Sequence) -> list[int]:
        """Cached blocks holding ``seq``'s leading full blocks (at least one token left)."""
        if not self.enable_prefix_caching:
            return []
        size, parent, hits = self.block_size, None, []
        for index in range((seq.num_tokens - 1) // size):
            tokens = tuple(seq.token_ids[index * size:(index + 1) * size])
            parent = block_hash(parent, self.extra_key, tokens)
            block_id = self.cached_block_ids.get(parent)
            if block_id is None or not self._holds(block_id, tokens, hits):
                break
            hits.append(block_id)
        return hits

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
            self._register(seq.block_table[index], seq.block_hashes[-1], tokens,
                           self._ref(seq.block_table[index - 1] if index else None))

    def _register(self, block_id: int, hash_value: bytes, tokens: tuple[int, ...],
                  parent: BlockRef | None) -> None:
        if hash_value in self.cached_block_ids:
            return  # the same content is cached in another block already
        block = self.blocks[block_id]
        block.block_hash, block.token_ids = hash_value, tokens
        block.extra_key, block.parent = self.extra_key, parent
        self.cached_block_ids[hash_value] = block_id

    def _shared_block_at(self, seq: Sequence, position: int) -> bool:
        """True when the block holding ``position`` is one ``seq`` shares with another."""
        index = position // self.block_size
        return (index < len(seq.block_table)
                and self.blocks[seq.block_table[index]].ref_count > 1)

    def _copy_on_write(self, seq: Sequence, position: int) -> tuple[int, int]:
        index = position // self.block_size
        source = seq.block_table[index]
        self.blocks[source].ref_count -= 1
        destination = self._pop_free()
        seq.block_table[index] = destination
        self.num_cow_copies += 1
        return source, destination

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        while len(seq.block_table) < num_blocks_for(num_tokens, self.block_size):
            seq.block_table.append(self._pop_free())

    def _release(self, block: Block) -> None:
        """Put a block no sequence holds any more on the free queue its content calls for."""
        if block.block_hash is None:
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
        block.ref_count = 1
        block.generation += 1
        return block_id

    @staticmethod
    def _forget(block: Block) -> None:
        block.block_hash, block.token_ids, block.extra_key, block.parent = None, (), None, None

    def _take(self, block_id: int) -> None:
        """Add a reference to a cached block, taking it off the free queue if it was free."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.cached_free_block_ids[block_id]
        block.ref_count += 1
