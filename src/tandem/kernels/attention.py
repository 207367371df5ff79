"""Paged attention over a block-structured KV pool: the plain-torch reference.

The Triton kernels (``triton_attention.py``) share these signatures.

The pool of one layer is a pair of tensors ``[num_blocks, block_size, num_kv_heads,
head_dim]``. A token's slot is ``block_id * block_size + offset``. A step's tokens are one
flat stream: decodes first (one query token each), then prefill chunks whose keys are partly
already in the pool (earlier chunks) and partly written in this step.

Every kernel reads the pool through its strides. The engine stores it head-major
(``pool_layout``): each KV head's blocks are one contiguous run, so the reference gathers a
batch's blocks with one ``index_select`` straight into the ``[kv_heads, seqs, tokens,
head_dim]`` layout its matmuls take, with no transpose copy.

Decodes that share leading blocks (a GRPO group's prompt) can be attended as a cascade
(``CascadeLayout``): the shared blocks once per group, with all the members' queries in one
matmul, then each decode's own blocks, one softmax over both parts.

An FP8 pool (``fp8_kv.py``) comes with its layer's scales ``k_scale`` and ``v_scale``
``[kv_heads]``: ``store_kv`` quantizes, the attention dequantizes what it gathers to
float32; every kernel takes them (None for a pool in the model's dtype).

A layer with a sliding window ``W`` (``sliding_window``; None: full attention) attends, from
a query at position q, the keys at positions q - W < k <= q: its last W positions, its own
included (transformers' ``sliding_window_overlay``). Every kernel takes it, and reads only
the blocks that hold keys inside a query's window; the blocks before stay in the pool.

Two more per-layer features, in every kernel. Attention sinks (``sinks``, GPT-OSS's learned
logit per query head, ``[num_heads]``): each head's sink joins its softmax's denominator and
contributes no value, ``out = sum_j e^(s_j) v_j / (sum_j e^(s_j) + e^(sink))`` (a row that
sees no key gives zeros). Logit soft-capping (``softcap``, Gemma 2's
``attn_logit_softcapping``): each scaled score becomes ``softcap * tanh(score / softcap)``
before the mask, and before the sink joins. Both are computed in float32; None: neither.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .fp8_kv import FP8, dequantize, quantize


def pool_layout(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The storage shape of a pool of logical ``shape`` ``[..., num_blocks, block_size,
    num_kv_heads, head_dim]``, and the permutation that views that storage as ``shape``.

    Storage is ``[..., num_kv_heads, num_blocks, block_size, head_dim]``.
    """
    lead = len(shape) - 4
    storage = (*shape[:lead], shape[-2], shape[-4], shape[-3], shape[-1])
    order = (*range(lead), lead + 1, lead + 2, lead, lead + 3)
    return storage, order


MASKED = float("-inf")


@dataclass(slots=True)
class BlockRuns:
    """Runs of KV blocks gathered together, each with the mask of the tokens it holds.

    ``block_ids`` is ``[runs * blocks]``, each run's blocks in order padded with block 0;
    ``bias`` is ``[runs, blocks * block_size]``: 0 for a token attended, ``MASKED`` beyond.
    Built once per step (``block_runs``) and read by every layer; ``rows`` (``pool_rows`` of
    the blocks) is filled by the first layer that gathers and kept for the others, whose
    pools have the same shape.
    """

    block_ids: torch.Tensor
    bias: torch.Tensor
    rows: torch.Tensor | None = None


def block_runs(block_tables: torch.Tensor, lens: torch.Tensor, block_size: int,
               starts: torch.Tensor | None = None) -> BlockRuns:
    """The runs of ``block_tables`` ``[runs, blocks]`` holding ``lens[r]`` tokens each,
    trimmed to the longest; with ``starts``, each run's tokens before ``starts[r]`` masked
    too."""
    num_blocks = math.ceil(int(lens.max()) / block_size)
    positions = torch.arange(num_blocks * block_size, device=lens.device)
    bias = torch.zeros(len(lens), len(positions), device=lens.device)
    bias.masked_fill_(positions[None, :] >= lens[:, None], MASKED)
    if starts is not None:
        bias.masked_fill_(positions[None, :] < starts[:, None], MASKED)
    return BlockRuns(block_tables[:, :num_blocks].flatten(), bias)


def window_runs(block_tables: torch.Tensor, context_lens: torch.Tensor, window: int,
                block_size: int) -> BlockRuns:
    """One run per sequence of ``block_tables`` ``[seqs, blocks]`` over the last ``window``
    of its ``context_lens`` tokens: its blocks from the one holding the window's first
    token, the tokens before that one masked."""
    first = (context_lens - window).clamp(min=0)
    first_block = first // block_size
    width = block_tables.shape[1]
    columns = first_block[:, None] + torch.arange(width, device=block_tables.device)
    tables = block_tables.gather(1, columns.clamp(max=width - 1))
    skipped = first_block * block_size
    return block_runs(tables, context_lens - skipped, block_size, first - skipped)


@dataclass(slots=True)
class CascadeLayout:
    """The step's decodes for cascade attention, built once per step by the runner.

    ``own`` has one run per decode. Without groups (``shared`` None) that is all. With groups,
    ``shared`` has one run per group: the leading blocks all its members share, attended once
    with all the members' queries in one matmul, and ``own`` holds each decode's blocks
    after its group's. ``members[g]`` are group g's decode indices (padded with one of them);
    ``member_slots[d]`` is decode d's place in ``members.flatten()``. Decodes in no group form
    the last group, whose shared run is empty (all ``MASKED``).
    """

    own: BlockRuns
    shared: BlockRuns | None = None
    members: torch.Tensor | None = None
    member_slots: torch.Tensor | None = None


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens go in the pool and what each sequence attends to.

    ``slot_mapping[t]`` is the pool slot of token t (-1: skip). ``block_tables[s]`` lists
    sequence s's blocks (padded with 0), ``context_lens[s]`` its tokens including this step's,
    ``cu_seqlens_q`` the start of each sequence's query tokens in the stream. The first
    ``num_decodes`` sequences have one query token each; ``max_query_len`` is the longest
    query chunk (known on the host, so kernels can size their grids without a device sync).
    ``cascade``, set by the runner for kernels that use it, lays the decodes out for cascade
    attention (the others ignore it). With KV groups (the pool's pages shared by full and
    sliding layers, ``rollout/core/kv_groups.py``) this is group 0's metadata and
    ``kv_groups`` the other groups', each with its own ``slot_mapping`` and
    ``block_tables`` (and no cascade): a layer reads its group's (``of_group``).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    num_decodes: int
    max_query_len: int = 1
    cascade: CascadeLayout | None = None
    kv_groups: list[AttentionMetadata] = field(default_factory=list)

    def of_group(self, group: int) -> AttentionMetadata:
        """The metadata of KV group ``group`` (0: this one)."""
        return self.kv_groups[group - 1] if group else self


class DecodeBuffers:
    """The static attention metadata of captured decode steps (``AttentionMetadata``'s
    format): buffers of ``max_size`` sequences that a step's metadata is copied into, the
    rows past it padding (slot -1: nothing written; context 0: nothing read); with
    ``num_groups`` KV groups, a slot mapping and block tables per group."""

    def __init__(self, max_size: int, max_blocks_per_seq: int, device: torch.device,
                 num_groups: int = 1) -> None:
        self.slot_mapping = torch.full((num_groups, max_size), -1, dtype=torch.long,
                                       device=device)
        self.context_lens = torch.zeros(max_size, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(num_groups, max_size, max_blocks_per_seq,
                                        dtype=torch.long, device=device)
        self.cu_seqlens_q = torch.arange(max_size + 1, dtype=torch.long, device=device)

    def metadata(self, size: int) -> AttentionMetadata:
        """The metadata of a ``size``-sequence decode step, over the buffers."""
        groups = [AttentionMetadata(
            slot_mapping=self.slot_mapping[group, :size],
            block_tables=self.block_tables[group, :size],
            context_lens=self.context_lens[:size], cu_seqlens_q=self.cu_seqlens_q[:size + 1],
            num_decodes=size, max_query_len=1) for group in range(len(self.slot_mapping))]
        groups[0].kv_groups = groups[1:]
        return groups[0]

    def stage(self, metadata: AttentionMetadata, size: int) -> None:
        """Copy a decode step's metadata in, its rows up to ``size`` padding."""
        num_seqs = metadata.context_lens.shape[0]
        self.context_lens[:num_seqs].copy_(metadata.context_lens)
        self.context_lens[num_seqs:size].fill_(0)
        for group, group_metadata in enumerate([metadata, *metadata.kv_groups]):
            self.slot_mapping[group, :num_seqs].copy_(group_metadata.slot_mapping)
            self.slot_mapping[group, num_seqs:size].fill_(-1)
            width = group_metadata.block_tables.shape[1]
            self.block_tables[group, :num_seqs, :width].copy_(group_metadata.block_tables)

    def pad(self) -> None:
        """Make every row padding (a capture runs over them)."""
        self.slot_mapping.fill_(-1)
        self.context_lens.fill_(0)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the pool;
    into an FP8 pool quantized by its ``k_scale``/``v_scale`` (``fp8_kv.quantize``).

    Tokens whose slot is -1 (padding) are skipped.
    """
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    for rows, cache, kv_scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        if cache.dtype == FP8:  # index_copy_ takes no float8: copy the bytes
            rows, cache = quantize(rows, kv_scale).view(torch.uint8), cache.view(torch.uint8)
        cache.flatten(0, 1).index_copy_(0, slot_mapping, rows)


@dataclass(frozen=True, slots=True)
class _Pool:
    """One layer's pool as the reference reads it: K and V, and their scales if FP8."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None

    def keys(self, rows: torch.Tensor, num_runs: int) -> torch.Tensor:
        """The keys of ``rows`` (``pool_rows``), as ``_gather`` lays them out."""
        return _gather(self.k_cache, rows, num_runs, self.k_scale)

    def values(self, rows: torch.Tensor, num_runs: int) -> torch.Tensor:
        """The values of ``rows``, as ``keys``."""
        return _gather(self.v_cache, rows, num_runs, self.v_scale)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    metadata: AttentionMetadata, scale: float,
                    k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None,
                    sliding_window: int | None = None, sinks: torch.Tensor | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Causal attention of ``query`` ``[num_tokens, num_heads, head_dim]`` over the pool
    (an FP8 one read through its ``k_scale``/``v_scale``).

    Query heads are grouped over the KV heads (GQA). Each query token attends to the keys of
    its own sequence at positions up to its own, and with a ``sliding_window`` W only to the
    last W of them (its own included); each head's softmax with its ``sinks`` logit, over
    scores soft-capped at ``softcap`` (see the module docstring). Returns ``[num_tokens,
    num_heads, head_dim]``.
    """
    pool = _Pool(k_cache, v_cache, k_scale, v_scale)
    logits = _Logits(scale, sliding_window, None if sinks is None else sinks.float(), softcap)
    output = torch.empty_like(query)
    num_decodes = metadata.num_decodes
    if num_decodes:
        output[:num_decodes] = _decode_attention(query[:num_decodes], pool, metadata, logits)
    _attend_prefills(query, pool, metadata, logits, output)
    return output


@dataclass(frozen=True, slots=True)
class _Logits:
    """What turns one layer's scores into probabilities: its ``scale``, its ``window``, its
    heads' ``sinks`` (float32) and its ``softcap``."""

    scale: float
    window: int | None
    sinks: torch.Tensor | None
    softcap: float | None


def _soft_cap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``softcap * tanh(scores / softcap)`` (a new tensor), or ``scores`` for no cap."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def _sink_softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """The softmax of ``scores`` over their last dimension with ``sinks`` (broadcast to one
    column; None: no sink) as one more column, that column dropped."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    column = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]


def softmax_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      mask: torch.Tensor, scale: float, sinks: torch.Tensor | None = None,
                      softcap: float | None = None) -> torch.Tensor:
    """Attention written out, for what SDPA cannot do (sinks, a soft cap): ``query``
    ``[heads, queries, head_dim]`` against ``keys`` and ``values`` ``[heads, keys,
    head_dim]`` (repeated for GQA) where ``mask`` ``[queries, keys]`` is True, the scores
    soft-capped, each head's ``sinks`` logit joining its softmax. Differentiable in every
    tensor; returns ``[heads, queries, head_dim]``."""
    scores = _soft_cap(torch.matmul(query, keys.transpose(-1, -2)) * scale, softcap)
    probs = _sink_softmax(scores.masked_fill(~mask, MASKED),
                         None if sinks is None else sinks[:, None, None])
    return torch.matmul(probs, values)


def _attend_prefills(query: torch.Tensor, pool: _Pool, metadata: AttentionMetadata,
                     logits: _Logits, output: torch.Tensor) -> None:
    """Write the attention of the step's prefill chunks (the query tokens after the
    decodes') into the same rows of ``output``, one sequence at a time."""
    num_decodes = metadata.num_decodes
    if num_decodes == len(metadata.context_lens):
        return
    starts = metadata.cu_seqlens_q.tolist()
    context_lens = metadata.context_lens.tolist()
    for s in range(num_decodes, len(context_lens)):
        start, end = starts[s], starts[s + 1]
        output[start:end] = _prefill_attention(
            query[start:end], pool, metadata.block_tables[s], context_lens[s], logits)


def pool_rows(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """The rows of the head-major pool ``cache`` (``pool_layout``: each KV head's blocks one
    after the other, a block's tokens one row) that hold ``block_ids``: every KV head's
    row of each block, head by head."""
    num_blocks, num_kv_heads = cache.shape[0], cache.shape[2]
    heads = torch.arange(0, num_kv_heads * num_blocks, num_blocks, device=block_ids.device)
    return (heads[:, None] + block_ids[None, :]).flatten()


def _gather(cache: torch.Tensor, rows: torch.Tensor, num_runs: int,
            kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The tokens of ``num_runs`` runs of blocks (their ``pool_rows``) as ``[kv_heads, runs,
    tokens, head_dim]``, float32 for a half-precision pool, and dequantized by ``kv_scale``
    from an FP8 one.

    One ``index_select`` of whole rows of the head-major pool: 1.3-1.6x faster than the
    same selection along its block dimension. A pool stored otherwise is copied whole
    first (correct, but only for tests).
    """
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    runs = cache.permute(2, 0, 1, 3).reshape(num_kv_heads * num_blocks, block_size * head_dim)
    tokens = runs.index_select(0, rows).view(num_kv_heads, num_runs, -1, head_dim)
    return dequantize(tokens, kv_scale, dim=0) if cache.dtype == FP8 else _upcast(tokens)


def _upcast(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in float32 if it is half precision: the reference computes attention in
    float32 whatever the pool's dtype (and on CPU, SDPA in bfloat16 is several times slower)."""
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor


def _scores(query: torch.Tensor, pool: _Pool, runs: BlockRuns,
            logits: _Logits) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked scores of ``query`` ``[kv_heads, runs, rows, head_dim]`` (already scaled)
    against its run's tokens, soft-capped by ``logits``, ``[kv_heads, runs, rows, tokens]``,
    and the run's values ``[kv_heads, runs, tokens, head_dim]``."""
    num_runs = runs.bias.shape[0]
    if runs.rows is None:
        runs.rows = pool_rows(pool.k_cache, runs.block_ids)
    keys = pool.keys(runs.rows, num_runs)
    scores = _soft_cap(torch.matmul(query, keys.transpose(-1, -2)), logits.softcap)
    return scores.add_(runs.bias[:, None, :]), pool.values(runs.rows, num_runs)


def _decode_layout(metadata: AttentionMetadata, block_size: int,
                   window: int | None) -> CascadeLayout:
    """The decodes' runs: ``metadata.cascade`` where the runner laid one out and no window
    cuts into a decode's context; else one run per decode, over its window's blocks alone
    where its window is shorter than the longest context (``window_runs``)."""
    num_decodes = metadata.num_decodes
    tables, lens = metadata.block_tables[:num_decodes], metadata.context_lens[:num_decodes]
    if window is not None and int(lens.max()) > window:
        return CascadeLayout(window_runs(tables, lens, window, block_size))
    return metadata.cascade or CascadeLayout(block_runs(tables, lens, block_size))


def _decode_attention(query: torch.Tensor, pool: _Pool, metadata: AttentionMetadata,
                      logits: _Logits) -> torch.Tensor:
    """One query token per decode, all decodes batched; a cascade when ``metadata.cascade``
    groups them (and no window cuts into their contexts: a window's blocks are read per
    decode, ``_decode_layout``).

    In the cascade, each group's scores against its shared blocks are computed once, with
    all its members' queries in one matmul, then copied out per decode beside the decode's
    scores against its own blocks; one softmax over both (and the sinks) normalises them
    together.
    """
    num_decodes, num_heads, head_dim = query.shape
    num_kv_heads = pool.k_cache.shape[2]
    heads = _upcast(query).view(num_decodes, num_kv_heads, -1, head_dim).transpose(0, 1) * \
        logits.scale
    # Head h = kv_head * group + g: its sink is row g of its KV head's.
    sinks = None if logits.sinks is None else logits.sinks.view(num_kv_heads, 1, -1, 1)
    layout = _decode_layout(metadata, pool.k_cache.shape[1], logits.window)
    scores, values = _scores(heads, pool, layout.own, logits)
    if layout.shared is None:
        out = torch.matmul(_sink_softmax(scores, sinks), values)
    else:
        rows = heads.shape[2]
        num_groups, width = layout.members.shape
        members = layout.members.flatten()

        def per_decode(grouped: torch.Tensor) -> torch.Tensor:
            return grouped.reshape(num_kv_heads, num_groups * width, rows, -1).index_select(
                1, layout.member_slots)

        grouped_query = heads.index_select(1, members).view(num_kv_heads, num_groups, -1,
                                                            head_dim)
        shared_scores, shared_values = _scores(grouped_query, pool, layout.shared, logits)
        num_shared = shared_scores.shape[-1]
        probs = _sink_softmax(torch.cat([per_decode(shared_scores), scores], dim=-1), sinks)
        shared_probs = probs[..., :num_shared].index_select(1, members)
        shared_out = torch.matmul(shared_probs.view(num_kv_heads, num_groups, -1, num_shared),
                                  shared_values)
        out = torch.matmul(probs[..., num_shared:], values).add_(per_decode(shared_out))
    return out.transpose(0, 1).reshape(num_decodes, num_heads, head_dim).to(query.dtype)


def _prefill_attention(query: torch.Tensor, pool: _Pool, block_table: torch.Tensor,
                       context_len: int, logits: _Logits) -> torch.Tensor:
    """One sequence's query chunk, the last ``len(query)`` of its ``context_len`` tokens;
    with a window, from the block holding its first query's first key on. SDPA where it
    can; written out (``softmax_attention``) with sinks or a soft cap."""
    output_dtype, scale, window = query.dtype, logits.scale, logits.window
    block_size = pool.k_cache.shape[1]
    num_query = query.shape[0]
    windowed = window is not None and window < context_len
    first_key = max(0, context_len - num_query - window + 1) if windowed else 0
    skipped = first_key // block_size * block_size
    rows = pool_rows(pool.k_cache, block_table[skipped // block_size:
                                               math.ceil(context_len / block_size)])
    keys = pool.keys(rows, 1)[:, 0, :context_len - skipped]
    values = pool.values(rows, 1)[:, 0, :context_len - skipped]
    query = _upcast(query.transpose(0, 1))
    num_groups = query.shape[0] // keys.shape[0]
    # Four-dimensional inputs with the key/value heads repeated reach SDPA's flash kernel on
    # CPU; three-dimensional or enable_gqa ones take its math path, 3-6x slower at 564 tokens.
    keys, values = (t.repeat_interleave(num_groups, 0)[None] for t in (keys, values))
    explicit = logits.sinks is not None or logits.softcap is not None
    if num_query == context_len and not windowed and not explicit:
        out = F.scaled_dot_product_attention(query[None], keys, values, is_causal=True,
                                             scale=scale)
    else:
        mask = _chunk_mask(context_len, num_query, skipped, window if windowed else None,
                           query.device)
        if explicit:
            out = softmax_attention(query, keys[0], values[0], mask, scale, logits.sinks,
                                    logits.softcap)[None]
        else:
            out = F.scaled_dot_product_attention(query[None], keys, values, attn_mask=mask,
                                                 scale=scale)
    return out[0].transpose(0, 1).to(output_dtype)


def _chunk_mask(context_len: int, num_query: int, first_key: int, window: int | None,
                device: torch.device) -> torch.Tensor:
    """``[num_query, context_len - first_key]``: True where the chunk's query (the last
    ``num_query`` of ``context_len`` positions) sees the key at ``first_key`` + column: at or
    before its own position, and within its ``window``."""
    query_pos = torch.arange(context_len - num_query, context_len, device=device)
    key_pos = torch.arange(first_key, context_len, device=device)
    mask = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        mask &= key_pos[None, :] > query_pos[:, None] - window
    return mask
