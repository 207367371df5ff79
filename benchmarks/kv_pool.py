"""Sequences that fit a fixed KV pool at 4k context: sliding layers' pages windowed
(``core/kv_groups.py``) against every layer holding the whole context (full-context
accounting: Tandem before KV groups, and vLLM without its hybrid KV cache manager).

For each model shape (real checkpoints' layer counts, KV heads, head sizes, windows and
layer patterns) a pool of ``--pool-gib`` (bfloat16 K and V) is cut into pages of each
accounting's size, and Tandem's own ``BlockManager`` runs the workload: sequences of a
``--prompt``-token prompt admitted, prefilled and decoded, allocation by allocation, to
``--context`` tokens, until the pool refuses the next one (nothing is preempted). GRPO
groups (``--group``) share their prompt's blocks (``fork``), as the engine's groups do. The
reference is the same pool under full-context accounting, in the same run; the limit is
the pool's bytes over each sequence's bytes at the context (its pages: all of a full
layer's, a window's of a sliding one).

Run::

    python benchmarks/kv_pool.py
    python benchmarks/kv_pool.py --context 32768 --pool-gib 40
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from common import print_table

from tandem.rollout.core.block_manager import BlockManager
from tandem.rollout.core.kv_groups import KVGroups, kv_groups, single_group, window_pages
from tandem.rollout.core.sequence import Sequence
from tandem.rollout.sampling_params import SamplingParams

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Shape:
    """A checkpoint's KV shape: layers, KV heads, head size, and each layer's window."""

    name: str
    num_kv_heads: int
    head_dim: int
    windows: list[int | None]

    def bytes_per_layer_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * 2  # K and V, bfloat16


def alternating(num_layers: int, window: int) -> list[int | None]:
    """GPT-OSS: sliding and full layers in turn, sliding first."""
    return [window if layer % 2 == 0 else None for layer in range(num_layers)]


def every_sixth_full(num_layers: int, window: int) -> list[int | None]:
    """Gemma 3: five sliding layers to one full one."""
    return [None if (layer + 1) % 6 == 0 else window for layer in range(num_layers)]


SHAPES = [
    Shape("gpt-oss-20b", 8, 64, alternating(24, 128)),
    Shape("gpt-oss-120b", 8, 64, alternating(36, 128)),
    Shape("gemma-3-1b", 1, 256, every_sixth_full(26, 512)),
    Shape("gemma-3-4b", 4, 256, every_sixth_full(34, 1024)),
    Shape("gemma-3-27b", 16, 128, every_sixth_full(62, 1024)),
]


def fitting_sequences(groups: KVGroups, num_pages: int, prompt: int, context: int,
                      group: int) -> int:
    """How many sequences the block manager holds at ``context`` tokens, admitted in
    groups of ``group`` sharing a ``prompt``-token prompt, each decoded to ``context``."""
    manager = BlockManager(num_pages, BLOCK_SIZE, enable_prefix_caching=False,
                           windows=groups.windows)
    held = 0
    for first_id in range(0, 10**9, group):
        members = [Sequence(seq_id=first_id + i, request_id=str(first_id), index=i,
                            token_ids=list(range(prompt)), num_prompt_tokens=prompt,
                            sampling_params=SamplingParams()) for i in range(group)]
        if manager.allocate_slots(members[0], prompt) is None:
            return held
        members[0].num_computed_tokens = prompt
        for child in members[1:]:
            manager.fork(members[0], child)
            child.num_computed_tokens = prompt
        for seq in members:
            if not decode_to(manager, seq, context):
                return held
            held += 1
    return held


def decode_to(manager: BlockManager, seq: Sequence, context: int) -> bool:
    """Decode ``seq`` to ``context`` tokens, allocating where the engine would (a decode
    appending in place needs nothing); False when the pool refused."""
    while seq.num_tokens < context:
        seq.token_ids.append(0)
        if not manager.appends_in_place(seq) and manager.allocate_slots(seq, 1) is None:
            return False
        seq.num_computed_tokens += 1
    return True


def row(shape: Shape, pool_bytes: int, args: argparse.Namespace) -> tuple[str, ...]:
    num_layers = len(shape.windows)
    windowed = kv_groups(shape.windows, args.context + 1)
    full = single_group(num_layers)
    per_row = shape.bytes_per_layer_token() * BLOCK_SIZE
    counts = [fitting_sequences(groups, pool_bytes // (per_row * groups.rows), args.prompt,
                                args.context, args.group) for groups in (full, windowed)]
    sliding = sum(w is not None for w in shape.windows)
    return (shape.name, f"{sliding}/{num_layers}", f"{windowed.num_groups} x {windowed.rows}",
            str(counts[0]), str(counts[1]), f"{counts[1] / counts[0]:.2f}x",
            str(limit(windowed, pool_bytes // (per_row * windowed.rows), args)))


def limit(groups: KVGroups, num_pages: int, args: argparse.Namespace) -> int:
    """The sequences ``num_pages`` hold at the context by arithmetic: per group of
    ``args.group``, its prompt's full blocks once and each member's other blocks in a full
    KV group, a window's pages per member in a sliding one."""
    shared = args.prompt // BLOCK_SIZE
    own = -(-args.context // BLOCK_SIZE) - shared
    pages = sum(shared + args.group * own if window is None
                else args.group * window_pages(window, BLOCK_SIZE) for window in groups.windows)
    return (num_pages - groups.windowed) * args.group // pages


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pool-gib", type=float, default=16.0)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--group", type=int, default=8)
    args = parser.parse_args()
    pool_bytes = int(args.pool_gib * 2**30)
    print(f"pool {args.pool_gib} GiB (bfloat16 KV), block {BLOCK_SIZE} tokens, groups of "
          f"{args.group} sharing a {args.prompt}-token prompt, decoded to {args.context} "
          "tokens")
    print_table([("shape", "sliding layers", "groups x rows", "full-context (reference)",
                  "windowed", "gain", "limit (windowed)"),
                 *(row(shape, pool_bytes, args) for shape in SHAPES)])


if __name__ == "__main__":
    main()
