"""Exact log-probs under top-k / top-p: the trainer rebuilds the engine's truncated
distribution from the per-token thresholds the engine returns."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.rollout import LLM, SamplingParams
from tandem.trainers.config import LoggingConfig, OptimConfig, RolloutConfig, TrainConfig
from tandem.trainers.losses import masked_mean
from tandem.trainers.policy import completion_logprobs, pad_rows, sampling_replay, token_batch
from tandem.trainers.tasks import Task
from tandem.trainers.trainer import Trainer

TRUNCATIONS = [dict(top_p=0.9), dict(top_k=50), dict(top_p=0.9, top_k=50)]


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), seed=2)


@pytest.fixture(scope="module")
def hf_model(llama_dir):
    return AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("truncation", TRUNCATIONS)
def test_trainer_logprobs_replay_the_engines_truncated_distribution(llm, hf_model, truncation):
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=16, logprobs=0, seed=0,
                            **truncation)
    completions = [c for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]
    prompt_ids = [p for p in prompts for _ in range(4)]
    tokens = token_batch(prompt_ids, [c.token_ids for c in completions], 0)
    mask = tokens.completion_mask
    engine = pad_rows([c.logprobs for c in completions], tokens.num_completion_slots, 0.0,
                      torch.float32)
    with torch.no_grad():
        plain, _, _ = completion_logprobs(hf_model, tokens, 1.0)
        tokens.replay = sampling_replay(
            [c.sampling_thresholds for c in completions], [c.token_ids for c in completions],
            None, tokens.num_completion_slots, truncation.get("top_k", 0),
            truncation.get("top_p", 1.0), torch.device("cpu"))
        replayed, _, differs = completion_logprobs(hf_model, tokens, 1.0)
    real = mask.bool()
    assert (plain - engine).abs()[real].mean() > 1e-3  # untruncated, the mass shows
    difference = (replayed - engine).abs()[real]
    # The targets in float32: the mean within 2e-5; a token whose boundary sits
    # within float noise may flip (a small-mass token in or out), so only a few stray.
    assert difference.mean() < 2e-5 and (difference > 1e-4).float().mean() < 0.02
    assert masked_mean(differs, mask) < 0.02


def test_a_step_at_top_p_stays_on_policy_and_logs_differing_sets(llama_dir, tmp_path):
    task = Task(lambda seed, index: {"prompt": f"Count {index}: one two"}, [],
                {"length": lambda completion_ids, **_: [float(len(i)) for i in completion_ids]},
                [("length", 1.0)])
    config = TrainConfig(
        model=str(llama_dir), steps=1, output_dir=str(tmp_path),
        rollout=RolloutConfig(prompts_per_step=2, num_generations=4, max_tokens=8, top_p=0.9,
                              top_k=50, engine={"num_kv_blocks": 64}),
        optim=OptimConfig(lr=1e-3), logging=LoggingConfig(wandb=False, progress_bar=False))
    metrics = Trainer(config, task=task).train_step()
    # Exact log-probs (the default on CPU): the trainer's logits are the engine's bits, so
    # its own truncated set is the engine's and the log-probs are equal.
    assert metrics["sampler_logprob_diff_max"] == 0.0
    assert metrics["sampling_set_differs_fraction"] == 0.0


@pytest.mark.parametrize("truncation", [{}, dict(top_p=0.9)])
def test_a_step_with_structured_outputs_replays_the_grammar_masks(llama_dir, tmp_path,
                                                                  truncation):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    task = Task(lambda seed, index: {"prompt": f"JSON {index}:"}, [],
                {"length": lambda completion_ids, **_: [float(len(i)) for i in completion_ids]},
                [("length", 1.0)])
    config = TrainConfig(
        model=str(llama_dir), steps=1, output_dir=str(tmp_path),
        rollout=RolloutConfig(prompts_per_step=2, num_generations=4, max_tokens=12,
                              engine={"num_kv_blocks": 64}, **truncation,
                              structured_outputs={"json": schema}),
        optim=OptimConfig(lr=1e-3), logging=LoggingConfig(wandb=False, progress_bar=False))
    metrics = Trainer(config, task=task).train_step()
    # Unmasked, the trainer's log-probs would miss the grammar's mass; replayed, with exact
    # log-probs (the default on CPU), they are the engine's bit for bit.
    assert metrics["sampler_logprob_diff_max"] == 0.0
