"""Groups as they finish (``LLM.generate_as_completed``, ``collect_groups``) and dynamic
sampling, for single-turn completions and for episodes alike."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch
from transformers import AutoTokenizer

from tandem.rollout import LLM, SamplingParams
from tandem.trainers.config import (
    DynamicSamplingConfig,
    LoggingConfig,
    OptimConfig,
    PartialRolloutConfig,
    RolloutConfig,
    TrainConfig,
    load_config,
)
from tandem.trainers.environments import EnvStep
from tandem.trainers.groups import CompletionSource, EpisodeSource, GroupCollector
from tandem.trainers.tasks import Task
from tandem.trainers.trainer import Trainer

# A small token budget chunks the longer prompts' prefills over several steps, so groups
# finish at different steps.
ENGINE = {"num_kv_blocks": 128, "max_model_len": 256, "max_num_batched_tokens": 32}


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), **ENGINE)


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


def test_generate_as_completed_yields_in_finish_order_what_generate_returns(llm):
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    params = [SamplingParams(max_tokens=m, seed=i, ignore_eos=True)
              for i, m in enumerate((12, 2, 6))]
    expected = llm.generate(prompts, params, use_tqdm=False)
    outputs = list(llm.generate_as_completed(prompts, params))
    assert [len(o.outputs[0].token_ids) for o in outputs] == [2, 6, 12]
    by_prompt = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in outputs}
    assert [by_prompt[tuple(p)] for p in prompts] == [e.outputs[0].token_ids for e in expected]


def test_closing_generate_as_completed_early_aborts_the_rest(llm):
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (1, 40)]
    iterator = llm.generate_as_completed([[5, 6], [7, 8]], params)
    first = next(iterator)
    assert len(first.outputs[0].token_ids) == 1
    iterator.close()
    assert not llm.engine.has_unfinished_requests() and llm.stats()["kv_blocks_used"] == 0


def spread_by_example(llm: LLM | None = None, log: list | None = None, delay: float = 0.0):
    """A scorer: rewards 0, 1, 0, 1, ... when the example says ``spread``, else all 0; with
    ``log``, it records whether other requests were still generating at each call."""
    def score(group) -> None:
        time.sleep(delay)
        if log is not None:
            log.append((group.key, llm.engine.has_unfinished_requests()))
        n = len(group.completions)
        values = torch.tensor([float(i % 2) if group.example["spread"] else 0.0
                               for i in range(n)])
        group.rewards, group.per_function = values, {"spread": values}
    return score


class Echo:
    """An environment answering every turn with one tool message; done after two."""

    def __init__(self) -> None:
        self.turns = 0

    def reset(self, example):
        return [{"role": "user", "content": example["prompt"]}]

    def step(self, messages):
        self.turns += 1
        return EnvStep([{"role": "tool", "content": f"ok {self.turns}"}], done=self.turns >= 2)


def make_source(kind: str, llm: LLM, tokenizer, **rollout):
    config = RolloutConfig(num_generations=4, max_tokens=6, max_turns=2, **rollout)
    if kind == "completions":
        return CompletionSource(llm, tokenizer, config, seed=0)
    return EpisodeSource(llm, tokenizer, config, seed=0, make_environment=lambda _: Echo())


def collect_once(source, step_examples, extra_example, score, dynamic):
    return GroupCollector(source, dynamic).collect(step_examples, extra_example, score)


def examples(pattern: str, start: int = 0) -> list[dict]:
    """One example per letter (``s``: its rewards spread, ``f``: flat); later ones longer."""
    return [{"prompt": f"What is {start + i}+3? " + "The quick brown fox. " * (6 * i),
             "spread": c == "s"} for i, c in enumerate(pattern)]


@pytest.mark.parametrize("kind", ["completions", "episodes"])
def test_groups_are_scored_as_they_finish_while_others_generate(llm, tokenizer, kind):
    source = make_source(kind, llm, tokenizer)
    log: list = []
    collected = collect_once(source, examples("ssss"), lambda k: examples("s", 10)[0],
                               spread_by_example(llm, log, delay=0.01),
                               DynamicSamplingConfig())
    assert [g.key for g in collected.groups] == [0, 1, 2, 3]
    assert log[0][1], "the first group was scored only after every group had finished"
    assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("kind", ["completions", "episodes"])
def test_dynamic_sampling_replaces_groups_whose_rewards_do_not_spread(llm, tokenizer, kind):
    source = make_source(kind, llm, tokenizer)
    extras = examples("fss", start=20)
    collected = collect_once(source, examples("sfsf"), lambda k: extras[k],
                               spread_by_example(), DynamicSamplingConfig(enabled=True))
    assert len(collected.groups) == 4 and all(g.has_spread for g in collected.groups)
    assert collected.metrics["groups_sampled"] == 7  # 4, then one extra per flat group
    assert collected.metrics["groups_dropped"] == 3
    assert collected.metrics["groups_zero_spread_kept"] == 0
    assert collected.metrics["dynamic_sampling_cap_reached"] == 0
    assert llm.stats()["kv_blocks_used"] == 0


def test_reaching_the_cap_trains_on_what_it_has_and_says_so(llm, tokenizer):
    source = make_source("completions", llm, tokenizer)
    collected = collect_once(source, examples("sfff"), lambda k: examples("f", 30 + k)[0],
                               spread_by_example(),
                               DynamicSamplingConfig(enabled=True, max_extra_prompts=2))
    metrics = collected.metrics
    assert metrics["groups_sampled"] == 6 and metrics["dynamic_sampling_cap_reached"] == 1
    assert len(collected.groups) == 4 and metrics["groups_zero_spread_kept"] == 3


def test_keep_mode_trains_on_every_group_sampled(llm, tokenizer):
    source = make_source("completions", llm, tokenizer)
    collected = collect_once(source, examples("sf"), lambda k: examples("s", 40 + k)[0],
                               spread_by_example(),
                               DynamicSamplingConfig(enabled=True, zero_spread="keep"))
    assert [g.key for g in collected.groups] == [0, 1, 2]
    assert collected.metrics["groups_zero_spread_kept"] == 1


@pytest.mark.parametrize(("override", "message"), [
    ("rollout.dynamic_sampling.max_extra_prompts=0", "max_extra_prompts=0 is invalid"),
    ("rollout.dynamic_sampling.zero_spread=skip", "zero_spread"),
    ("rollout.dynamic_sampling.filter=true", "unknown field(s) rollout.dynamic_sampling.filter"),
])
def test_bad_dynamic_sampling_options_are_refused_naming_the_field(override, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, [override])


def test_dynamic_sampling_is_refused_for_ppo():
    with pytest.raises(ValueError, match="dynamic_sampling is for GRPO"):
        load_config(None, ["algorithm=ppo", "rollout.dynamic_sampling.enabled=true"])


def train_config(llama_dir, tmp_path, steps: int, prompts_per_step: int = 2,
                 **rollout) -> TrainConfig:
    """A tiny run: groups of 2 on the shared engine settings, no W&B or progress bar."""
    return TrainConfig(
        model=str(llama_dir), steps=steps, output_dir=str(tmp_path),
        rollout=RolloutConfig(prompts_per_step=prompts_per_step, num_generations=2,
                              engine=ENGINE, **rollout),
        optim=OptimConfig(lr=1e-3), logging=LoggingConfig(wandb=False, progress_bar=False))


def first_token_even(completion_ids, **_) -> list[float]:
    """1 when the completion's first token id is even: often all or none of a small group."""
    return [float(bool(ids) and ids[0] % 2 == 0) for ids in completion_ids]


def test_a_trainer_step_with_dynamic_sampling_trains_only_groups_that_spread(llama_dir,
                                                                             tmp_path):
    task = Task(lambda seed, index: {"prompt": f"Count {index}: one two"}, [],
                {"even": first_token_even}, [("even", 1.0)])
    config = train_config(llama_dir, tmp_path, 2, prompts_per_step=4, max_tokens=3,
                          dynamic_sampling=DynamicSamplingConfig(enabled=True,
                                                                 max_extra_prompts=12))
    trainer = Trainer(config, task=task)
    for metrics in (trainer.train_step(), trainer.train_step()):
        assert metrics["groups_kept"] == 4
        assert metrics["groups_sampled"] == 4 + metrics["groups_dropped"]
        if not metrics["dynamic_sampling_cap_reached"]:
            assert metrics["groups_zero_spread_kept"] == 0 and metrics["reward_std"] > 0
    assert trainer.llm.stats()["kv_blocks_used"] == 0


def same_weights(llm: LLM) -> list:
    return [(name, tensor.clone()) for name, tensor in llm.engine.weight_parameters().items()]


def partial_collector(source, max_staleness: int) -> GroupCollector:
    """A collector over-provisioning 2 groups and carrying the unfinished ones."""
    return GroupCollector(source, DynamicSamplingConfig(), PartialRolloutConfig(
        enabled=True, over_provision=2, max_staleness=max_staleness))


@pytest.mark.parametrize("carried_kv", ["keep", "recompute"])
def test_partial_rollouts_carry_unfinished_groups_through_an_update(llama_dir, tokenizer,
                                                                    carried_kv):
    llm = LLM(str(llama_dir), **ENGINE)
    collector = partial_collector(CompletionSource(
        llm, tokenizer, RolloutConfig(num_generations=2, max_tokens=12), seed=0), 5)
    extras = iter(examples("ssss", start=50))
    first = collector.collect(examples("ss"), lambda k: next(extras), spread_by_example())
    assert len(first.groups) == 2 and llm.engine.has_unfinished_requests()
    assert llm.stats()["kv_blocks_used"] > 0  # paused with their KV
    llm.update_weights(same_weights(llm))
    if carried_kv == "recompute":
        llm.engine.recompute_unfinished()
        assert llm.stats()["kv_blocks_used"] == 0 and llm.stats()["num_running"] == 0
    second = collector.collect(examples("ss", start=60), lambda k: next(extras),
                               spread_by_example())
    keys = [g.key for g in second.groups]
    assert keys == sorted(keys) and keys[0] < 4  # a carried group of the first step first
    versions = [v for g in second.groups for row in g.token_weight_versions for v in row]
    assert set(versions) == {0, 1}  # carried tokens of version 0, then version 1
    collector.drop_carried()
    assert not llm.engine.has_unfinished_requests() and llm.stats()["kv_blocks_used"] == 0
    collector.collect(examples("ss", start=90), lambda k: next(extras), spread_by_example())
    assert llm.engine.has_unfinished_requests()  # after a checkpoint it over-provisions again
    collector.drop_carried()


def test_a_group_older_than_max_staleness_restarts_from_its_prompt(llama_dir, tokenizer):
    llm = LLM(str(llama_dir), **ENGINE)
    collector = partial_collector(CompletionSource(
        llm, tokenizer, RolloutConfig(num_generations=2, max_tokens=12), seed=0), 0)
    extras = iter(examples("ssss", start=70))
    collector.collect(examples("ss"), lambda k: next(extras), spread_by_example())
    llm.update_weights(same_weights(llm))
    second = collector.collect(examples("ss", start=80), lambda k: next(extras),
                               spread_by_example())
    assert second.metrics["partial_restarted_groups"] >= 1
    unfinished_before = {g.key for g in second.groups if g.key >= 2}
    for group in second.groups:
        if group.key in unfinished_before:  # restarted, or admitted after the update
            assert {v for row in group.token_weight_versions for v in row} == {1}
    collector.drop_carried()


def test_a_finished_group_carried_past_max_staleness_restarts_from_its_prompt(llama_dir,
                                                                            tokenizer):
    llm = LLM(str(llama_dir), **ENGINE)
    collector = partial_collector(CompletionSource(
        llm, tokenizer, RolloutConfig(num_generations=2, max_tokens=1), seed=0), 0)
    def short(k: int) -> dict:
        return {"prompt": f"What is {k}+4? ", "spread": True}

    first = collector.collect([short(0)], short, spread_by_example())
    # All three finish in the same step: one trained, two carried as they are.
    assert len(first.groups) == 1 and not llm.engine.has_unfinished_requests()
    llm.update_weights(same_weights(llm))
    second = collector.collect([short(9)], short, spread_by_example())
    assert second.metrics["partial_restarted_groups"] == 2
    assert {v for g in second.groups for row in g.token_weight_versions for v in row} == {1}
    collector.drop_carried()


def test_sleep_with_preempt_keeps_unfinished_requests_and_they_finish_after_wake(llama_dir):
    llm = LLM(str(llama_dir), **ENGINE)
    llm.engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
    llm.engine.step()
    with pytest.raises(ValueError, match="preempt=True"):
        llm.sleep(1)
    llm.sleep(1, preempt=True)
    assert llm.stats()["kv_cache_bytes"] == 0
    llm.wake_up()
    finished = []
    while llm.engine.has_unfinished_requests():
        finished += llm.engine.step()
    assert len(finished[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize(("overrides", "message"), [
    (["rollout.partial.max_staleness=-1"], "max_staleness=-1 is invalid"),
    (["rollout.partial.carried_kv=reuse"], "carried_kv"),
    (["rollout.partial.enabled=true", "sync_alias=true"], "sync_alias"),
])
def test_bad_partial_rollout_options_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, overrides)


def test_partial_training_steps_log_staleness_and_leave_the_pool_empty(llama_dir, tmp_path):
    task = Task(lambda seed, index: {"prompt": "Count: " + "one two " * (index % 5)}, [],
                {"even": first_token_even}, [("even", 1.0)])
    config = train_config(llama_dir, tmp_path, 3, max_tokens=6,
                          partial=PartialRolloutConfig(enabled=True))
    trainer = Trainer(config, task=task)
    history = trainer.train()["history"]
    assert all(0 <= m["staleness_mean"] <= 1 and "partial_restarted_groups" in m
               for m in history)
    assert not trainer.llm.engine.has_unfinished_requests()
    assert trainer.llm.stats()["kv_blocks_used"] == 0


def test_partial_rollouts_carry_episode_groups_and_restart_stale_ones(llama_dir, tokenizer):
    llm = LLM(str(llama_dir), **ENGINE)
    source = make_source("episodes", llm, tokenizer)
    collector = partial_collector(source, 0)
    extras = iter(examples("ssss", start=50)[2:] + examples("ss", start=70))
    first = collector.collect(examples("ss"), lambda k: next(extras), spread_by_example())
    assert len(first.groups) == 2 and source.has_unfinished_groups()
    llm.update_weights(same_weights(llm))
    second = collector.collect(examples("ss", start=60), lambda k: next(extras),
                               spread_by_example())
    assert second.metrics["partial_restarted_groups"] >= 1 and len(second.groups) == 2
    finished_before = {group.key for group in first.sampled}
    for group in second.groups:  # unfinished at the update: restarted if they held v0
        if group.key not in finished_before:
            assert {v for row in group.token_weight_versions for v in row} == {1}
    collector.drop_carried()
    assert not source.has_unfinished_groups() and llm.stats()["kv_blocks_used"] == 0
    assert llm.stats()["held_sequences"] == 0


def test_partial_training_on_episodes_ends_with_nothing_held(llama_dir, tmp_path):
    task = Task(lambda seed, index: {"prompt": "Count: " + "one two " * (index % 5)}, [],
                {"even": first_token_even}, [("even", 1.0)], lambda example: Echo())
    config = train_config(llama_dir, tmp_path, 2, max_tokens=4, max_turns=2,
                          partial=PartialRolloutConfig(enabled=True))
    trainer = Trainer(config, task=task)
    history = trainer.train()["history"]
    assert all("staleness_mean" in m and m["episode_turns"] >= 1 for m in history)
    stats = trainer.llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["held_sequences"] == 0


def test_evaluation_mid_run_with_partial_rollouts_scores_exactly_the_held_out_prompts(
        llama_dir, tmp_path):
    """Found by the partial-rewards benchmark: evaluation ran with the partial collector's
    over-provisioning (scoring training prompts) and tripped over carried groups."""
    held_out = [{"prompt": f"Held out {i}: one"} for i in range(3)]
    task = Task(lambda seed, index: {"prompt": "Count: " + "one two " * (index % 5)}, held_out,
                {"even": first_token_even}, [("even", 1.0)])
    config = replace(train_config(llama_dir, tmp_path, 2, max_tokens=6,
                                  partial=PartialRolloutConfig(enabled=True)), eval_size=3)
    trainer = Trainer(config, task=task)
    trainer.train_step()
    scored = []
    score = trainer._score_group
    trainer._score_group = lambda group: (scored.append(group.example["prompt"]), score(group))
    assert "accuracy" in trainer.evaluate()
    assert sorted(scored) == sorted(example["prompt"] for example in held_out)
    assert not trainer.llm.engine.has_unfinished_requests()
    assert trainer.llm.stats()["kv_blocks_used"] == 0
    trainer._score_group = score
    assert trainer.train_step()["reward"] >= 0  # and training goes on after it
