"""Finished sequences kept with their KV blocks, so that a later turn continues them.

A request added with ``hold_kv=True`` does not free its sequences' blocks when they finish:
each is held under ``(request_id, index)``, and a ``Continuation`` prompt resumes it with
new tokens appended (an environment's answer, as exact token ids), computing only those.
Under memory pressure the scheduler releases held blocks, least recently finished first,
before it preempts any running sequence; a released sequence keeps its token ids (and its
full blocks their prefix-cache hashes), so its continuation recomputes through the cache.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .sequence import Sequence

HeldKey = tuple[str, int]


@dataclass(frozen=True, slots=True)
class Continuation:
    """A prompt that continues completion ``index`` of the held request ``request_id``.

    The new prompt is that completion's tokens (its prompt, every token it sampled) followed
    by ``token_ids``, never re-tokenized text.
    """

    request_id: str
    index: int
    token_ids: list[int]

    @property
    def key(self) -> HeldKey:
        """The held sequence it continues."""
        return (self.request_id, self.index)


class HeldSequences:
    """The held sequences, least recently finished first.

    An entry stays until it is continued or released by its owner; memory pressure only
    takes its blocks.
    """

    def __init__(self) -> None:
        self.seqs: OrderedDict[HeldKey, Sequence] = OrderedDict()
        self.claimed: set[HeldKey] = set()

    def __len__(self) -> int:
        return len(self.seqs)

    def add(self, seq: Sequence) -> None:
        """Hold a finished sequence (the newest)."""
        self.seqs[(seq.request_id, seq.index)] = seq

    def holds_request(self, request_id: str) -> bool:
        """True while some completion of ``request_id`` is held."""
        return any(key[0] == request_id for key in self.seqs)

    def available(self, key: HeldKey) -> Sequence:
        """The held sequence under ``key``, if no continuation has claimed it yet.

        Raises:
            ValueError: when nothing is held under it, or a continuation claimed it.
        """
        seq = self.seqs.get(key)
        if seq is None:
            raise ValueError(f"no held completion {key[1]} of request {key[0]!r}: add the "
                             "request with hold_kv=True, and continue or release it once.")
        if key in self.claimed:
            raise ValueError(f"completion {key[1]} of request {key[0]!r} is being continued "
                             "already: continue each held completion once.")
        return seq

    def claim(self, seq: Sequence) -> None:
        """Mark ``seq`` as continued; it stays held, its blocks releasable under pressure,
        until its continuation is admitted."""
        self.claimed.add((seq.request_id, seq.index))

    def remove(self, seq: Sequence) -> None:
        """Stop holding ``seq`` (continued, or released by its owner)."""
        key = (seq.request_id, seq.index)
        self.seqs.pop(key, None)
        self.claimed.discard(key)

    def with_blocks(self) -> list[Sequence]:
        """Held sequences that still hold KV blocks, least recently finished first."""
        return [seq for seq in self.seqs.values() if seq.block_table]
