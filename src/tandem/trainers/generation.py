"""Rollouts: a step's groups through the colocated engine (``groups.collect_groups``),
flattened one row per completion; the engine's round metrics, and its timed sleep and
wake-up between rounds."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import torch
from transformers import PreTrainedTokenizerBase

from tandem.rollout import LLM

from .config import DynamicSamplingConfig, PartialRolloutConfig, RolloutConfig
from .environments import Environment
from .episodes import Trajectory
from .groups import CompletionSource, EpisodeSource, Group, GroupCollector
from .tasks import Example

T = TypeVar("T")


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
        rewards: each row's total reward (scored as its group finished).
        per_function: each reward function's values per row.
        loss_masks: per completion token, 1 where the model sampled it (an episode's
            environment tokens are 0); None for single-turn rows (all sampled).
        sampling_thresholds: per completion token the engine's kept-set threshold when
            sampling truncated (top-k / top-p); None otherwise.
        routed_experts: each row's experts per position and MoE layer (mixture-of-experts
            models; see ``routing.py``); None otherwise.
        metrics: episode counts (turns, tool calls and errors, model and environment
            tokens; empty for single-turn rollouts) and dynamic sampling's counts.
    """

    prompts: list[Any]
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    completions: list[Any]
    sampler_logprobs: list[list[float]]
    group_ids: torch.Tensor
    columns: dict[str, list[Any]]
    seconds: float
    rewards: torch.Tensor
    per_function: dict[str, torch.Tensor]
    loss_masks: list[list[int]] | None = None
    sampling_thresholds: list[list[float]] | None = None
    routed_experts: list[torch.Tensor] | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def num_completion_tokens(self) -> int:
        """Sampled tokens in all."""
        return sum(len(ids) for ids in self.completion_ids)

    def summary(self) -> dict[str, float]:
        """The step's reward, length and speed figures."""
        lengths = torch.tensor([len(ids) for ids in self.completion_ids], dtype=torch.float32)
        return {"reward": float(self.rewards.mean()), "reward_std": float(self.rewards.std()),
                **{f"rewards/{name}": float(v.mean()) for name, v in self.per_function.items()},
                "completion_length": float(lengths.mean()),
                "completion_length_max": float(lengths.max()),
                "rollout_seconds": self.seconds,
                "rollout_tok_per_s": self.num_completion_tokens / max(self.seconds, 1e-9)}

    @classmethod
    def from_groups(cls, groups: list[Group], seconds: float,
                    metrics: dict[str, float]) -> RolloutBatch:
        """The scored ``groups``' rows, group after group."""
        rows = [(index, group, row) for index, group in enumerate(groups)
                for row in range(len(group.completion_ids))]
        examples = [group.example for group in groups]
        masks = [group.loss_masks for group in groups]
        thresholds = [group.sampling_thresholds for group in groups]
        routed = [group.routed_experts for group in groups]
        return cls(
            prompts=[group.example["prompt"] for _, group, _ in rows],
            prompt_ids=[group.prompt_ids[row] for _, group, row in rows],
            completion_ids=[group.completion_ids[row] for _, group, row in rows],
            completions=[group.completions[row] for _, group, row in rows],
            sampler_logprobs=[group.sampler_logprobs[row] for _, group, row in rows],
            group_ids=torch.tensor([index for index, _, _ in rows]),
            columns={key: [group.example[key] for _, group, _ in rows]
                     for key in examples[0] if key != "prompt"},
            seconds=seconds,
            rewards=torch.cat([group.rewards for group in groups]),
            per_function={name: torch.cat([group.per_function[name] for group in groups])
                          for name in groups[0].per_function},
            loss_masks=None if masks[0] is None else [m for mask in masks for m in mask],
            sampling_thresholds=None if thresholds[0] is None
            else [row for rows in thresholds for row in rows],
            routed_experts=None if any(r is None for r in routed)
            else [row for rows in routed for row in rows],
            metrics=metrics)


def evaluation_rollout(config: RolloutConfig) -> RolloutConfig:
    """The held-out evaluation's rollout: greedy, one completion per prompt, every prompt to
    its end (no dynamic sampling, no partial rollouts)."""
    return replace(config, num_generations=1, temperature=0.0,
                   dynamic_sampling=DynamicSamplingConfig(), partial=PartialRolloutConfig())


def make_collector(llm: LLM, tokenizer: PreTrainedTokenizerBase, config: RolloutConfig,
                   seed: int, make_environment: Callable[[Example], Environment] | None = None
                   ) -> GroupCollector:
    """A collector of completion groups (or, with ``make_environment``, episode groups),
    with the rollout's dynamic sampling and partial rollouts."""
    if make_environment is None:
        source = CompletionSource(llm, tokenizer, config, seed)
    else:
        source = EpisodeSource(llm, tokenizer, config, seed, make_environment)
    return GroupCollector(source, config.dynamic_sampling, config.partial)


def generate_groups(llm: LLM, collector: GroupCollector, examples: list[Example],
                    score: Callable[[Group], None], extra_example: Callable[[int], Example],
                    keep: slice | None = None) -> RolloutBatch:
    """The step's batch: ``examples`` through ``collector``, each group scored by ``score``
    as it finishes (see ``GroupCollector``), of the groups (in key order) ``keep`` takes
    (default all);
    episode counts for episode groups, and the staleness of the trained tokens (weight
    versions behind the engine's)."""
    prefill_before = llm.stats()["prefill_tokens"]
    start = time.perf_counter()
    collected = collector.collect(examples, extra_example, score)
    seconds = time.perf_counter() - start
    metrics = dict(collected.metrics)
    trajectories = [t for group in collected.sampled for t in group.trajectories]
    if trajectories:
        metrics.update(episode_metrics(trajectories,
                                       llm.stats()["prefill_tokens"] - prefill_before))
    metrics.update(staleness_metrics(collected.groups, llm.weight_version))
    kept = collected.groups if keep is None else collected.groups[keep]
    return RolloutBatch.from_groups(kept, seconds, metrics)


def staleness_metrics(groups: list[Group], version: int) -> dict[str, float]:
    """The share of the groups' sampled tokens 0, 1 and 2 or more weight versions behind
    ``version`` (all 0 without partial rollouts), and the mean."""
    behind = torch.tensor([version - v for group in groups for row in group.token_weight_versions
                           for v in row], dtype=torch.float32)
    if not len(behind):
        return {}
    return {"staleness_mean": float(behind.mean()),
            "staleness_0": float((behind == 0).float().mean()),
            "staleness_1": float((behind == 1).float().mean()),
            "staleness_2_or_more": float((behind >= 2).float().mean())}


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


def timed(fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    """``fn(*args)`` and the seconds it took."""
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def timed_sleep(llm: LLM, level: int = 0, preempt: bool = False) -> float:
    """Free the engine's KV pool, its weights kept (level 0: ``release_kv_cache_memory``),
    moved to CPU (1) or discarded (2), as ``LLM.sleep``'s levels (``preempt``: unfinished
    requests kept, to recompute on wake-up); returns the seconds it took."""
    if level == 0:
        return timed(llm.release_kv_cache_memory, preempt)[1]
    return timed(llm.sleep, level, preempt)[1]


def timed_wake(llm: LLM) -> float | None:
    """Wake the engine if it sleeps; returns the seconds it took, or None when it was awake."""
    if not llm.is_sleeping:
        return None
    return timed(llm.wake_up)[1]
