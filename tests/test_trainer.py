"""GRPO and PPO against a colocated engine on a tiny model: learning, on-policy, resume."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tandem.rollout import LLM, SamplingParams
from tandem.trainers.config import (
    LoggingConfig,
    OptimConfig,
    PPOConfig,
    RolloutConfig,
    TrainConfig,
)
from tandem.trainers.rewards import RewardError
from tandem.trainers.tasks import target_token_task
from tandem.trainers.trainer import Trainer

from .test_weight_update import with_weight_region

ENGINE = {"num_kv_blocks": 96, "max_model_len": 128}


@pytest.fixture(scope="module")
def target_token(llama_dir) -> int:
    """A token the untrained model samples now and then (not the most common one)."""
    llm = LLM(str(llama_dir), num_kv_blocks=64, max_model_len=128)
    task = target_token_task(0)
    prompts = [task.train_example(0, i)["prompt"] for i in range(8)]
    outputs = llm.generate(prompts, SamplingParams(n=8, max_tokens=8, seed=0), use_tqdm=False)
    counts = Counter(t for o in outputs for c in o.outputs for t in c.token_ids)
    return counts.most_common(3)[-1][0]


def make_config(llama_dir, tmp_path, target_token: int, **overrides) -> TrainConfig:
    fields = dict(
        model=str(llama_dir), task="target_token", task_args={"token_id": target_token},
        steps=6, seed=0, output_dir=str(tmp_path),
        rollout=RolloutConfig(prompts_per_step=4, num_generations=8, max_tokens=8,
                              engine=ENGINE),
        optim=OptimConfig(lr=1e-2, micro_batch_size=12), ppo=PPOConfig(kl_coef=0.01),
        logging=LoggingConfig(wandb=False, progress_bar=False, console_every=0))
    fields.update(overrides)
    return TrainConfig(**fields)


def echo_task():
    """Episodes of a tool that answers each turn with what turn it saw, ending after two;
    rewarded by the length of the model's turns."""
    from tandem.trainers.environments import EnvStep
    from tandem.trainers.tasks import Task

    class Echo:
        def __init__(self) -> None:
            self.turns = 0

        def reset(self, example):
            return list(example["prompt"])

        def step(self, messages):
            self.turns += 1
            return EnvStep([{"role": "tool", "content": f"seen {self.turns}"}],
                           done=self.turns >= 2)

    def longer(completions, **_):
        return [float(sum(len(m["content"]) for m in c if m["role"] == "assistant"))
                for c in completions]

    return Task(lambda seed, i: {"prompt": [{"role": "user", "content": f"Say {i}."}]}, [],
                {"longer": longer}, [("longer", 1.0)], lambda example: Echo())


def mean_reward(history: list[dict[str, float]], steps: slice) -> float:
    return sum(m["reward"] for m in history[steps]) / len(history[steps])


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_training_raises_reward_and_stays_on_policy(llama_dir, tmp_path, target_token,
                                                    algorithm):
    steps = {"grpo": 6, "ppo": 12}[algorithm]
    trainer = Trainer(make_config(llama_dir, tmp_path, target_token, algorithm=algorithm,
                                  steps=steps))
    history = [trainer.train_step() for _ in range(steps)]
    assert mean_reward(history, slice(-2, None)) > 2 * mean_reward(history, slice(0, 2)) + 0.05
    assert max(m["sampler_logprob_diff_max"] for m in history) < 1e-4
    assert [m["weight_version"] for m in history] == list(range(1, len(history) + 1))


def test_engine_serves_the_trainer_weights_after_each_step(llama_dir, tmp_path, target_token):
    trainer = Trainer(make_config(llama_dir, tmp_path, target_token, steps=2))
    trainer.train_step()
    engine = trainer.llm.engine.weight_parameters()
    for name, tensor in trainer.policy.model.named_parameters():
        assert torch.equal(engine[name], tensor.detach()), name


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])  # PPO's KL: the reference stays put
def test_resume_reproduces_the_next_steps_loss(llama_dir, tmp_path, target_token, algorithm):
    config = make_config(llama_dir, tmp_path / "a", target_token, steps=3, algorithm=algorithm)
    trainer = Trainer(config)
    trainer.train_step()
    checkpoint = trainer.save_checkpoint()
    expected = trainer.train_step()
    resumed = Trainer(make_config(llama_dir, tmp_path / "b", target_token, steps=3,
                                  algorithm=algorithm, resume_from=str(checkpoint)))
    assert resumed.step == 1
    again = resumed.train_step()
    for key in {"loss", "grad_norm", "kl"} & expected.keys():
        assert again[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
    assert again["reward"] == expected["reward"]


def test_a_save_that_dies_midway_leaves_no_checkpoint_folder(llama_dir, tmp_path, target_token,
                                                             monkeypatch):
    trainer = Trainer(make_config(llama_dir, tmp_path, target_token, steps=2))
    trainer.train_step()
    complete = trainer.save_checkpoint()
    trainer.train_step()

    def dies(path, *args):
        (path / "model.safetensors").write_bytes(b"torn")
        raise KeyboardInterrupt  # as a kill would stop it, half written

    monkeypatch.setattr("tandem.trainers.trainer.save_policy", dies)
    with pytest.raises(KeyboardInterrupt):
        trainer.save_checkpoint()
    assert not (tmp_path / "checkpoint-2").exists()  # nothing torn under a checkpoint's name
    assert (complete / "trainer_state.json").exists()
    monkeypatch.undo()
    saved = trainer.save_checkpoint()  # the next save replaces the stage
    assert saved.name == "checkpoint-2" and (saved / "optimizer-rank0.pt").exists()
    assert not list(tmp_path.glob(".checkpoint-*"))


def test_lora_training_syncs_only_the_adapter(llama_dir, tmp_path, target_token):
    config = make_config(llama_dir, tmp_path, target_token, steps=2)
    config.lora.enabled = True
    config.lora.r = 4
    trainer = Trainer(config)
    history = [trainer.train_step() for _ in range(2)]
    assert max(m["sampler_logprob_diff_max"] for m in history) < 1e-4
    assert trainer.llm.weight_version == 2


def _raises(**_):
    raise KeyError("answer")


@pytest.mark.parametrize("reward, message", [
    (_raises, "raised KeyError"),
    (lambda completions, **_: [float("nan")] * len(completions), "finite number"),
    (lambda completions, **_: [1.0], "returned 1 values"),
])
def test_a_broken_reward_function_is_named(llama_dir, tmp_path, target_token, reward, message):
    task = target_token_task(target_token)
    task.rewards["broken"] = reward
    task.default_rewards = [("broken", 1.0)]
    trainer = Trainer(make_config(llama_dir, tmp_path, target_token), task=task)
    with pytest.raises(RewardError, match=f"'broken'.*{message}"):
        trainer.train_step()


def test_checkpoint_loads_as_a_fresh_engine_serving_the_trained_weights(llama_dir, tmp_path,
                                                                       target_token):
    trainer = Trainer(make_config(llama_dir, tmp_path, target_token, steps=1))
    trainer.train_step()
    checkpoint = trainer.save_checkpoint()
    fresh = LLM(str(checkpoint), num_kv_blocks=32, max_model_len=64)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    expected = trainer.llm.generate(["the cat sat"], greedy, use_tqdm=False)
    assert fresh.generate(["the cat sat"], greedy, use_tqdm=False)[0].outputs[0].token_ids == \
        expected[0].outputs[0].token_ids


def test_wandb_offline_run_gets_the_step_metrics(llama_dir, tmp_path, target_token,
                                                 monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    config = make_config(llama_dir, tmp_path, target_token, steps=1)
    config.logging.wandb = True
    summary = Trainer(config).train()
    run_dir = summary["wandb_dir"]
    assert run_dir is not None and str(tmp_path) in run_dir
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))


def test_sleep_between_steps_at_each_level_trains_as_awake(llama_dir, tmp_path, target_token):
    """The KV pool alone (level 0), the weights to CPU too (1) or discarded (2): the same
    steps as an engine that never sleeps. The weights sit in one region, as a CUDA engine's
    do, so level 1 copies them out and back and level 2 really zeroes them (on CPU too): the
    update after the step must bring every one back."""
    histories = {}
    for level in (None, 0, 1, 2):
        config = make_config(llama_dir, tmp_path / str(level), target_token, steps=2)
        config.rollout.sleep_between_steps = level is not None
        config.rollout.sleep_level = level or 0
        trainer = Trainer(config)
        with_weight_region(trainer.llm)
        first = trainer.train_step()
        assert trainer.llm.is_sleeping == (level is not None)
        second = trainer.train_step()
        histories[level] = [(m["loss"], m["reward"]) for m in (first, second)]
        if level is not None:
            assert first["sleep_seconds"] > 0 and second["wake_seconds"] > 0
            assert trainer.llm.stats()["kv_cache_bytes"] == 0
        assert trainer.llm.weight_version == 2
        assert max(m["sampler_logprob_diff_max"] for m in (first, second)) == 0.0
    assert histories[0] == histories[1] == histories[2] == histories[None]


def test_sleep_level_is_checked_against_its_switch_and_lora(llama_dir, tmp_path, target_token):
    config = make_config(llama_dir, tmp_path, target_token)
    with pytest.raises(ValueError, match="sleep_between_steps: true"):
        replace(config, rollout=replace(config.rollout, sleep_level=1))
    with pytest.raises(ValueError, match="use 0"):
        replace(config, rollout=replace(config.rollout, sleep_between_steps=True, sleep_level=3))
    with pytest.raises(ValueError, match="LoRA"):
        replace(config, rollout=replace(config.rollout, sleep_between_steps=True,
                                        sleep_level=2), lora=replace(config.lora, enabled=True))


def test_grpo_trains_on_multi_turn_episodes_masking_environment_tokens(llama_dir, tmp_path,
                                                                       target_token):
    """Episodes of several turns: the loss and the on-policy check cover the model's tokens
    only (an environment token counted would show as a large sampler-vs-trainer gap)."""
    config = make_config(llama_dir, tmp_path, target_token, steps=2)
    config.rollout.max_turns, config.rollout.max_tokens = 3, 4
    trainer = Trainer(config, task=echo_task())
    history = [trainer.train_step() for _ in range(2)]
    for metrics in history:
        assert metrics["episode_turns"] > 1 and metrics["episode_environment_tokens"] > 0
        # Exact log-probs across turns whose KV the engine held (environment tokens prefilled
        # after the model's own, as a chunk after a cached prefix).
        assert metrics["sampler_logprob_diff_max"] == 0.0
        # each group's prompt once, then only new tokens: well under one pass per token
        assert 0 < metrics["episode_prefill_per_context_token"] < 0.6
    assert trainer.llm.stats()["held_sequences"] == 0


def test_resume_latest_takes_the_newest_checkpoint_and_keep_prunes_older_ones(
        llama_dir, tmp_path, target_token):
    config = make_config(llama_dir, tmp_path, target_token, steps=3, checkpoint_keep=2)
    assert Trainer(replace(config, resume_from="latest")).step == 0  # none yet: fresh
    trainer = Trainer(config)
    for _ in range(3):
        trainer.train_step()
        trainer.save_checkpoint()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2",
                                                                     "checkpoint-3"]
    assert Trainer(replace(config, resume_from="latest")).step == 3
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        Trainer(replace(config, resume_from=str(tmp_path / "checkpoint-1")))


@pytest.mark.usefixtures("datasets_cache")
def test_a_step_and_an_evaluation_on_the_shipped_gsm8k_data(llama_dir, tmp_path):
    """The dataset-backed task end to end: prompts from the recipe's file, math-verify's
    rewards in their worker processes (a random tiny model answers nothing right)."""
    pytest.importorskip("math_verify")
    data = Path(__file__).parents[1] / "recipes" / "data" / "gsm8k_mini.jsonl"
    config = make_config(llama_dir, tmp_path, 0, steps=1, task="gsm8k",
                         task_args={"path": str(data), "eval_fraction": 0.2}, eval_size=2,
                         rollout=RolloutConfig(prompts_per_step=2, num_generations=2,
                                               max_tokens=8, engine={**ENGINE,
                                                                     "max_model_len": 512}))
    trainer = Trainer(config)
    metrics = trainer.train_step()
    assert {"rewards/correct", "rewards/format"} <= metrics.keys()
    assert 0.0 <= trainer.evaluate()["accuracy"] <= 1.0
