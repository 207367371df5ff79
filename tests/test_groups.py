"""GRPO groups share their prompt's blocks; the prefix cache skips repeated prefixes."""

from __future__ import annotations

import pytest

from tandem.rollout import LLM, EngineConfig, LLMEngine, SamplingParams
from tandem.rollout.core.sequence import child_seed


def prompt_of(length: int, offset: int = 0) -> list[int]:
    return [(7 * i + offset) % 300 + 4 for i in range(length)]


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), seed=3)


def test_group_fork_shares_prompt_blocks_with_copy_on_write(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir)))
    engine.add_request("group", prompt_of(100), SamplingParams(n=8, max_tokens=4, seed=1))
    engine.step()  # the prompt's prefill, once; the eight children fork and sample
    stats = engine.stats()
    assert stats["num_running"] == 8 and stats["kv_blocks_used"] == 7
    engine.step()  # the first decode: seven children copy the partial block
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 6 + 8 and stats["cow_copies"] == 7


def test_group_children_equal_separate_requests_with_derived_seeds(llm):
    prompt = prompt_of(37)
    group = llm.generate([prompt], SamplingParams(n=8, max_tokens=20, seed=11, logprobs=0),
                         use_tqdm=False)[0]
    separate = llm.generate([prompt] * 8, [
        SamplingParams(max_tokens=20, seed=child_seed(11, i), logprobs=0) for i in range(8)],
        use_tqdm=False)
    assert [c.token_ids for c in group.outputs] == [s.outputs[0].token_ids for s in separate]
    for child, alone in zip(group.outputs, separate):
        assert child.logprobs == pytest.approx(alone.outputs[0].logprobs, abs=1e-5)
    assert len({tuple(c.token_ids) for c in group.outputs}) > 1


def test_group_of_block_aligned_prompt_needs_no_copies(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir)))
    engine.add_request("group", prompt_of(32), SamplingParams(n=4, max_tokens=3, seed=1))
    engine.step()
    engine.step()
    assert engine.stats()["kv_blocks_used"] == 2 + 4 and engine.stats()["cow_copies"] == 0


def test_group_that_only_fits_shared_never_preempts(llama_dir):
    llm = LLM(str(llama_dir), num_kv_blocks=16, max_model_len=128)
    outputs = llm.generate([prompt_of(100)], SamplingParams(n=8, max_tokens=12, seed=2,
                                                             ignore_eos=True), use_tqdm=False)
    assert all(len(c.token_ids) == 12 for c in outputs[0].outputs)
    assert llm.stats()["preemptions"] == 0 and llm.stats()["kv_blocks_used"] == 0


def test_second_request_hits_shared_prefix_and_computes_only_the_rest(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir)))
    shared = prompt_of(64)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("first", shared + prompt_of(10, 1), greedy)
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("second", shared + prompt_of(21, 2), greedy)
    engine.step()
    assert engine.stats()["prefix_cache_hit_tokens"] == 64
    assert engine.stats()["prefix_cache_queried_tokens"] == 2 * 64 + 10 + 21
    engine.abort_request("second")

    cached = LLM(str(llama_dir))
    uncached = LLM(str(llama_dir), enable_prefix_caching=False)
    prompts = [shared + prompt_of(10, 1), shared + prompt_of(21, 2)]
    with_cache = [o.outputs[0].token_ids for o in cached.generate(prompts[:1], greedy) +
                  cached.generate(prompts[1:], greedy)]
    without = [o.outputs[0].token_ids for o in uncached.generate(prompts, greedy)]
    assert with_cache == without
    assert cached.stats()["prefix_cache_hit_tokens"] == 64
    assert uncached.stats()["prefix_cache_hit_tokens"] == 0

    cached.reset_prefix_cache()
    cached.generate(prompts[1:], greedy)
    assert cached.stats()["prefix_cache_hit_tokens"] == 64  # cumulative: no new hits


def test_same_step_requests_hit_blocks_registered_in_that_step(llm):
    before = llm.stats()["prefix_cache_hit_tokens"]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [prompt_of(40, 5) + [9], prompt_of(40, 5) + [10]]
    outputs = llm.generate(prompts, greedy, use_tqdm=False)
    assert llm.stats()["prefix_cache_hit_tokens"] - before == 32
    alone = llm.generate([prompts[1]], greedy, use_tqdm=False)
    assert outputs[1].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_n_above_max_num_seqs_is_refused(llama_dir):
    llm = LLM(str(llama_dir), max_num_seqs=4)
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.generate([prompt_of(5)], SamplingParams(n=5), use_tqdm=False)
    assert len(llm.generate([prompt_of(5)], SamplingParams(n=4), use_tqdm=False)[0].outputs) == 4


def test_group_decodes_attend_their_shared_prompt_blocks_once(llama_dir, monkeypatch):
    """The scheduler hands the runner each request's decodes and the prompt blocks they
    share (the fork's full blocks, the same physical blocks), and generation is the same
    as each request alone. The torch backend's cascade is what asks for the groups."""
    engine = LLMEngine(EngineConfig(model=str(llama_dir), attention_backend="torch"))
    launch = engine.runner.launch
    seen = []

    def spy(batch, **kwargs):
        decodes = batch.seqs[:batch.num_decodes]
        seen.append([([decodes[r].request_id for r in g.members], g.num_shared_blocks,
                      [decodes[r].block_table[:g.num_shared_blocks] for r in g.members])
                     for g in batch.decode_groups])
        return launch(batch, **kwargs)

    monkeypatch.setattr(engine.runner, "launch", spy)
    group, alone = SamplingParams(n=4, max_tokens=30, seed=1), SamplingParams(max_tokens=30,
                                                                                seed=1)
    engine.add_request("group", prompt_of(40), group)
    engine.add_request("alone", prompt_of(40, 1), alone)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs |= {o.request_id: o for o in engine.step()}
    full = next(groups for groups in seen if sum(len(g[0]) for g in groups) == 5)
    (ids, num_shared, tables), (alone_ids, alone_shared, _) = full
    assert ids == ["group"] * 4 and num_shared == 40 // 16 and alone_ids == ["alone"]
    assert all(table == tables[0] for table in tables) and alone_shared == 0
    assert engine.stats()["kv_blocks_used"] == 0
    llm = LLM(str(llama_dir), attention_backend="torch")
    for request_id, prompt, params in (("group", prompt_of(40), group),
                                       ("alone", prompt_of(40, 1), alone)):
        reference = llm.generate([prompt], params, use_tqdm=False)[0]
        assert [c.token_ids for c in outputs[request_id].outputs] == [
            c.token_ids for c in reference.outputs]
