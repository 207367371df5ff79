"""A trainer's padded rows as the flat token stream of the engine's kernels, each shared
prefix computed once (the trainer's copy-on-write).

A policy batch holds groups of completions of one prompt, one group after another; a
multi-turn group shares its earlier turns too, and groups of one task often share a system
line or few-shot examples. ``token_stream`` gives each row's tokens that it shares with the
row before it (its longest common prefix with that row: the same tokens at the same
positions, and whatever else the caller compares, such as the sampler's routing) the stream
rows of that row, and appends only the rest. The rows so form a tree of prefixes, each of
its tokens in the stream once.

Each row with tokens of its own is one sequence of the stream's attention: its own tokens
are the queries (the last of its context, as a prefill chunk after a cached prefix), and its
block table, in one-token blocks over the stream's rows, lists its whole row, the shared
tokens' rows first. The engine's kernels give a token the same bits whether its sequence is
prefilled whole or in chunks after a cached prefix, and every other op of the model works
per token, so every token of every row gets the bits the unshared stream (each row whole,
``share=False``) gives it. Rows share only with the row before, so no row can claim a prefix
it does not hold: there is nothing to check.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.kernels import AttentionMetadata


@dataclass(slots=True)
class TokenStream:
    """Padded rows ``[B, T]`` as one flat stream, each shared token once.

    Attributes:
        sources: ``[tokens]`` each stream token's index among the rows' real tokens (in
            ``attention_mask``'s order, row after row): its first row's.
        places: ``[B, T]`` each padded position's stream row; -1 at padding.
        added: ``[B]`` the tokens each row adds to the stream (past its shared prefix).
        metadata: the stream's attention: one sequence per row with tokens of its own,
            those tokens its queries, its block table (one-token blocks) its whole row.
    """

    sources: torch.Tensor
    places: torch.Tensor
    added: torch.Tensor
    metadata: AttentionMetadata

    @property
    def num_tokens(self) -> int:
        """The stream's length."""
        return self.sources.shape[0]


def token_stream(keys: torch.Tensor, attention_mask: torch.Tensor,
                 share: bool = True) -> TokenStream:
    """The stream of padded rows whose real tokens (``attention_mask`` 1, one contiguous
    run per row, as ``policy.token_batch`` lays them out) are compared by ``keys`` ``[B, T,
    F]`` (token id, position id, ...): each row's longest common prefix with the row before
    taken from that row's stream rows (with ``share``; else every row whole)."""
    real = attention_mask.bool()
    num_rows, width = real.shape
    lengths = real.sum(1)
    first = real.int().argmax(1)
    offsets = torch.arange(width, device=real.device)
    inside = offsets < lengths[:, None]  # [B, T]: position i of row b's real tokens
    columns = (first[:, None] + offsets).clamp(max=width - 1)
    shared = _shared_with_previous(keys, columns, inside) if share else \
        torch.zeros_like(inside)
    new = inside & ~shared
    stream_rows = new.flatten().cumsum(0).view(num_rows, width) - 1
    # A shared position's stream row is that of the last row above that computed it.
    rows = torch.arange(num_rows, device=real.device)[:, None]
    owner = torch.where(new, rows, -1).cummax(0).values.clamp(min=0)
    aligned = torch.where(inside, stream_rows.gather(0, owner), -1)
    row_starts = lengths.cumsum(0) - lengths
    sources = (row_starts[:, None] + offsets)[new]
    back = (offsets - first[:, None]).clamp(min=0)
    places = torch.where(real, aligned.gather(1, back), -1)
    added = new.sum(1)
    return TokenStream(sources, places, added, _metadata(aligned, lengths, added))


def _shared_with_previous(keys: torch.Tensor, columns: torch.Tensor,
                          inside: torch.Tensor) -> torch.Tensor:
    """``[B, T]``: True where position i of row b's real tokens lies in its longest common
    prefix with row b - 1 (by ``keys`` ``[B, T, F]``, read at ``columns``)."""
    aligned = keys.gather(1, columns[..., None].expand(-1, -1, keys.shape[2]))
    same = (aligned[1:] == aligned[:-1]).all(-1) & inside[1:] & inside[:-1]
    prefix = same.int().cumprod(1).bool()
    return torch.cat([torch.zeros_like(inside[:1]), prefix])


def _metadata(aligned: torch.Tensor, lengths: torch.Tensor,
              num_new: torch.Tensor) -> AttentionMetadata:
    """The attention of the rows with tokens of their own: each row's stream rows
    ``aligned`` its block table (one-token blocks), its ``lengths`` its context, its
    ``num_new`` last tokens its queries."""
    sequences = (num_new > 0).nonzero().squeeze(1)
    query_lens = num_new[sequences]
    cu_seqlens = torch.cat([query_lens.new_zeros(1), query_lens.cumsum(0)])
    context_lens = lengths[sequences]
    longest = int(context_lens.max()) if len(sequences) else 0
    tables = aligned[sequences, :longest].clamp(min=0)
    return AttentionMetadata(torch.empty(0, dtype=torch.long, device=aligned.device), tables,
                             context_lens, cu_seqlens, num_decodes=0,
                             max_query_len=int(query_lens.max()) if len(sequences) else 0)
