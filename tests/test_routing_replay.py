"""Routing replay in the trainer: the sampler's experts, laid out as the trainer's batch,
counted against the trainer's own routing and, with replay, used in its forward pass, under
transformers and under the engine's exact forward; and a GRPO run on a mixture of experts
that logs the agreement."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.rollout import LLM, SamplingParams
from tandem.trainers.config import load_config
from tandem.trainers.episodes import EpisodeRunner
from tandem.trainers.policy import Policy, token_batch
from tandem.trainers.routing import RoutingCounts, routing_rows
from tandem.trainers.trainer import Trainer

from .test_moe import PROMPTS, moe_dirs  # noqa: F401 - a fixture
from .test_trainer import echo_task, make_config

NUM_EXPERTS = 4
RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "grpo_moe_tiny.yaml"


def rollouts(llm: LLM):
    params = SamplingParams(n=2, max_tokens=8, ignore_eos=True, seed=1, logprobs=0,
                            return_routed_experts=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    prompts = [p for p, o in zip(PROMPTS, outputs, strict=True) for _ in o.outputs]
    completions = [c for o in outputs for c in o.outputs]
    batch = token_batch(prompts, [c.token_ids for c in completions], 0)
    width = batch.input_ids.shape[1]
    batch.routing = routing_rows([c.routed_experts for c in completions],
                                 [len(p) for p in prompts], width - batch.num_completion_slots,
                                 width)
    return batch, [c.logprobs for c in completions]


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("exact", [False, True], ids=["transformers", "exact forward"])
def test_the_trainer_counts_and_replays_the_samplers_routing(moe_dirs, kind, exact):  # noqa: F811
    folder = moe_dirs[kind, 0]
    llm = LLM(str(folder))
    batch, _ = rollouts(llm)
    policy = Policy(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))
    if exact:
        policy.use_exact_forward(llm.exact_forward(policy.model))
    with torch.no_grad():
        own, _, _ = policy(batch, 1.0)
        assert policy.routing_counts.total > 0
        assert policy.routing_counts.agreed == policy.routing_counts.total  # same experts
        policy.routing_replay = True
        replayed, _, _ = policy(batch, 1.0)
        assert torch.equal(replayed, own)  # replaying its own choice changes nothing
        shifted = torch.where(batch.routing >= 0, (batch.routing + 1) % NUM_EXPERTS, -1)
        policy.routing_counts = RoutingCounts()
        moved, _, _ = policy(dataclasses.replace(batch, routing=shifted), 1.0)
    # its own choice is never the shifted one at the first MoE layer (later layers see
    # shifted inputs, and may now and then choose as shifted)
    assert policy.routing_counts.agreed < policy.routing_counts.total / 10
    assert (moved - own).abs().max() > 1e-3  # and the forward took the shifted experts


@pytest.mark.parametrize("exact", [None, False])
def test_grpo_on_a_mixture_of_experts_logs_routing_agreement(moe_dirs, tmp_path, exact):  # noqa: F811
    config = make_config(moe_dirs["qwen3_moe", 0], tmp_path, target_token=7, steps=2,
                         exact_logprobs=exact)
    config.moe.routing_replay = exact is False
    trainer = Trainer(config)
    for _ in range(2):
        metrics = trainer.train_step()
        assert 0.9 <= metrics["routing_agreement"] <= 1.0
        assert metrics["sampler_logprob_diff_max"] < 1e-4
    if exact is None:  # exact kernels: the trainer routes as the sampler did, bit for bit
        assert metrics["routing_agreement"] == 1.0 and metrics["sampler_logprob_diff_max"] == 0


@pytest.mark.parametrize("exact", [None, False])
def test_multi_turn_episodes_replay_the_routing_of_every_turn(moe_dirs, tmp_path, exact):  # noqa: F811
    # The last turn's routing covers the whole episode (earlier turns' kept with their KV),
    # tool tokens included, so the trainer routes every position as the sampler did.
    config = make_config(moe_dirs["qwen3_moe", 0], tmp_path, target_token=7, steps=1,
                         exact_logprobs=exact)
    config.rollout.max_turns, config.rollout.max_tokens = 3, 4
    config.moe.routing_replay = exact is False
    metrics = Trainer(config, task=echo_task()).train_step()
    assert metrics["episode_turns"] > 1 and metrics["episode_environment_tokens"] > 0
    assert 0.9 <= metrics["routing_agreement"] <= 1.0
    if exact is None:
        assert metrics["routing_agreement"] == 1.0 and metrics["sampler_logprob_diff_max"] == 0


def test_an_episodes_routing_covers_every_position_of_every_turn(moe_dirs):  # noqa: F811
    folder = moe_dirs["qwen3_moe", 0]
    llm, task = LLM(str(folder)), echo_task()
    params = SamplingParams(n=2, max_tokens=4, seed=3, return_routed_experts=True)
    runner = EpisodeRunner(llm.engine, llm.get_tokenizer(), params, max_turns=3)
    trajectories = runner.run([task.train_example(0, 0)], task.environment)[0]
    fresh = LLM(str(folder))
    for trajectory in trajectories:
        assert trajectory.num_turns > 1
        whole = fresh.generate([trajectory.token_ids],
                               SamplingParams(max_tokens=1, return_routed_experts=True),
                               use_tqdm=False)[0].outputs[0].routed_experts
        assert torch.equal(trajectory.routed_experts, whole[:-1])


def test_routing_replay_on_a_dense_model_is_refused(llama_dir, tmp_path):
    config = make_config(llama_dir, tmp_path, target_token=7, steps=1)
    config.moe.routing_replay = True
    with pytest.raises(ValueError, match="routing_replay.*no experts"):
        Trainer(config)


def test_a_recipe_takes_the_moe_section():
    assert load_config(None, ["moe.routing_replay=true"]).moe.routing_replay is True


def test_the_moe_recipe_builds_its_model_and_learns(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))  # built here, not reused
    config = load_config(RECIPE, [f"output_dir={tmp_path / 'run'}", "steps=4",
                                  "logging.wandb=false", "logging.progress_bar=false",
                                  "logging.console_every=0", "eval_size=0"])
    trainer = Trainer(config)
    assert (tmp_path / "cache" / "tiny-random-moe" / "config.json").is_file()
    history = [trainer.train_step() for _ in range(4)]
    assert history[-1]["reward"] > history[0]["reward"] + 0.2
    assert all(m["routing_agreement"] == 1.0 for m in history)
    assert all(m["sampler_logprob_diff_max"] == 0.0 for m in history)
