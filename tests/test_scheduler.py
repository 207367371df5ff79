"""Continuous batching: token budgets, chunked prefill, admission limits and preemption."""

from __future__ import annotations

from tandem.rollout import LLM, SamplingParams
from tandem.rollout.core.block_manager import BlockManager
from tandem.rollout.core.held import HeldSequences
from tandem.rollout.core.scheduler import MAX_SCORED_TOKENS, Scheduler, SchedulerConfig
from tandem.rollout.core.sequence import Sequence
from tandem.rollout.outputs import SamplerOutput

PROMPTS = ["What is 2+3? The answer is", "The quick brown fox jumps over the lazy dog. " * 3,
           "def add(a, b):\n    return a + b\n" * 2, "Seven"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def greedy_tokens(llm: LLM) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_tiny_token_budget_chunks_prefill_with_same_greedy_output(llama_dir):
    roomy = greedy_tokens(LLM(str(llama_dir)))
    chunked = LLM(str(llama_dir), max_num_batched_tokens=7)
    assert greedy_tokens(chunked) == roomy
    assert chunked.stats()["kv_blocks_used"] == 0


def test_tiny_kv_pool_preempts_with_same_greedy_output(llama_dir):
    roomy = greedy_tokens(LLM(str(llama_dir)))
    tiny = LLM(str(llama_dir), num_kv_blocks=14, block_size=8, max_model_len=112)
    assert greedy_tokens(tiny) == roomy
    assert tiny.stats()["preemptions"] > 0
    assert tiny.stats()["kv_blocks_used"] == 0


def test_max_num_seqs_one_runs_requests_one_at_a_time(llama_dir):
    roomy = greedy_tokens(LLM(str(llama_dir)))
    assert greedy_tokens(LLM(str(llama_dir), max_num_seqs=1)) == roomy


def make_seq(seq_id: int, num_tokens: int) -> Sequence:
    tokens = [seq_id * 100 + i for i in range(num_tokens)]
    return Sequence(seq_id=seq_id, request_id=str(seq_id), index=0, token_ids=tokens,
                    num_prompt_tokens=num_tokens, sampling_params=SamplingParams())


def make_scheduler(max_num_batched_tokens: int) -> Scheduler:
    return Scheduler(SchedulerConfig(8, max_num_batched_tokens, 64, True),
                          BlockManager(num_blocks=32, block_size=4), {0}, lambda seq: None,
                          HeldSequences())


def test_step_puts_decodes_first_then_prefill_chunks_within_budget():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    first = make_seq(0, 6)
    scheduler.add(first)
    batch = scheduler.schedule()
    assert batch.seqs == [first] and batch.num_new_tokens == [6] and batch.samples(0)
    scheduler.update_from_output(batch, SamplerOutput([7], [-0.5], [None]), weight_version=0)
    second, third = make_seq(1, 3), make_seq(2, 8)
    scheduler.add(second)
    scheduler.add(third)
    batch = scheduler.schedule()
    assert batch.seqs == [first, second, third] and batch.num_decodes == 1
    assert batch.num_new_tokens == [1, 3, 6]
    assert [batch.samples(i) for i in range(3)] == [True, True, False]


def test_a_step_past_half_its_budget_leaves_a_prompt_it_cannot_finish_to_the_next():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    first, second, third = make_seq(0, 7), make_seq(1, 5), make_seq(2, 12)
    for seq in (first, second, third):
        scheduler.add(seq)
    batch = scheduler.schedule()  # 7 of 10 taken: the 5-token prompt waits, not split 3 + 2
    assert batch.seqs == [first] and batch.num_new_tokens == [7]
    scheduler.update_from_output(batch, SamplerOutput([7], [-0.5], [None]), weight_version=0)
    batch = scheduler.schedule()  # 6 of 10 taken: the 12-token prompt waits too
    assert batch.seqs == [first, second] and batch.num_new_tokens == [1, 5]
    scheduler.update_from_output(batch, SamplerOutput([7, 7], [-0.5] * 2, [None] * 2),
                                 weight_version=0)
    batch = scheduler.schedule()  # under half taken: it starts with what is left
    assert batch.seqs == [first, second, third] and batch.num_new_tokens == [1, 1, 8]


def test_a_cached_prefix_counts_as_done_when_a_step_decides_whether_a_prompt_fits():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    cached = make_seq(0, 9)
    scheduler.add(cached)
    batch = scheduler.schedule()
    scheduler.update_from_output(batch, SamplerOutput([7], [-0.5], [None]), weight_version=0)
    hit = make_seq(1, 11)
    hit.token_ids[:8] = cached.token_ids[:8]  # its first two blocks are cached
    scheduler.add(hit)
    batch = scheduler.schedule()  # 1 decode + 3 to compute, though 11 is more than 9 left
    assert batch.seqs == [cached, hit] and batch.num_new_tokens == [1, 3]


def test_update_appends_tokens_and_retires_stopped_sequences_with_their_reason():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    stops, runs = make_seq(1, 5), make_seq(2, 5)
    for seq in (stops, runs):
        scheduler.add(seq)
    batch = scheduler.schedule()
    finished = scheduler.update_from_output(batch, SamplerOutput([0, 9], [-1.0, -2.0],
                                                                 [None, None]), 3)
    assert finished == [stops] and stops.finish_reason == "stop"
    assert stops.block_table == [] and scheduler.running == [runs]
    assert runs.output_token_ids == [9] and runs.logprobs == [-2.0]
    assert runs.token_weight_versions == [3] and runs.weight_versions == (3, 3)


def test_a_step_scores_at_most_max_scored_tokens_prompt_positions():
    """Chunks that score prompt log-probs share MAX_SCORED_TOKENS a step (their logits are
    the step's largest tensors); a prompt that would score more waits for the next step,
    and the queue behind it with it (first come, first served)."""
    scheduler = Scheduler(SchedulerConfig(8, 4096, 2048, True),
                          BlockManager(num_blocks=512, block_size=16), {0}, lambda seq: None,
                          HeldSequences())
    scored = [make_seq(i, 700) for i in (1, 2)]
    for seq in scored:
        seq.sampling_params = SamplingParams(prompt_logprobs=1)
    plain = make_seq(3, 700)
    for seq in (*scored, plain):
        scheduler.add(seq)
    batch = scheduler.schedule()
    chunks = dict(zip((s.seq_id for s in batch.seqs), batch.num_new_tokens))
    assert chunks[1] == MAX_SCORED_TOKENS and 2 not in chunks  # the second scores next step
    assert batch.num_scored_tokens == MAX_SCORED_TOKENS
    assert scored[1] in scheduler.waiting and plain in scheduler.waiting  # behind it, in order


def test_a_recomputed_chunk_supersedes_every_chunk_recorded_from_its_start():
    # After a preemption (and perhaps a weight update) a sequence recomputes from position
    # 4 in chunks cut otherwise: nothing recorded from 4 on may survive.
    seq = Sequence(0, "r", 0, list(range(20)), 20, SamplingParams(return_routed_experts=True))
    seq.record_routing(0, b"a" * 8)
    seq.record_routing(8, b"b" * 12)
    seq.record_routing(4, b"c" * 16)
    assert seq.routed_experts == {0: b"a" * 8, 4: b"c" * 16}
    assert list(seq.routed_experts) == [0, 4]  # written in this order: the recompute last
