"""Decode-graph bookkeeping that needs no GPU: the batch-size ladder, input padding, and the
addresses the graphs hold."""

from __future__ import annotations

import torch

from tandem.kernels import TORCH_OPS, AttentionMetadata
from tandem.rollout import LLM
from tandem.rollout.worker.cuda_graphs import (
    DecodeGraphs,
    graph_addresses,
    graph_batch_sizes,
    padded_batch_size,
)


def test_ladder_is_powers_of_two_then_steps_of_8_then_16_up_to_max_num_seqs():
    assert graph_batch_sizes(256) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112,
                                      128, 144, 160, 176, 192, 208, 224, 240, 256]
    assert graph_batch_sizes(10) == [1, 2, 4, 8, 10]
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(70) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 70]


def test_step_replays_the_smallest_captured_size_that_holds_it():
    sizes = graph_batch_sizes(64)
    assert [padded_batch_size(sizes, n) for n in (1, 2, 3, 5, 8, 9, 63, 64)] == [
        1, 2, 4, 8, 8, 16, 64, 64]
    assert padded_batch_size(sizes, 65) is None


def decode_step(context_lens: list[int], block_tables: list[list[int]]):
    num_seqs = len(context_lens)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor([c + 100 for c in context_lens]),
        block_tables=torch.tensor(block_tables), context_lens=torch.tensor(context_lens),
        cu_seqlens_q=torch.arange(num_seqs + 1), num_decodes=num_seqs)
    return torch.arange(num_seqs) + 7, torch.tensor(context_lens) - 1, metadata


def test_staging_pads_rows_past_the_batch_with_slot_minus_one_and_empty_context():
    graphs = DecodeGraphs([1, 2, 4, 8], max_blocks_per_seq=5, device=torch.device("cpu"),
                          backend=TORCH_OPS.attention)
    graphs.stage(*decode_step([30, 31, 32, 33, 34, 35], [[1, 2]] * 6))
    size = graphs.stage(*decode_step([40, 17, 3], [[3, 4, 5], [6, 7, 0], [8, 0, 0]]))
    assert size == 4
    assert graphs.buffers.slot_mapping[0, :4].tolist() == [140, 117, 103, -1]
    assert graphs.buffers.context_lens[:4].tolist() == [40, 17, 3, 0]
    assert graphs.input_ids[:3].tolist() == [7, 8, 9]
    assert graphs.positions[:3].tolist() == [39, 16, 2]
    assert graphs.buffers.block_tables[0, :3, :3].tolist() == [[3, 4, 5], [6, 7, 0], [8, 0, 0]]
    metadata = graphs.metadata(size)
    assert metadata.num_decodes == 4 and metadata.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4]


def test_cpu_engine_never_captures(llama_dir):
    for backend in ("torch", "triton"):
        llm = LLM(str(llama_dir), attention_backend=backend, num_kv_blocks=32)
        assert llm.engine.runner.graph_sizes == [] and llm.engine.runner.graphs is None
        stats = llm.stats()
        assert stats["num_decode_graphs"] == 0 and stats["graph_bytes"] == 0


def test_graph_addresses_change_when_a_tensor_moves_not_when_it_is_written(llama_dir):
    runner = LLM(str(llama_dir), num_kv_blocks=32).engine.runner
    model = runner.model
    captured = graph_addresses(model, runner.kv_cache)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
        runner.kv_cache.fill_(1.0)
    assert graph_addresses(model, runner.kv_cache) == captured
    assert graph_addresses(model, runner.kv_cache.clone()) != captured
    rotary = model.rotary_emb
    cos, rotary.cos = rotary.cos, rotary.cos.clone()
    assert graph_addresses(model, runner.kv_cache) != captured
    rotary.cos = cos
    param = list(model.parameters())[-1]
    param.data = param.data.clone()  # an alias update adopting a new tensor
    assert graph_addresses(model, runner.kv_cache) != captured
