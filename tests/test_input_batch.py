"""The persistent batch's step inputs against a flattening from scratch, step after step of
a real scheduler: decodes, prefill chunks, groups that fork and copy on write, preemption,
prompt log-probs, finishes and aborts."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.rollout.core.block_manager import BlockManager
from tandem.rollout.core.held import HeldSequences
from tandem.rollout.core.scheduled_batch import ScheduledBatch
from tandem.rollout.core.scheduler import Scheduler, SchedulerConfig
from tandem.rollout.core.sequence import Request
from tandem.rollout.outputs import SamplerOutput
from tandem.rollout.sampling_params import SamplingParams
from tandem.rollout.worker.input_batch import InputBatch

BLOCK_SIZE = 4


def reference_inputs(batch: ScheduledBatch) -> dict[str, list]:
    """The step's inputs flattened token by token from the sequences' own lists."""
    flat: dict[str, list] = {name: [] for name in (
        "input_ids", "positions", "slot_mapping", "context_lens", "sample_rows", "prompt_rows")}
    cu_seqlens_q = [0]
    for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
        start = seq.num_computed_tokens
        for position in range(start, start + num_new):
            flat["input_ids"].append(seq.token_ids[position])
            flat["positions"].append(position)
            block = seq.block_table[position // BLOCK_SIZE]
            flat["slot_mapping"].append(block * BLOCK_SIZE + position % BLOCK_SIZE)
            if (seq.needs_prompt_logprobs and len(seq.prompt_logprobs) <= position
                    < seq.num_prompt_tokens - 1):
                flat["prompt_rows"].append(cu_seqlens_q[-1] + position - start)
        cu_seqlens_q.append(cu_seqlens_q[-1] + num_new)
        flat["context_lens"].append(start + num_new)
        if start + num_new == seq.num_tokens:
            flat["sample_rows"].append(cu_seqlens_q[-1] - 1)
    width = max(len(seq.block_table) for seq in batch.seqs)
    flat["block_tables"] = [seq.block_table + [0] * (width - len(seq.block_table))
                            for seq in batch.seqs]
    flat["cu_seqlens_q"] = cu_seqlens_q
    return flat


def fake_output(batch: ScheduledBatch, scored: list[tuple[int, int, int]],
                rng: random.Random) -> SamplerOutput:
    """A random token per sampling sequence, a placeholder per scored prompt position."""
    count = sum(len(group) for group in batch.sampling_groups())
    tokens = [rng.randrange(8) for _ in range(count)]
    prompt = {i: [{0: 0.0}] * (end - start) for i, start, end in scored}
    return SamplerOutput(tokens, [-1.0] * count, [None] * count, prompt_logprobs=prompt)


def add_request(scheduler: Scheduler, request_id: int, rng: random.Random, seq_ids) -> None:
    params = SamplingParams(n=rng.choice([1, 1, 2, 3]), max_tokens=rng.randrange(1, 14),
                            prompt_logprobs=0 if rng.random() < 0.2 else None)
    prompt = [rng.randrange(8) for _ in range(rng.randrange(1, 3 * BLOCK_SIZE + 3))]
    request = Request(str(request_id), None, prompt, params)
    scheduler.add(request.make_sequences(seq_ids, hold_kv=False))


@pytest.mark.parametrize("seed", range(6))
def test_step_inputs_match_a_flattening_from_scratch_every_step(seed):
    rng = random.Random(seed)
    blocks = BlockManager(num_blocks=rng.choice([10, 16]), block_size=BLOCK_SIZE)
    scheduler = Scheduler(SchedulerConfig(12, rng.choice([6, 24]), 64), blocks, {0},
                          lambda seq: None, HeldSequences())
    inputs = InputBatch(BLOCK_SIZE, torch.device("cpu"), cascade=False)
    seq_ids, requests = iter(range(10**6)), 0
    for _ in range(150):
        while requests < 40 and rng.random() < 0.3:
            add_request(scheduler, requests, rng, seq_ids)
            requests += 1
        if scheduler.running and rng.random() < 0.05:
            scheduler.finish(rng.choice(scheduler.running), "abort")
        batch = scheduler.schedule()
        if not batch.seqs:
            continue
        step, num_sampling, scored = inputs.prepare(batch)
        expected = reference_inputs(batch)
        metadata = step.metadata
        assert step.input_ids.tolist() == expected["input_ids"]
        assert step.positions.tolist() == expected["positions"]
        assert metadata.slot_mapping.tolist() == expected["slot_mapping"]
        assert metadata.block_tables.tolist() == expected["block_tables"]
        assert metadata.context_lens.tolist() == expected["context_lens"]
        assert metadata.cu_seqlens_q.tolist() == expected["cu_seqlens_q"]
        assert metadata.max_query_len == max(batch.num_new_tokens)
        assert num_sampling == len(expected["sample_rows"])
        assert step.logit_rows.tolist() == expected["sample_rows"] + expected["prompt_rows"]
        assert step.copies.tolist() == [list(c) for c in zip(*batch.copies)] or (
            not batch.copies and step.copies.numel() == 0)
        scheduler.update_from_output(batch, fake_output(batch, scored, rng), weight_version=0)
    assert scheduler.num_preemptions
    assert scheduler.block_manager.num_cow_copies
