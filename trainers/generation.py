"""Rollouts: a step's prompts through the colocated engine, flattened one row per completion;
the engine's round metrics, and its timed sleep and wake-up between rounds."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from tandem.rollout import LLM, SamplingParams

from .config import RolloutConfig
from .environments import Environment
from .episodes import EpisodeRunner, Trajectory
from .tasks import Example


@dataclass(slots=True)
class RolloutBatch:
    """Every completion of a step, one row each, groups contiguous (row ``i`` is of group
    ``group_ids[i]``).

    Attributes:
        prompts: each row's prompt as the task gave it (a string or a conversation).
        prompt_ids: each row's prompt token ids.
        completion_ids: each row's sampled token ids (ending with EOS when it stopped).
        completions: each row's completion text.
        sampler_logprobs: the engine's processed log-prob of every completion token (0 at
            an episode's environment tokens, which the loss mask leaves out).
        group_ids: the prompt (group) index of each row.
        columns: the examples' other columns, one value per row.
        seconds: wall time of the generation.
        loss_masks: per completion token, 1 where the model sampled it (an episode's
            environment tokens are 0); None for single-turn rows (all sampled).
        metrics: episode counts (turns, tool calls and errors, model and environment
            tokens), empty for single-turn rollouts.
    """

    prompts: list[Any]
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    completions: list[Any]
    sampler_logprobs: list[list[float]]
    group_ids: torch.Tensor
    columns: dict[str, list[Any]]
    seconds: float
    loss_masks: list[list[int]] | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def num_completion_tokens(self) -> int:
        """Sampled tokens in all."""
        return sum(len(ids) for ids in self.completion_ids)


def tokenize_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str | list[dict[str, str]]
                    ) -> list[int]:
    """A prompt's token ids: a conversation through the chat template, text as it is."""
    if isinstance(prompt, str):
        return tokenizer(prompt)["input_ids"]
    return tokenizer.apply_chat_template(prompt, tokenize=True, return_dict=False,
                                         add_generation_prompt=True)


def generate_rollouts(llm: LLM, tokenizer: PreTrainedTokenizerBase, examples: list[Example],
                      config: RolloutConfig, seed: int) -> RolloutBatch:
    """Sample ``config.num_generations`` completions of every example's prompt.

    Each prompt gets its own seed (``seed + its index``), so a step repeats exactly.
    """
    prompt_ids = [tokenize_prompt(tokenizer, example["prompt"]) for example in examples]
    params = [SamplingParams(n=config.num_generations, temperature=config.temperature,
                             top_p=config.top_p, max_tokens=config.max_tokens, logprobs=0,
                             seed=seed + index) for index in range(len(examples))]
    start = time.perf_counter()
    outputs = llm.generate(prompt_ids, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    rows = [(index, completion) for index, output in enumerate(outputs)
            for completion in output.outputs]
    columns = {key: [examples[i][key] for i, _ in rows]
               for key in examples[0] if key != "prompt"}
    return RolloutBatch(
        prompts=[examples[i]["prompt"] for i, _ in rows],
        prompt_ids=[prompt_ids[i] for i, _ in rows],
        completion_ids=[list(c.token_ids) for _, c in rows],
        completions=[c.text for _, c in rows],
        sampler_logprobs=[list(c.logprobs) for _, c in rows],
        group_ids=torch.tensor([i for i, _ in rows]),
        columns=columns,
        seconds=seconds)


def generate_episodes(llm: LLM, tokenizer: PreTrainedTokenizerBase, examples: list[Example],
                      config: RolloutConfig, seed: int,
                      make_environment: Callable[[Example], Environment]) -> RolloutBatch:
    """Run ``config.num_generations`` episodes of every example (see ``EpisodeRunner``),
    flattened as ``generate_rollouts`` flattens completions: the completion of a row is
    everything after its first prompt, its ``completions`` entry the messages after it."""
    params = SamplingParams(n=config.num_generations, temperature=config.temperature,
                            top_p=config.top_p, max_tokens=config.max_tokens, logprobs=0,
                            seed=seed)
    runner = EpisodeRunner(llm.engine, tokenizer, params, config.max_turns,
                           config.max_total_tokens)
    prefill_before = llm.stats()["prefill_tokens"]
    start = time.perf_counter()
    groups = runner.run(examples, make_environment)
    seconds = time.perf_counter() - start
    prefill = llm.stats()["prefill_tokens"] - prefill_before
    rows = [(index, t) for index, group in enumerate(groups) for t in group]
    return RolloutBatch(
        prompts=[examples[i]["prompt"] for i, _ in rows],
        prompt_ids=[t.token_ids[:t.num_prompt_tokens] for _, t in rows],
        completion_ids=[t.token_ids[t.num_prompt_tokens:] for _, t in rows],
        completions=[t.messages[t.num_prompt_messages:] for _, t in rows],
        sampler_logprobs=[_spread(t.logprobs, t.loss_mask[t.num_prompt_tokens:])
                          for _, t in rows],
        group_ids=torch.tensor([i for i, _ in rows]),
        columns={key: [examples[i][key] for i, _ in rows]
                 for key in examples[0] if key != "prompt"},
        seconds=seconds,
        loss_masks=[t.loss_mask[t.num_prompt_tokens:] for _, t in rows],
        metrics=episode_metrics([t for _, t in rows], prefill))


def _spread(logprobs: list[float], loss_mask: list[int]) -> list[float]:
    """The sampled tokens' log-probs at their positions, 0 at environment tokens."""
    values = iter(logprobs)
    return [next(values) if sampled else 0.0 for sampled in loss_mask]


def episode_metrics(trajectories: list[Trajectory], prefill_tokens: int) -> dict[str, float]:
    """Means per episode: turns, tool calls, tool errors, model and environment tokens; and
    the KV reuse across turns: prefill tokens computed per token of the episodes' contexts
    (re-prefilling every turn would compute each token once per later turn)."""
    count = max(len(trajectories), 1)
    context_tokens = sum(len(t.token_ids) for t in trajectories)
    model_tokens = sum(sum(t.loss_mask[t.num_prompt_tokens:]) for t in trajectories)
    all_tokens = sum(len(t.token_ids) - t.num_prompt_tokens for t in trajectories)
    return {"episode_turns": sum(t.num_turns for t in trajectories) / count,
            "episode_tool_calls": sum(t.metrics.get("tool_calls", 0.0)
                                      for t in trajectories) / count,
            "episode_tool_errors": sum(t.metrics.get("tool_errors", 0.0)
                                       for t in trajectories) / count,
            "episode_model_tokens": model_tokens / count,
            "episode_environment_tokens": (all_tokens - model_tokens) / count,
            "episode_prefill_per_context_token": prefill_tokens / max(context_tokens, 1)}


def engine_round_metrics(before: dict[str, float], after: dict[str, float]
                         ) -> dict[str, float]:
    """A generation round's engine metrics from its ``stats()`` before and after it: the
    weight version, the peak share of the KV pool held, and the round's own prefix-cache
    hit rate, copy-on-write copies and preemptions."""
    def delta(key: str) -> float:
        return float(after[key] - before[key])

    return {"weight_version": float(after["weight_version"]),
            "kv_blocks_used_peak_fraction": after["kv_blocks_used_peak"]
            / max(after["kv_blocks_total"], 1),
            "prefix_cache_hit_rate": delta("prefix_cache_hit_tokens")
            / max(delta("prefix_cache_queried_tokens"), 1.0),
            "cow_copies": delta("cow_copies"), "preemptions": delta("preemptions")}


def timed_sleep(llm: LLM) -> float:
    """Put the engine to sleep at level 1 (its KV pool freed); returns the seconds it took."""
    start = time.perf_counter()
    llm.sleep(1)
    return time.perf_counter() - start


def timed_wake(llm: LLM) -> float | None:
    """Wake the engine if it sleeps; returns the seconds it took, or None when it was awake."""
    if not llm.is_sleeping:
        return None
    start = time.perf_counter()
    llm.wake_up()
    return time.perf_counter() - start
