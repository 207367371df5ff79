"""A hypothesis fuzz of the engine's API: random, partly invalid sampling parameters and
prompts, duplicate ids, aborts, held completions and their continuations, sleep and steps,
against one small engine whose pool preempts.

Bad input may raise ``ValueError`` only (and ``EngineAsleepError`` while asleep), and after
every call the KV pool's accounting is exact: each block's reference count equals the
sequences (running, waiting, held) whose block tables hold it. When every request has ended
the pool is whole again.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tandem.rollout import Continuation, EngineAsleepError, EngineConfig, LLMEngine, SamplingParams

NAN, INF = math.nan, math.inf
VALID = {
    "n": [1, 2, 3],
    "temperature": [0.0, 0.7, 1.0],
    "top_p": [1.0, 0.9],
    "top_k": [0, -1, 5],
    "min_p": [0.0, 0.1],
    "repetition_penalty": [1.0, 1.3],
    "presence_penalty": [0.0, 0.5],
    "frequency_penalty": [0.0, -0.5],
    "max_tokens": [1, 3, 8, 40],
    "min_tokens": [0, 1],
    "stop": [[], ["a"], "x"],
    "stop_token_ids": [[], [3]],
    "ignore_eos": [False, True],
    "logprobs": [None, 0, 2],
    "prompt_logprobs": [None, 0, 1],
}
INVALID = [("n", 0), ("n", -1), ("temperature", -0.5), ("temperature", NAN),
           ("top_p", 0.0), ("top_p", 1.5), ("top_p", NAN), ("top_k", -3), ("min_p", 1.1),
           ("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("presence_penalty", NAN),
           ("frequency_penalty", -3.0), ("max_tokens", 0), ("max_tokens", -1),
           ("min_tokens", -1), ("min_tokens", 100), ("stop", [""]), ("stop", [1]),
           ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]), ("logprobs", -1),
           ("prompt_logprobs", -2), ("temperature", INF)]
# Valid values, and a quarter of the time one invalid field among them. Always seeded, so
# a replayed example samples the same tokens (hypothesis needs the same run to shrink).
SAMPLING = st.builds(
    lambda valid, invalid: {**valid, **dict([invalid] if invalid else [])},
    st.fixed_dictionaries({"seed": st.integers(0, 7)}, optional={
        name: st.sampled_from(values) for name, values in VALID.items()}),
    st.one_of(st.none(), st.none(), st.none(), st.sampled_from(INVALID)))
PROMPTS = st.one_of(
    st.lists(st.integers(0, 255), min_size=1, max_size=40),  # up to five blocks of 8
    st.sampled_from(["Hello world", "What is 2+3?", "", " "]),
    st.sampled_from([[], [-1], [10_000], [True, False], [1.5], [None], [[1, 2]], None, 3,
                     [5] * 70]))
REQUEST_IDS = st.sampled_from(["a", "b", "c", "d"])


class EngineMachine(RuleBasedStateMachine):
    """Random calls on a fresh engine of ``config`` (set by the test) per example."""

    config: EngineConfig

    def __init__(self) -> None:
        super().__init__()
        self.engine = LLMEngine(self.config)

    def params(self, kwargs: dict) -> SamplingParams | None:
        """The sampling parameters, or None when their values are refused (ValueError)."""
        try:
            return SamplingParams(**kwargs)
        except ValueError:
            return None

    def add(self, request_ids: list[str], prompts: list, kwargs: dict, hold: bool) -> None:
        params = self.params(kwargs)
        if params is None:
            return
        try:
            self.engine.add_requests(request_ids, prompts, [params] * len(request_ids), hold)
        except (ValueError, EngineAsleepError):
            return

    @rule(request_id=REQUEST_IDS, prompt=PROMPTS, kwargs=SAMPLING, hold=st.booleans())
    def add_request(self, request_id: str, prompt: object, kwargs: dict, hold: bool) -> None:
        self.add([request_id], [prompt], kwargs, hold)

    @rule(request_ids=st.lists(REQUEST_IDS, max_size=3), prompts=st.lists(PROMPTS, max_size=3),
          kwargs=SAMPLING)
    def add_several(self, request_ids: list[str], prompts: list, kwargs: dict) -> None:
        self.add(request_ids, prompts, kwargs, False)

    @rule(request_id=REQUEST_IDS)
    def abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)

    @precondition(lambda self: self.engine.has_unfinished_requests())
    @rule(steps=st.integers(1, 12))
    def step(self, steps: int) -> None:
        for _ in range(steps):
            for output in self.engine.step():
                self.check_output(output)

    @precondition(lambda self: self.engine.has_unfinished_requests())
    @rule()
    def run_to_end(self) -> None:
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                self.check_output(output)

    def check_output(self, output) -> None:
        for completion in output.outputs:
            assert completion.finish_reason in ("stop", "length", "abort")
            assert len(completion.token_ids) <= self.engine.config.max_model_len

    @rule(request_id=REQUEST_IDS, index=st.integers(0, 2), tokens=st.lists(
        st.integers(0, 255), max_size=6), kwargs=SAMPLING)
    def continue_held(self, request_id: str, index: int, tokens: list[int], kwargs: dict) -> None:
        self.add([f"{request_id}-next"], [Continuation(request_id, index, tokens)], kwargs, True)

    @rule(request_id=REQUEST_IDS, index=st.integers(0, 2))
    def release(self, request_id: str, index: int) -> None:
        try:
            self.engine.release(request_id, index)
        except ValueError:
            return

    @rule(preempt=st.booleans(), kv_only=st.booleans())
    def sleep_and_wake(self, preempt: bool, kv_only: bool) -> None:
        try:
            if kv_only:
                self.engine.release_kv_cache_memory(preempt=preempt)
            else:
                self.engine.sleep(1, preempt=preempt)
        except (ValueError, RuntimeError) as exc:  # sleep with requests in flight is refused
            assert "sleep" in str(exc)
            return
        self.engine.wake_up()

    @rule()
    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    @invariant()
    def reference_counts_equal_holders(self) -> None:
        scheduler, manager = self.engine.scheduler, self.engine.block_manager
        holders = [0] * manager.num_blocks
        for seq in [*scheduler.running, *scheduler.waiting, *self.engine.held.seqs.values()]:
            for block_id in seq.block_table:
                holders[block_id] += 1
        assert [block.ref_count for block in manager.blocks] == holders
        assert manager.num_free_blocks == holders.count(0)

    def teardown(self) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
        for request_id, index in list(self.engine.held.seqs):
            self.engine.release(request_id, index)
        stats = self.engine.stats()
        assert stats["kv_blocks_used"] == 0 and not self.engine.has_unfinished_requests()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_api_fuzz(llama_dir, async_scheduling):
    class OnThisModel(EngineMachine):
        config = EngineConfig(model=str(llama_dir), block_size=8, num_kv_blocks=10,
                              max_model_len=64, max_num_seqs=6,
                              async_scheduling=async_scheduling)

    run_state_machine_as_test(OnThisModel, settings=settings(
        max_examples=40, stateful_step_count=25, deadline=None))
