"""Cascade attention over decode groups against plain paged attention, on random decode
batches: the groups' shared blocks as the block manager finds them, laid out by
``cascade_layout``."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.kernels import TORCH_OPS, AttentionMetadata, pool_layout
from tandem.rollout import SamplingParams
from tandem.rollout.core.block_manager import BlockManager, num_blocks_for
from tandem.rollout.core.scheduled_batch import DecodeGroup, ScheduledBatch
from tandem.rollout.core.sequence import Sequence
from tandem.rollout.worker.attention_layout import cascade_layout

BLOCK_SIZE = 16
NUM_BLOCKS = 200

# A request: how many prompt tokens its decodes share (as full blocks where they fill one),
# and each decode's tokens after the prompt.
requests = st.lists(
    st.tuples(st.integers(1, 70), st.lists(st.integers(1, 40), min_size=1, max_size=5)),
    min_size=1, max_size=6)


def decode_batch(spec: list[tuple[int, list[int]]]) -> list[Sequence]:
    """Decodes whose block tables share each request's full prompt blocks (as a fork does);
    every other block is a sequence's own."""
    free = iter(torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(0)).tolist())
    decodes = []
    for r, (prompt_len, extra_lens) in enumerate(spec):
        shared = [next(free) for _ in range(prompt_len // BLOCK_SIZE)]
        for extra in extra_lens:
            num_tokens = prompt_len + extra
            own = [next(free) for _ in range(num_blocks_for(num_tokens, BLOCK_SIZE) - len(shared))]
            decodes.append(Sequence(
                seq_id=len(decodes), request_id=str(r), index=0, token_ids=[1] * num_tokens,
                num_prompt_tokens=prompt_len, sampling_params=SamplingParams(),
                num_computed_tokens=num_tokens - 1, block_table=shared + own))
    return decodes


@settings(max_examples=40, deadline=None)
@given(spec=requests)
def test_cascade_layout_attends_exactly_each_decodes_context(spec):
    decodes = decode_batch(spec)
    manager = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    batch = ScheduledBatch(seqs=decodes, num_new_tokens=[1] * len(decodes),
                           num_decodes=len(decodes))
    for r in range(len(spec)):
        rows = [d for d, seq in enumerate(decodes) if seq.request_id == str(r)]
        num_shared = manager.shared_prefix_blocks([decodes[d] for d in rows])
        assert num_shared == (spec[r][0] // BLOCK_SIZE if len(rows) > 1 else num_shared)
        batch.decode_groups.append(DecodeGroup(rows, num_shared if len(rows) > 1 else 0))
    context_lens = torch.tensor([seq.num_tokens for seq in decodes])
    tables = [seq.block_table for seq in decodes]
    width = max(map(len, tables))
    metadata = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.long),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        context_lens=context_lens, cu_seqlens_q=torch.arange(len(decodes) + 1),
        num_decodes=len(decodes))
    generator = torch.Generator().manual_seed(1)
    storage, order = pool_layout((NUM_BLOCKS, BLOCK_SIZE, 2, 8))
    k_cache, v_cache = (torch.randn(storage, generator=generator, dtype=torch.float64)
                        .permute(order) for _ in range(2))
    query = torch.randn(len(decodes), 6, 8, generator=generator, dtype=torch.float64)
    plain = TORCH_OPS.paged_attention(query, k_cache, v_cache, metadata, 0.3)
    metadata.cascade = cascade_layout(batch, BLOCK_SIZE, torch.device("cpu"))
    cascade = TORCH_OPS.paged_attention(query, k_cache, v_cache, metadata, 0.3)
    assert torch.allclose(cascade, plain, rtol=1e-12, atol=1e-12)
    layout = metadata.cascade
    if layout.shared is not None:
        num_groups, group_width = layout.members.shape
        slots = layout.member_slots.tolist()
        assert sorted(slots) == sorted(set(slots))
        assert all(layout.members.flatten()[s] == d for d, s in enumerate(slots))
        attended = (layout.shared.bias == 0).sum(1)[torch.tensor(slots) // group_width]
    else:
        attended = torch.zeros(len(decodes), dtype=torch.long)
    assert torch.equal(attended + (layout.own.bias == 0).sum(1), context_lens)
