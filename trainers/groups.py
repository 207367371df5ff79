"""Groups as they finish: a step's prompts through the engine, each group (one prompt's
``n`` completions, or its ``n`` episodes) scored the moment its last member ends, while the
others still generate; and dynamic sampling, which admits more prompts until enough groups
whose rewards spread are complete.

A source starts groups under integer keys and reports each finished one from ``poll``,
which advances the engine one step (rewards are then scored on the caller's thread, between
engine steps). ``CompletionSource`` runs single-turn requests; ``EpisodeSource`` runs
multi-turn episodes through ``EpisodeRunner``. ``collect_groups`` drives either.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import PreTrainedTokenizerBase

from tandem.rollout import LLM, RequestOutput, SamplingParams

from .config import DynamicSamplingConfig, RolloutConfig
from .environments import Environment
from .episodes import EpisodeRunner, Trajectory
from .tasks import Example


@dataclass(slots=True)
class Group:
    """One prompt's completions (or episodes), one row each, and their rewards.

    Attributes:
        key: the group's number in its step (admission order).
        example: the dataset example.
        prompt_ids: each row's prompt token ids.
        completion_ids: each row's tokens after the prompt (an episode's turns and
            observations).
        completions: each row's completion text, or an episode's messages after its prompt.
        sampler_logprobs: the engine's processed log-prob of every completion token (0 at
            environment tokens).
        loss_masks: per completion token, 1 where the model sampled it; None when all are.
        trajectories: an episode group's trajectories (empty for completions).
        rewards: each row's total reward, once scored.
        per_function: each reward function's values, once scored.
    """

    key: int
    example: Example
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    completions: list[Any]
    sampler_logprobs: list[list[float]]
    loss_masks: list[list[int]] | None = None
    trajectories: list[Trajectory] = field(default_factory=list)
    rewards: torch.Tensor | None = None
    per_function: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def has_spread(self) -> bool:
        """True when the rewards differ within the group (its advantages are not all 0)."""
        return self.rewards is not None and bool(self.rewards.max() > self.rewards.min())


class GroupSource(Protocol):
    """Starts groups and reports each as it finishes."""

    def start(self, examples: list[tuple[int, Example]]) -> None:
        """Begin a group for each ``(key, example)``."""

    def has_unfinished_groups(self) -> bool:
        """True while a started group has not been reported."""

    def poll(self) -> list[Group]:
        """Advance the engine once; the groups that finished meanwhile."""

    def abort(self) -> None:
        """Stop every unfinished group and free its blocks."""


def tokenize_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str | list[dict[str, str]]
                    ) -> list[int]:
    """A prompt's token ids: a conversation through the chat template, text as it is."""
    if isinstance(prompt, str):
        return tokenizer(prompt)["input_ids"]
    return tokenizer.apply_chat_template(prompt, tokenize=True, return_dict=False,
                                         add_generation_prompt=True)


class CompletionSource:
    """Single-turn groups: one request of ``num_generations`` completions per prompt, the
    prompt of key ``k`` seeded ``seed + k`` (so a step repeats exactly)."""

    def __init__(self, llm: LLM, tokenizer: PreTrainedTokenizerBase, config: RolloutConfig,
                 seed: int) -> None:
        self.engine, self.tokenizer, self.config, self.seed = llm.engine, tokenizer, config, seed
        self._request_ids = itertools.count()
        self._started: dict[str, tuple[int, Example, list[int]]] = {}

    def start(self, examples: list[tuple[int, Example]]) -> None:
        """Queue every example's request at once."""
        config = self.config
        ids = [f"group-{next(self._request_ids)}" for _ in examples]
        prompts = [tokenize_prompt(self.tokenizer, example["prompt"]) for _, example in examples]
        params = [SamplingParams(n=config.num_generations, temperature=config.temperature,
                                 top_p=config.top_p, max_tokens=config.max_tokens, logprobs=0,
                                 seed=self.seed + key) for key, _ in examples]
        self.engine.add_requests(ids, prompts, params)
        for request_id, (key, example), prompt in zip(ids, examples, prompts):
            self._started[request_id] = (key, example, prompt)

    def has_unfinished_groups(self) -> bool:
        """True while a started request has not finished."""
        return bool(self._started)

    def poll(self) -> list[Group]:
        """One engine step; the groups whose last completion it finished."""
        return [self._group(output) for output in self.engine.step()]

    def abort(self) -> None:
        """Abort every unfinished request."""
        for request_id in self._started:
            self.engine.abort_request(request_id)
        self._started.clear()

    def _group(self, output: RequestOutput) -> Group:
        key, example, prompt = self._started.pop(output.request_id)
        completions = output.outputs
        return Group(key, example, [prompt] * len(completions),
                     [list(c.token_ids) for c in completions], [c.text for c in completions],
                     [list(c.logprobs) for c in completions])


class EpisodeSource:
    """Multi-turn groups: ``num_generations`` episodes per example (see ``EpisodeRunner``);
    a row's completion is everything after its first prompt."""

    def __init__(self, llm: LLM, tokenizer: PreTrainedTokenizerBase, config: RolloutConfig,
                 seed: int, make_environment: Callable[[Example], Environment]) -> None:
        params = SamplingParams(n=config.num_generations, temperature=config.temperature,
                                top_p=config.top_p, max_tokens=config.max_tokens, logprobs=0,
                                seed=seed)
        self.runner = EpisodeRunner(llm.engine, tokenizer, params, config.max_turns,
                                    config.max_total_tokens)
        self.make_environment = make_environment
        self._examples: dict[int, Example] = {}

    def start(self, examples: list[tuple[int, Example]]) -> None:
        """Begin every example's episodes."""
        self._examples.update(examples)
        self.runner.start(examples, self.make_environment)

    def has_unfinished_groups(self) -> bool:
        """True while a started episode has not ended."""
        return self.runner.has_unfinished_groups()

    def poll(self) -> list[Group]:
        """One engine step (or a wait for a tool); the groups whose last episode ended.

        Raises:
            ValueError: as ``EpisodeRunner.poll``.
        """
        return [self._group(key, group) for key, group in self.runner.poll()]

    def abort(self) -> None:
        """End every unfinished episode and free its blocks."""
        self.runner.abort()

    def _group(self, key: int, trajectories: list[Trajectory]) -> Group:
        return Group(
            key, self._examples.pop(key),
            [t.token_ids[:t.num_prompt_tokens] for t in trajectories],
            [t.token_ids[t.num_prompt_tokens:] for t in trajectories],
            [t.messages[t.num_prompt_messages:] for t in trajectories],
            [_spread(t.logprobs, t.loss_mask[t.num_prompt_tokens:]) for t in trajectories],
            [t.loss_mask[t.num_prompt_tokens:] for t in trajectories], trajectories)


def _spread(logprobs: list[float], loss_mask: list[int]) -> list[float]:
    """The sampled tokens' log-probs at their positions, 0 at environment tokens."""
    values = iter(logprobs)
    return [next(values) if sampled else 0.0 for sampled in loss_mask]


@dataclass(slots=True)
class Collected:
    """A step's groups: those to train on (in key order) and the sampling counts."""

    groups: list[Group]
    sampled: list[Group]
    metrics: dict[str, float]


def collect_groups(source: GroupSource, examples: list[Example],
                   extra_example: Callable[[int], Example], score: Callable[[Group], None],
                   dynamic: DynamicSamplingConfig) -> Collected:
    """Run ``examples`` as groups, scoring each with ``score`` as it finishes.

    Without dynamic sampling every group is kept. With it, each group whose rewards do not
    spread is answered by admitting ``extra_example(k)`` (the ``k``-th extra prompt of the
    step) until ``len(examples)`` groups spread, at most ``dynamic.max_extra_prompts``
    extras. ``zero_spread="drop"`` trains on the spread groups (topped up with zero-spread
    ones when the cap was reached, so the batch keeps its size); ``"keep"`` on all.
    """
    needed = len(examples)
    source.start(list(enumerate(examples)))
    sampled: list[Group] = []
    extras = 0
    try:
        while source.has_unfinished_groups():
            for group in source.poll():
                score(group)
                sampled.append(group)
                if dynamic.enabled and not group.has_spread and extras < dynamic.max_extra_prompts:
                    source.start([(needed + extras, extra_example(extras))])
                    extras += 1
    except BaseException:
        source.abort()
        raise
    return _choose(sampled, needed, dynamic, extras)


def _choose(sampled: list[Group], needed: int, dynamic: DynamicSamplingConfig,
            extras: int) -> Collected:
    """The groups to train on, and the dynamic-sampling metrics."""
    sampled.sort(key=lambda group: group.key)
    if not dynamic.enabled:
        return Collected(sampled, sampled, {})
    spread = [group for group in sampled if group.has_spread]
    if dynamic.zero_spread == "keep":
        kept = sampled
    else:
        flat = [group for group in sampled if not group.has_spread]
        kept = sorted(spread + flat[:max(needed - len(spread), 0)], key=lambda g: g.key)
    zero = sum(not group.has_spread for group in kept)
    return Collected(kept, sampled, {
        "groups_sampled": float(len(sampled)), "groups_kept": float(len(kept)),
        "groups_dropped": float(len(sampled) - len(kept)),
        "groups_zero_spread_kept": float(zero),
        "prompts_per_kept_group": len(sampled) / max(len(kept), 1),
        "dynamic_sampling_cap_reached": float(len(spread) < needed
                                              and extras >= dynamic.max_extra_prompts)})
