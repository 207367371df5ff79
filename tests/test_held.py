"""Held completions (``hold_kv``) continued token in, token out: only the new tokens are
computed, the result equals a fresh engine prefilling the whole conversation (with an FP8
pool too), and held KV
gives way under memory pressure and across weight updates without leaking a block."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tandem.rollout import LLM, Continuation, EngineConfig, LLMEngine, SamplingParams

from .conftest import save_model


@functools.cache
def machine_model_dir() -> Path:
    """The tiny Llama for the state machine (hypothesis cannot take pytest's fixtures)."""
    return save_model("llama", Path(tempfile.mkdtemp()) / "llama")

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
PROMPT = [(7 * i) % 250 + 5 for i in range(37)]
ENV_TURNS = [[11, 12, 13], [20 + i for i in range(19)], [99]]


@pytest.fixture(scope="module")
def reference(llama_dir) -> LLM:
    return LLM(str(llama_dir), enable_prefix_caching=False)


def expected(reference: LLM, token_ids: list[int], params=GREEDY):
    return reference.generate([token_ids], params, use_tqdm=False)[0].outputs


def prefill_tokens(llm: LLM) -> int:
    return llm.stats()["prefill_tokens"]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_each_turn_computes_only_its_new_tokens_and_equals_a_fresh_prefill(llama_dir,
                                                                           kv_cache_dtype):
    llm = LLM(str(llama_dir), kv_cache_dtype=kv_cache_dtype)
    reference = LLM(str(llama_dir), enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    output = llm.generate([PROMPT], GREEDY, use_tqdm=False, hold_kv=True)[0]
    conversation = PROMPT + output.outputs[0].token_ids
    assert llm.stats()["held_sequences"] == 1 and llm.stats()["kv_blocks_used"] > 0
    for env in ENV_TURNS:
        before = prefill_tokens(llm)
        output = llm.generate(Continuation(output.request_id, 0, env), GREEDY,
                              use_tqdm=False, hold_kv=True)[0]
        # the new tokens and the previous turn's last sampled token, never the history
        assert prefill_tokens(llm) - before == len(env) + 1
        conversation += env
        assert output.prompt_token_ids == conversation
        completion, = expected(reference, conversation)
        assert output.outputs[0].token_ids == completion.token_ids
        assert output.outputs[0].logprobs == pytest.approx(completion.logprobs, abs=1e-5)
        conversation += completion.token_ids
    llm.release(output.request_id)
    assert llm.stats()["kv_blocks_used"] == 0 and llm.stats()["held_sequences"] == 0


def test_a_group_forks_once_then_each_member_continues_on_its_own(llama_dir, reference):
    llm = LLM(str(llama_dir))
    sampled = SamplingParams(n=4, max_tokens=6, seed=3, ignore_eos=True)
    first = llm.generate([PROMPT], sampled, use_tqdm=False, hold_kv=True)[0]
    assert llm.stats()["cow_copies"] == 3
    continuations = [Continuation(first.request_id, c.index, [40 + c.index, 41])
                     for c in first.outputs]
    outputs = llm.generate(continuations, GREEDY, use_tqdm=False)
    for completion, output, continuation in zip(first.outputs, outputs, continuations):
        history = PROMPT + completion.token_ids + continuation.token_ids
        assert output.outputs[0].token_ids == expected(reference, history)[0].token_ids
    assert llm.stats()["kv_blocks_used"] == 0  # continued without hold_kv: all freed


def test_memory_pressure_releases_held_kv_before_preempting(llama_dir, reference):
    llm = LLM(str(llama_dir), num_kv_blocks=16, max_model_len=256)
    params = SamplingParams(n=4, max_tokens=12, seed=1, ignore_eos=True)
    held = llm.generate([PROMPT], params, use_tqdm=False, hold_kv=True)[0]
    used_by_held = llm.stats()["kv_blocks_used"]
    assert used_by_held > 16 - 13  # the big request below (13 blocks) cannot fit beside it
    big = llm.generate([list(range(3, 3 + 200))], SamplingParams(max_tokens=8),
                       use_tqdm=False)
    assert len(big[0].outputs[0].token_ids) == 8 and llm.stats()["preemptions"] == 0
    assert llm.stats()["held_sequences"] == 4
    assert llm.stats()["kv_blocks_used"] < used_by_held  # the oldest gave their blocks
    before = prefill_tokens(llm)
    outputs = llm.generate([Continuation(held.request_id, i, [77]) for i in range(4)],
                           GREEDY, use_tqdm=False)
    assert prefill_tokens(llm) - before > 4 * 2  # some recomputed their history
    for completion, output in zip(held.outputs, outputs):
        history = PROMPT + completion.token_ids + [77]
        assert output.outputs[0].token_ids == expected(reference, history)[0].token_ids
    assert llm.stats()["kv_blocks_used"] == 0


def test_a_weight_update_releases_held_kv_so_continuations_recompute(llama_dir, reference):
    llm = LLM(str(llama_dir))
    output = llm.generate([PROMPT], GREEDY, use_tqdm=False, hold_kv=True)[0]
    llm.update_weights(llm.engine.weight_parameters().items())  # same values, new version
    assert llm.stats()["kv_blocks_used"] == 0 and llm.stats()["held_sequences"] == 1
    before = prefill_tokens(llm)
    history = PROMPT + output.outputs[0].token_ids + [5, 6]
    again = llm.generate(Continuation(output.request_id, 0, [5, 6]), GREEDY, use_tqdm=False)
    assert prefill_tokens(llm) - before == len(history)  # no KV of the old version served
    assert again[0].outputs[0].token_ids == expected(reference, history)[0].token_ids


def test_bad_continuations_are_refused_and_leak_nothing(llama_dir):
    llm = LLM(str(llama_dir), max_model_len=64)
    output = llm.generate([PROMPT], GREEDY, use_tqdm=False, hold_kv=True)[0]
    held_blocks = llm.stats()["kv_blocks_used"]
    with pytest.raises(ValueError, match="no held completion 1"):
        llm.generate(Continuation(output.request_id, 1, [5]), GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(Continuation(output.request_id, 0, [5] * 30), GREEDY, use_tqdm=False)
    twice = [Continuation(output.request_id, 0, [5]), Continuation(output.request_id, 0, [6])]
    with pytest.raises(ValueError, match="twice"):
        llm.generate(twice, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="no held completion"):
        llm.release("nothing")
    assert llm.stats()["kv_blocks_used"] == held_blocks  # nothing queued, nothing lost
    engine = llm.engine
    engine.add_request("turn-2", Continuation(output.request_id, 0, [5]), GREEDY)
    with pytest.raises(ValueError, match="being continued"):
        llm.release(output.request_id)
    engine.abort_request("turn-2")  # before it was admitted: the held blocks go too
    assert llm.stats()["kv_blocks_used"] == 0 and llm.stats()["held_sequences"] == 0


def test_a_growing_decode_takes_held_blocks_before_preempting_anything(llama_dir):
    llm = LLM(str(llama_dir), num_kv_blocks=16, max_model_len=256)
    llm.generate([PROMPT], SamplingParams(n=4, max_tokens=12, seed=1, ignore_eos=True),
                 use_tqdm=False, hold_kv=True)
    assert llm.stats()["kv_blocks_used"] == 6
    # Admitted beside the held blocks (7 of 10 free), it grows to 13 blocks while decoding.
    long = llm.generate([list(range(3, 103))], SamplingParams(max_tokens=100, ignore_eos=True),
                        use_tqdm=False)
    assert len(long[0].outputs[0].token_ids) == 100 and llm.stats()["preemptions"] == 0
    assert llm.stats()["kv_blocks_used"] < 6 and llm.stats()["held_sequences"] == 4


class HeldEpisodesMachine(RuleBasedStateMachine):
    """Episodes held, continued, released and aborted at random on a pool small enough to
    force releases and preemptions: the engine always finishes what it accepted, and once
    everything is released the pool is whole again."""

    async_scheduling = False

    def __init__(self) -> None:
        super().__init__()
        self.llm = LLM(str(machine_model_dir()), num_kv_blocks=12, max_model_len=96,
                       max_num_seqs=8, async_scheduling=self.async_scheduling)
        self.engine = self.llm.engine
        self.held: list[tuple[str, int]] = []
        self.next_id = 0

    def run(self, prompts: list, params: SamplingParams, hold: bool) -> None:
        ids = [f"r{self.next_id + i}" for i in range(len(prompts))]
        self.next_id += len(prompts)
        self.engine.add_requests(ids, prompts, [params] * len(prompts), hold_kv=hold)
        for _ in range(2000):
            if not self.engine.has_unfinished_requests():
                break
            for output in self.engine.step():
                if hold:
                    self.held += [(output.request_id, c.index) for c in output.outputs]
        assert not self.engine.has_unfinished_requests(), "the engine stalled"

    @rule(length=st.integers(1, 40), n=st.integers(1, 3), max_tokens=st.integers(1, 12),
          hold=st.booleans())
    def generate(self, length: int, n: int, max_tokens: int, hold: bool) -> None:
        params = SamplingParams(n=n, max_tokens=max_tokens, seed=length, ignore_eos=True)
        self.run([list(range(3, 3 + length))], params, hold)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), env=st.lists(st.integers(3, 200), min_size=1, max_size=10),
          hold=st.booleans())
    def continue_one(self, data: st.DataObject, env: list[int], hold: bool) -> None:
        key = data.draw(st.sampled_from(self.held))
        self.held.remove(key)
        try:
            self.run([Continuation(*key, env)], SamplingParams(max_tokens=4, seed=1), hold)
        except ValueError:  # too long for max_model_len: refused, still held
            self.held.append(key)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(self.held))
        self.held.remove(key)
        self.llm.release(*key)

    @invariant()
    def held_count_matches(self) -> None:
        assert self.llm.stats()["held_sequences"] == len(self.held)

    def teardown(self) -> None:
        for key in self.held:
            self.llm.release(*key)
        assert self.llm.stats()["kv_blocks_used"] == 0


TestHeldEpisodes = HeldEpisodesMachine.TestCase
TestHeldEpisodes.settings = settings(max_examples=15, stateful_step_count=20, deadline=None)


class OverlappedHeldEpisodesMachine(HeldEpisodesMachine):
    """The same, with overlapped steps (``async_scheduling``)."""

    async_scheduling = True


TestOverlappedHeldEpisodes = OverlappedHeldEpisodesMachine.TestCase
TestOverlappedHeldEpisodes.settings = TestHeldEpisodes.settings


def test_a_new_held_request_under_an_id_that_still_holds_is_refused(llama_dir):
    """Found by the engine fuzz: the new completion replaced the held one under the same
    key, and the old one's blocks leaked."""
    engine = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=16, max_model_len=128))
    engine.add_request("a", PROMPT, GREEDY, hold_kv=True)
    while engine.has_unfinished_requests():
        engine.step()
    with pytest.raises(ValueError, match="still holds completions"):
        engine.add_request("a", PROMPT, GREEDY, hold_kv=True)
    engine.release("a")
    engine.add_request("a", PROMPT, GREEDY, hold_kv=True)
    while engine.has_unfinished_requests():
        engine.step()
    engine.release("a")
    assert engine.stats()["kv_blocks_used"] == 0


def test_add_requests_refuses_lists_of_different_lengths(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=16, max_model_len=128))
    with pytest.raises(ValueError, match="one of each per request"):
        engine.add_requests(["a", "b"], [PROMPT], [GREEDY, GREEDY])
    assert not engine.has_unfinished_requests()
