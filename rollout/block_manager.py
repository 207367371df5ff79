"""The KV pool's bookkeeping: fixed-size blocks, reference counts, per-sequence block tables.

The block manager knows block ids and token counts, never tensors: the model runner turns
block tables into slot mappings.
"""

from __future__ import annotations

from collections import deque

from .sequence import Sequence


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


class BlockManager:
    """Owns ``num_blocks`` KV blocks of ``block_size`` tokens each.

    A block is free when its reference count is 0. ``allocate`` grows a sequence's block table
    to cover a token count; ``free`` drops the sequence's references.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, "
                             f"{block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        """Blocks that no sequence holds."""
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - len(self.free_block_ids)

    def num_new_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks ``seq`` must add to its table to hold its first ``num_tokens`` tokens."""
        return max(0, num_blocks_for(num_tokens, self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """True when the free blocks suffice to grow ``seq`` to ``num_tokens`` tokens."""
        return self.num_new_blocks(seq, num_tokens) <= len(self.free_block_ids)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq``'s block table to hold ``num_tokens`` tokens.

        Raises:
            RuntimeError: when too few blocks are free (callers check ``can_allocate``).
        """
        needed = self.num_new_blocks(seq, num_tokens)
        if needed > len(self.free_block_ids):
            raise RuntimeError(f"KV pool exhausted: need {needed} blocks, "
                               f"{len(self.free_block_ids)} free")
        for _ in range(needed):
            block_id = self.free_block_ids.popleft()
            self.ref_counts[block_id] = 1
            seq.block_table.append(block_id)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s reference to each of its blocks, last block first, and clear its table."""
        for block_id in reversed(seq.block_table):
            if self.ref_counts[block_id] <= 0:
                raise RuntimeError(f"double free of KV block {block_id}")
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids.append(block_id)
        seq.block_table.clear()
