"""How the KV pool's pages are shared between full-attention and sliding-window layers.

A sliding layer needs only its last ``W`` positions' keys and values; holding the whole
context for it wastes most of the pool (GPT-OSS at 4k tokens: half of the layers need 128
tokens, not 4,096). As vLLM's hybrid KV cache manager does, the layers are split into KV
groups of one attention type and equally many layers (``rows``), and the pool is one set of
pages of ``rows`` layers by ``block_size`` tokens: a page belongs to one group at a time,
each group's row r holding the r-th of its layers. A sequence holds one block table per
group, all drawing pages from one free list. A full group's table grows with the context; a
sliding group's drops the pages that fall out of its window (the block manager). So a
sequence of T tokens holds ``ceil(T / block_size)`` pages per full group and at most a
window's pages (``ceil(W / block_size) + 2``) per sliding group.

Group 0 is a full group where the model has full layers: its table is the sequence's
``block_table``, which the prefix cache and cascade attention key on; the other groups'
pages of a logical block follow it. In a model whose every layer slides (Mistral, Phi-3)
group 0 slides too: its table drops pages like any sliding group's, the prefix cache
still chains its blocks' hashes (a dropped block stays cached until evicted; a block whose
parent was dropped before it filled is not cached), and a hit needs only its window's
blocks. A window that never cuts into a context (``W >= max_model_len``) counts as full. A
model of one attention type that never cuts has one group of all its layers: the pool of
before.
"""

from __future__ import annotations

from dataclasses import dataclass

from .block_manager import num_blocks_for


@dataclass(frozen=True, slots=True)
class KVGroups:
    """The pool's KV groups.

    Attributes:
        windows: per group, its sliding window W (None: full attention); full groups
            first.
        rows: layers per page (every group has as many rows; a group short of layers
            leaves its last rows unused).
        group_of: per layer, its group.
        row_of: per layer, its row in its group's pages.
    """

    windows: tuple[int | None, ...]
    rows: int
    group_of: tuple[int, ...]
    row_of: tuple[int, ...]

    @property
    def num_groups(self) -> int:
        """How many groups (tables per sequence)."""
        return len(self.windows)

    @property
    def windowed(self) -> bool:
        """True when some group drops the pages out of its window."""
        return any(window is not None for window in self.windows)

    def pages_for(self, num_tokens: int, block_size: int) -> int:
        """Pages a sequence of ``num_tokens`` computed tokens holds at most once its
        prefill is done: all its blocks per full group, its window's (and the block being
        written) per sliding group."""
        blocks = num_blocks_for(num_tokens, block_size)
        return sum(blocks if window is None else min(blocks, window_pages(window, block_size))
                   for window in self.windows)


def window_pages(window: int, block_size: int) -> int:
    """The most pages a sliding group of ``window`` holds for one sequence: the blocks its
    window spans, one more where the window starts inside a block, and the block a decode
    is about to fill (pages are dropped when a block is due, ``BlockManager``)."""
    return num_blocks_for(window, block_size) + 2


def kv_groups(windows: list[int | None], max_model_len: int) -> KVGroups:
    """The groups of layers whose sliding windows are ``windows`` (None: full), for
    contexts of up to ``max_model_len`` tokens (see the module docstring).

    Each attention type's layers are cut into groups of as many layers as the rarest type
    has (vLLM's choice: few tables per sequence, few unused rows), full groups first.
    """
    cutting = [w if w is not None and w < max_model_len else None for w in windows]
    types: dict[int | None, list[int]] = {}
    for layer, window in sorted(enumerate(cutting), key=lambda lw: (lw[1] is not None,
                                                                     lw[1] or 0)):
        types.setdefault(window, []).append(layer)
    rows = min(map(len, types.values()))
    group_windows: list[int | None] = []
    group_of, row_of = [0] * len(windows), [0] * len(windows)
    for window, layers in types.items():
        for start in range(0, len(layers), rows):
            for row, layer in enumerate(layers[start:start + rows]):
                group_of[layer], row_of[layer] = len(group_windows), row
            group_windows.append(window)
    return KVGroups(tuple(group_windows), rows, tuple(group_of), tuple(row_of))


def single_group(num_layers: int) -> KVGroups:
    """One full group of ``num_layers`` layers: every layer holds every token."""
    return kv_groups([None] * num_layers, 1)
