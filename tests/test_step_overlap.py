"""Overlapped steps (``async_scheduling``): the same outputs as steps that land at once.

Every scenario runs the same requests through two engines, overlap off and on, and
compares whole ``RequestOutput``s: tokens, log-probs, top log-probs, thresholds, finish and
stop reasons, weight versions, prompt log-probs. Seeded sampling (each request its own
generator) makes them comparable token for token. The overlapped engine really runs a step
ahead: it reads pending tokens on the device, runs stopped sequences one step more, and
still leaks no block.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.rollout import Continuation, EngineConfig, LLMEngine, SamplingParams
from tandem.rollout.structured_outputs import StructuredOutputsParams
from tandem.rollout.worker.model_runner import ModelRunner

from .test_weight_update import trainer_model

PROMPTS = [[5, 9, 33, 70, 2, 81, 100, 4, 17, 3, 44, 12, 200, 7, 8, 9, 10], [40, 41, 42],
           [(7 * i) % 250 + 5 for i in range(41)], [60, 61]]
# Frequent ids of the tiny model as stop tokens, so completions end at varied points by content.
STOPS = [17, 60, 101, 150, 230, 251, 275, 290]
Actions = dict[int, Callable[[LLMEngine], None]]


def params(seed: int, **kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, "seed": seed, "max_tokens": 24,
                             "logprobs": 2, "stop_token_ids": STOPS, **kwargs})


def run(folder, overlap: bool, requests: list[tuple[list[int], SamplingParams]],
        actions: Actions | None = None, **engine_args) -> tuple[LLMEngine, dict]:
    """Step an engine through ``requests`` to the end; ``actions[k]`` runs after step k."""
    engine = LLMEngine(EngineConfig(model=str(folder), async_scheduling=overlap,
                                    **engine_args))
    engine.add_requests([f"r{i}" for i in range(len(requests))],
                        [prompt for prompt, _ in requests], [p for _, p in requests])
    outputs, step = {}, 0
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o.to_dict()) for o in engine.step())
        step += 1
        (actions or {}).get(step, lambda _: None)(engine)
    assert engine.stats()["kv_blocks_used"] == 0, "a block leaked"
    return engine, outputs


def assert_same_both_ways(folder, requests, actions: Actions | None = None,
                          abs: float = 1e-5, **engine_args) -> tuple[LLMEngine, LLMEngine]:
    """Both ways give equal outputs: floats within ``abs`` (0: bitwise), the rest exactly.

    Bitwise where both ways run the same batches (every stop by length). A sequence that a
    token stops runs one more step overlapped, which widens that step's batch, and a CPU
    matrix multiply may round a row differently at another row count (a few 1e-7 here):
    the tokens stay equal.
    """
    landed, expected = run(folder, False, requests, actions, **engine_args)
    overlapped, got = run(folder, True, requests, actions, **engine_args)
    assert_close(got, expected, abs)
    return landed, overlapped


def assert_close(got, expected, abs: float, where: str = "") -> None:
    """``got == expected`` through dicts, lists and tuples, floats within ``abs``."""
    if isinstance(expected, float) and isinstance(got, float):
        assert got == pytest.approx(expected, abs=abs, rel=0), where
    elif isinstance(expected, dict) and isinstance(got, dict):
        assert got.keys() == expected.keys(), where
        for key in expected:
            assert_close(got[key], expected[key], abs, f"{where}/{key}")
    elif isinstance(expected, list | tuple) and isinstance(got, list | tuple):
        assert len(got) == len(expected), where
        for i, (a, b) in enumerate(zip(got, expected)):
            assert_close(a, b, abs, f"{where}[{i}]")
    else:
        assert got == expected, where


@pytest.fixture
def count_pending_reads(monkeypatch) -> list[int]:
    """The number of decodes each launch read from the last one's samples on the device."""
    counts: list[int] = []
    read = ModelRunner._read_pending_tokens

    def counted(self, batch, input_ids):
        counts.append(sum(bool(s.num_pending_tokens) for s in batch.seqs[:batch.num_decodes]))
        read(self, batch, input_ids)

    monkeypatch.setattr(ModelRunner, "_read_pending_tokens", counted)
    return counts


def test_groups_with_stops_equal_and_the_overlap_is_real(llama_dir, count_pending_reads):
    requests = [(PROMPTS[0], params(1, n=4, top_p=0.9)), (PROMPTS[1], params(2, min_tokens=3)),
                (PROMPTS[2], params(3, n=3, top_k=20, max_tokens=9)),
                (PROMPTS[3], params(4, stop=["e"], max_tokens=30))]
    landed, overlapped = assert_same_both_ways(llama_dir, requests)
    assert sum(count_pending_reads) > 0  # decodes read their tokens on the device
    # Sequences stopped by a token ran one step more there, their extra tokens dropped.
    assert overlapped.stats()["decoded_seqs"] > landed.stats()["decoded_seqs"]


def test_length_stops_are_not_run_past(llama_dir):
    requests = [(p, params(i, max_tokens=5 + i, stop_token_ids=[], ignore_eos=True))
                for i, p in enumerate(PROMPTS)]
    landed, overlapped = assert_same_both_ways(llama_dir, requests, abs=0.0, max_model_len=52)
    assert overlapped.stats()["decoded_seqs"] == landed.stats()["decoded_seqs"]


def test_preemption_equal(llama_dir):
    requests = [(p, params(i, n=3, max_tokens=40, stop_token_ids=[17, 101]))
                for i, p in enumerate(PROMPTS)]
    # (A sequence preempted at another step recomputes its K/V in a prefill, not decodes.)
    landed, overlapped = assert_same_both_ways(llama_dir, requests, num_kv_blocks=14,
                                               block_size=8, max_model_len=96)
    assert landed.stats()["preemptions"] > 0 and overlapped.stats()["preemptions"] > 0


def test_weight_update_mid_generation_equal(llama_dir):
    state = trainer_model(llama_dir, seed=6).state_dict()
    requests = [(p, params(i, n=2)) for i, p in enumerate(PROMPTS)]
    _, overlapped = assert_same_both_ways(
        llama_dir, requests, {4: lambda engine: engine.update_weights(state.items())})
    assert overlapped.weight_version == 1


def test_sleep_with_preemption_and_wake_equal(llama_dir):
    def sleep_and_wake(engine: LLMEngine) -> None:
        engine.sleep(1, preempt=True)
        engine.wake_up()

    requests = [(p, params(i, n=2, max_tokens=16)) for i, p in enumerate(PROMPTS)]
    assert_same_both_ways(llama_dir, requests, {3: sleep_and_wake, 9: sleep_and_wake})


def test_abort_mid_generation_drops_the_token_in_flight(llama_dir):
    requests = [(p, params(i, max_tokens=20, stop_token_ids=[])) for i, p in enumerate(PROMPTS)]
    aborted = {}

    def abort(engine: LLMEngine) -> None:
        aborted[engine.config.async_scheduling] = engine.abort_request("r1").to_dict()

    _, expected = run(llama_dir, False, requests, {5: abort})
    _, got = run(llama_dir, True, requests, {5: abort})
    assert_close(got, expected, 1e-5)  # the others are unaffected
    landed, overlapped = (aborted[key]["outputs"][0] for key in (False, True))
    assert len(landed["token_ids"]) == 5 and overlapped["finish_reason"] == "abort"
    assert overlapped["token_ids"] == landed["token_ids"][:4]  # the fifth was on the device


def test_prompt_logprobs_penalties_and_greedy_equal(llama_dir):
    requests = [(PROMPTS[0], params(1, prompt_logprobs=2)),
                (PROMPTS[1], params(2, repetition_penalty=1.3, frequency_penalty=0.5)),
                (PROMPTS[2], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=STOPS)),
                (PROMPTS[3], params(3, presence_penalty=1.0, n=2))]
    assert_same_both_ways(llama_dir, requests)


def test_structured_outputs_equal(llama_dir):
    spec = StructuredOutputsParams(regex="(ab|cd){2,6}e")
    requests = [(p, params(i, n=2, stop_token_ids=[], max_tokens=20, structured_outputs=spec))
                for i, p in enumerate(PROMPTS[:2])] + [(PROMPTS[2], params(9))]
    assert_same_both_ways(llama_dir, requests)


def test_held_continuations_equal(llama_dir):
    def both(overlap: bool) -> list:
        engine = LLMEngine(EngineConfig(model=str(llama_dir), async_scheduling=overlap))
        turns = []
        for turn, prompt in enumerate([PROMPTS[0], Continuation("t0", 0, [11, 12, 13]),
                                       Continuation("t0", 1, [99]),
                                       Continuation("t1", 0, [20, 21])]):
            engine.add_requests([f"t{turn}"], [prompt],
                                [params(turn, n=2 if turn == 0 else 1)], hold_kv=True)
            while engine.has_unfinished_requests():
                turns += [o.to_dict() for o in engine.step()]
        return turns

    assert_close(both(True), both(False), 1e-5)


@pytest.mark.parametrize("carried_kv", ["keep", "recompute"])
def test_partial_rollouts_carry_the_same_groups_either_way(llama_dir, carried_kv):
    """GRPO's partial rollouts: groups carried unfinished across an update (of the same
    values) and a recompute; every group sampled both ways holds the same completions."""
    from transformers import AutoTokenizer

    from tandem.rollout import LLM
    from tandem.trainers.config import RolloutConfig
    from tandem.trainers.groups import CompletionSource

    from .test_group_rollouts import ENGINE, examples, partial_collector, same_weights
    from .test_group_rollouts import spread_by_example as score

    def groups(overlap: bool) -> dict:
        llm = LLM(str(llama_dir), **ENGINE, async_scheduling=overlap)
        collector = partial_collector(CompletionSource(
            llm, AutoTokenizer.from_pretrained(llama_dir),
            RolloutConfig(num_generations=2, max_tokens=12), seed=0), 5)
        extras = iter(examples("ssss", start=50))
        collected = collector.collect(examples("ss"), lambda k: next(extras), score()).groups
        llm.update_weights(same_weights(llm))
        if carried_kv == "recompute":
            llm.engine.recompute_unfinished()
        collected += collector.collect(examples("ss", start=60), lambda k: next(extras),
                                       score()).groups
        collector.drop_carried()
        assert llm.stats()["kv_blocks_used"] == 0
        return {g.key: (g.completion_ids, g.sampler_logprobs) for g in collected}

    landed, overlapped = groups(False), groups(True)
    both = landed.keys() & overlapped.keys()
    assert len(both) >= 3  # (which groups finish by a step's end may differ by a step)
    assert_close({k: overlapped[k] for k in both}, {k: landed[k] for k in both}, 1e-5)


def test_bfloat16_equal_when_every_stop_is_by_length(llama_dir):
    """In bfloat16 a row's logits depend in their last bits on the batch around it, so the
    extra step of a token-stopped sequence may change others' tokens; length stops add
    none."""
    requests = [(p, params(i, n=2, max_tokens=8 + 3 * i, stop_token_ids=[], ignore_eos=True))
                for i, p in enumerate(PROMPTS)]
    assert_same_both_ways(llama_dir, requests, abs=0.0, dtype=torch.bfloat16)


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(st.sampled_from(PROMPTS), st.integers(1, 3), st.integers(1, 20),
                          st.lists(st.sampled_from(STOPS), max_size=4)), min_size=1, max_size=5),
       st.integers(6, 40))
def test_random_workloads_equal(llama_dir, requests, num_kv_blocks):
    built = [(prompt, params(i, n=n, max_tokens=max_tokens, stop_token_ids=stops))
             for i, (prompt, n, max_tokens, stops) in enumerate(requests)]
    assert_same_both_ways(llama_dir, built, num_kv_blocks=num_kv_blocks, block_size=8,
                          max_model_len=48)


def test_default_is_on_for_cuda_only():
    assert EngineConfig(model="m", device="cpu").overlaps_steps is False
    assert EngineConfig(model="m", device="cuda").overlaps_steps is True
    assert EngineConfig(model="m", device="cuda", async_scheduling=False).overlaps_steps is False
