"""What the scheduler hands the model runner for one step: a ``ScheduledBatch``."""

from __future__ import annotations

from dataclasses import dataclass, field

from .sequence import Sequence


@dataclass(slots=True)
class DecodeGroup:
    """The decodes of one request and the first ``num_shared_blocks`` KV blocks they share.

    ``members`` are their rows in the batch. Cascade attention scores the shared blocks
    once for all members.
    """

    members: list[int]
    num_shared_blocks: int


@dataclass(slots=True)
class ScheduledBatch:
    """One step's work: ``seqs[i]`` computes its next ``num_new_tokens[i]`` tokens.

    The first ``num_decodes`` sequences are decodes (one token each); the rest are prefill
    chunks. A sequence samples a token when its chunk reaches its last token. ``copies`` are
    the ``(source, destination)`` KV blocks to copy before the step (copy-on-write);
    ``decode_groups`` the decodes of each request and the leading blocks they share;
    ``num_scored_tokens`` the tokens of chunks that score prompt log-probs.
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_decodes: int = 0
    copies: list[tuple[int, int]] = field(default_factory=list)
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    num_scored_tokens: int = 0

    def samples(self, i: int) -> bool:
        """True when ``seqs[i]`` samples a token at the end of this step."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_new_tokens[i] == seq.num_tokens

    def sampling_groups(self) -> list[list[Sequence]]:
        """The sequences sampling from each sampling row's logits, in batch order.

        A row's group is its sequence and, when a group's prompt completes, the children that
        fork from it.
        """
        return [[seq, *live_seqs(seq.pending_children)] if seq.pending_children else [seq]
                for seq, num_new in zip(self.seqs, self.num_new_tokens)
                if seq.num_computed_tokens + num_new
                == len(seq.token_ids) + seq.num_pending_tokens]

    def add(self, seq: Sequence, num_new_tokens: int,
            copies: list[tuple[int, int]] = ()) -> None:
        """Schedule ``num_new_tokens`` of ``seq`` (after its block ``copies``)."""
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)
        self.copies += copies


def live_seqs(seqs: list[Sequence]) -> list[Sequence]:
    """The sequences of ``seqs`` not finished (aborted children among them)."""
    return [seq for seq in seqs if not seq.is_finished]
