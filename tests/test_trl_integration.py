"""TRL's GRPOTrainer generating with Tandem: trains, syncs at TRL's cadence, stays on-policy."""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import pytest

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from tandem.trainers import trl_integration  # noqa: E402
from tandem.trainers.tasks import (  # noqa: E402
    arith_task,
    completion_text,
    correct_reward,
    short_answer_reward,
)
from tandem.trainers.trl_integration import (  # noqa: E402
    TandemConfig,
    check_trl_version,
    tandem_grpo_trainer,
)

TANDEM = TandemConfig(engine={"num_kv_blocks": 64})


def even_token_reward(completion_ids: list[list[int]], **_) -> list[float]:
    """The share of even token ids: varies within a group, so the weights move every step."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def arith_dataset(size: int = 16) -> Dataset:
    task = arith_task()
    return Dataset.from_list([task.train_example(0, i) for i in range(size)])


def grpo_config(tmp_path, **overrides) -> GRPOConfig:
    fields = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                  gradient_accumulation_steps=2, max_steps=2, max_completion_length=8,
                  learning_rate=1e-2, logging_steps=1, report_to="none", use_cpu=True,
                  save_strategy="no", seed=0, bf16=False, vllm_max_model_length=128)
    fields.update(overrides)
    return GRPOConfig(**fields)


def train(model_dir, tmp_path, config_overrides=None, **kwargs):
    trainer = tandem_grpo_trainer(model=str(model_dir),
                                  reward_funcs=[correct_reward, short_answer_reward,
                                                even_token_reward],
                                  args=grpo_config(tmp_path, **(config_overrides or {})),
                                  train_dataset=arith_dataset(),
                                  tandem=TANDEM, **kwargs)
    trainer.train()
    return trainer, [log for log in trainer.state.log_history if "tandem/weight_version" in log]


def assert_on_policy_with_a_sync_per_round(trainer, logs) -> None:
    assert logs[0]["grad_norm"] > 0  # the second round samples from changed weights
    assert [log["tandem/weight_version"] for log in logs] == [1.0, 2.0]
    assert trainer.vllm_generation.llm.weight_version == 2
    assert max(log["sampling/sampling_logp_difference/max"] for log in logs) < 1e-4
    assert all("tandem/sync_seconds" in log and "tandem/kv_blocks_used_peak_fraction" in log
               for log in logs)


def test_grpo_trainer_trains_with_tandem_generating_and_sleeping(llama_dir, tmp_path):
    trainer, logs = train(llama_dir, tmp_path, {"vllm_enable_sleep_mode": True})
    assert_on_policy_with_a_sync_per_round(trainer, logs)
    assert all(0.0 <= log["tandem/prefix_cache_hit_rate"] <= 1.0 for log in logs)
    # The KV pool is freed after each round; the next round's sync lands asleep.
    engine = trainer.vllm_generation.llm.engine
    assert engine.released == {"kv_cache"} and engine.weights == "resident"
    assert all("tandem/wake_seconds" in log and "tandem/sleep_seconds" in log for log in logs)
    # TRL's tool loop reads the context limit at vLLM's path.
    assert trainer.vllm_generation.llm.llm_engine.model_config.max_model_len == 128


def test_grpo_trainer_with_peft_lora_pushes_only_the_adapter(llama_dir, tmp_path):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    trainer, logs = train(llama_dir, tmp_path, peft_config=lora)
    assert trainer.vllm_generation.lora_sync is not None
    assert_on_policy_with_a_sync_per_round(trainer, logs)


class CountingTokenizer:
    """A tokenizer that records each call that tokenizes, forwarding everything."""

    COUNTED = ("encode", "__call__", "apply_chat_template")

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.calls: list[str] = []

    def __call__(self, *args, **kwargs):
        self.calls.append("__call__")
        return self.tokenizer(*args, **kwargs)

    def encode(self, *args, **kwargs):
        self.calls.append("encode")
        return self.tokenizer.encode(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self.calls.append("apply_chat_template")
        return self.tokenizer.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_trl_prompt_ids_reach_the_engine_without_tokenizing_again(llama_dir, tmp_path):
    trainer = tandem_grpo_trainer(model=str(llama_dir), reward_funcs=[even_token_reward],
                                  args=grpo_config(tmp_path, max_steps=1),
                                  train_dataset=arith_dataset(), tandem=TANDEM)
    generation = trainer.vllm_generation
    processor = generation.llm.engine.input_processor
    counting = processor.tokenizer = CountingTokenizer(processor.tokenizer)
    engine_prompts, calls_during_generate = [], []
    engine_generate, shim_generate = generation.llm.generate, generation.generate

    def recording_engine_generate(prompts, *args, **kwargs):
        engine_prompts.extend(prompts)
        return engine_generate(prompts, *args, **kwargs)

    def counting_shim_generate(*args, **kwargs):
        before = len(counting.calls)
        result = shim_generate(*args, **kwargs)
        calls_during_generate.append(counting.calls[before:])
        return result

    generation.llm.generate = recording_engine_generate
    generation.generate = counting_shim_generate
    trainer.train()
    assert calls_during_generate and all(calls == [] for calls in calls_during_generate)
    assert engine_prompts and all(isinstance(prompt, list) and
                                  all(isinstance(token, int) for token in prompt)
                                  for prompt in engine_prompts)
    # The proxy sits where the engine tokenizes: a text prompt goes through it.
    engine_generate("What is 2+3?", use_tqdm=False)
    assert counting.calls == ["encode"]


@pytest.mark.parametrize("version", ["1.15.2", "1.17.0", "2.0.0"])
def test_unsupported_trl_version_is_refused(version):
    with pytest.raises(ValueError, match=f"trl {version} is installed.*trl>=1.16,<1.17"):
        check_trl_version(version)


def test_trl_version_check_runs_when_building_the_trainer(monkeypatch, llama_dir, tmp_path):
    monkeypatch.setattr(trl_integration.trl, "__version__", "1.15.0")
    with pytest.raises(ValueError, match="trl 1.15.0 is installed"):
        tandem_grpo_trainer(model=str(llama_dir), reward_funcs=[correct_reward],
                            args=grpo_config(tmp_path), train_dataset=arith_dataset())


def test_grpo_trainer_trains_with_a_structured_outputs_regex(llama_dir, tmp_path):
    pattern, seen = r"[0-9]{1,3}", []

    def recorded(completions: list, **_) -> list[float]:
        seen.extend(completion_text(c) for c in completions)
        return [float(len(c)) for c in completions]

    trainer = tandem_grpo_trainer(
        model=str(llama_dir), reward_funcs=[recorded, even_token_reward], tandem=TANDEM,
        args=grpo_config(tmp_path, vllm_structured_outputs_regex=pattern),
        train_dataset=arith_dataset())
    trainer.train()
    assert trainer.vllm_generation.llm.weight_version == 2  # two steps, each synced
    assert len(seen) == 16 and all(re.fullmatch(pattern, c) for c in seen), seen


@pytest.mark.parametrize(("overrides", "message"), [
    ({"vllm_mode": "server"}, "vllm_mode='server' is not supported"),
    ({"vllm_tensor_parallel_size": 2}, "vllm_tensor_parallel_size=2 is not supported"),
    ({"generation_kwargs": {"logit_bias": {1: 2.0}}}, r"generation_kwargs has \['logit_bias'\]"),
    ({"generation_kwargs": {"n": 2}}, r"generation_kwargs has \['n'\]"),
])
def test_incompatible_setting_is_refused(llama_dir, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        tandem_grpo_trainer(model=str(llama_dir), reward_funcs=[correct_reward],
                            args=grpo_config(tmp_path, **overrides),
                            train_dataset=arith_dataset())


def test_trl_recipe_trains_a_step_on_a_tiny_model(llama_dir, tmp_path):
    path = Path(__file__).resolve().parents[1] / "recipes" / "trl_grpo.py"
    spec = importlib.util.spec_from_file_location("trl_grpo_recipe", path)
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    metrics = recipe.main(["--model", str(llama_dir), "--max-steps", "1",
                           "--output-dir", str(tmp_path)])
    assert math.isfinite(metrics["train_loss"])
