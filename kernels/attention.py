"""Paged attention over a block-structured KV pool: the plain-torch reference.

The Triton kernels (``triton_attention.py``) share these signatures.

The pool of one layer is a pair of tensors ``[num_blocks, block_size, num_kv_heads,
head_dim]``. A token's slot is ``block_id * block_size + offset``. A step's tokens are one
flat stream: decodes first (one query token each), then prefill chunks whose keys are partly
already in the pool (earlier chunks) and partly written in this step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens go in the pool and what each sequence attends to.

    ``slot_mapping[t]`` is the pool slot of token t (-1: skip). ``block_tables[s]`` lists
    sequence s's blocks (padded with 0), ``context_lens[s]`` its tokens including this step's,
    ``cu_seqlens_q`` the start of each sequence's query tokens in the stream. The first
    ``num_decodes`` sequences have one query token each; ``max_query_len`` is the longest
    query chunk (known on the host, so kernels can size their grids without a device sync).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    num_decodes: int
    max_query_len: int = 1


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the pool.

    Tokens whose slot is -1 (padding) are skipped.
    """
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    metadata: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of ``query`` ``[num_tokens, num_heads, head_dim]`` over the pool.

    Query heads are grouped over the KV heads (GQA). Each query token attends to the keys of
    its own sequence at positions up to its own. Returns ``[num_tokens, num_heads, head_dim]``.
    """
    output = torch.empty_like(query)
    num_decodes = metadata.num_decodes
    if num_decodes:
        output[:num_decodes] = _decode_attention(
            query[:num_decodes], k_cache, v_cache, metadata.block_tables[:num_decodes],
            metadata.context_lens[:num_decodes], scale)
    starts = metadata.cu_seqlens_q.tolist()
    context_lens = metadata.context_lens.tolist()
    for s in range(num_decodes, len(context_lens)):
        start, end = starts[s], starts[s + 1]
        output[start:end] = _prefill_attention(
            query[start:end], k_cache, v_cache, metadata.block_tables[s], context_lens[s], scale)
    return output


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """The pool's rows for ``block_table`` as ``[..., num_blocks * block_size, kv_heads, dim]``,
    upcast to float32 from half precision."""
    return _upcast(cache[block_table].flatten(-4, -3))


def _upcast(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in float32 if it is half precision: the reference computes attention in
    float32 whatever the pool's dtype (and on CPU, SDPA in bfloat16 is several times slower)."""
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor


def _decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, context_lens: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """One query token per sequence, all sequences in one padded, masked SDPA call."""
    block_size = k_cache.shape[1]
    num_blocks = -(-int(context_lens.max()) // block_size)
    block_tables = block_tables[:, :num_blocks]
    keys = _gather(k_cache, block_tables).transpose(1, 2)
    values = _gather(v_cache, block_tables).transpose(1, 2)
    positions = torch.arange(keys.shape[2], device=query.device)
    mask = (positions[None, :] < context_lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(_upcast(query.unsqueeze(2)), keys, values,
                                         attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(2).to(query.dtype)


def _prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_table: torch.Tensor, context_len: int,
                       scale: float) -> torch.Tensor:
    """One sequence's query chunk, the last ``len(query)`` of its ``context_len`` tokens."""
    output_dtype = query.dtype
    block_size = k_cache.shape[1]
    block_table = block_table[: -(-context_len // block_size)]
    keys = _gather(k_cache, block_table)[:context_len].transpose(0, 1)
    values = _gather(v_cache, block_table)[:context_len].transpose(0, 1)
    query = _upcast(query.transpose(0, 1))
    num_query = query.shape[1]
    if num_query == context_len:
        out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale,
                                             enable_gqa=True)
    else:
        query_pos = torch.arange(context_len - num_query, context_len, device=query.device)
        key_pos = torch.arange(context_len, device=query.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale,
                                             enable_gqa=True)
    return out.transpose(0, 1).to(output_dtype)
