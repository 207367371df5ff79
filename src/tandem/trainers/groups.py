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

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import PreTrainedTokenizerBase

from tandem.rollout import LLM, RequestOutput, SamplingParams

from .config import DynamicSamplingConfig, PartialRolloutConfig, RolloutConfig
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
        token_weight_versions: each row's weight version of every sampled token.
        sampling_thresholds: each row's kept-set threshold per sampled token when sampling
            truncated (see ``CompletionOutput``); None otherwise.
        routed_experts: each row's experts per position and MoE layer (a mixture of
            experts; an episode's over all its turns; see ``CompletionOutput``); None
            otherwise.
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
    token_weight_versions: list[list[int]] = field(default_factory=list)
    sampling_thresholds: list[list[float]] | None = None
    routed_experts: list[torch.Tensor] | None = None
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

    def restart_stale(self, max_staleness: int) -> int:
        """Restart from its prompt each unfinished group with a token more than
        ``max_staleness`` weight versions old; returns how many."""

    @property
    def weight_version(self) -> int:
        """The version of the weights the engine serves now."""


def tokenize_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str | list[dict[str, str]]
                    ) -> list[int]:
    """A prompt's token ids: a conversation through the chat template, text as it is."""
    if isinstance(prompt, str):
        return tokenizer(prompt)["input_ids"]
    return tokenizer.apply_chat_template(prompt, tokenize=True, return_dict=False,
                                         add_generation_prompt=True)


def rollout_params(config: RolloutConfig, seed: int) -> SamplingParams:
    """A group's sampling: ``num_generations`` completions with their processed log-probs."""
    return SamplingParams(n=config.num_generations, temperature=config.temperature,
                          top_p=config.top_p, top_k=config.top_k, max_tokens=config.max_tokens,
                          logprobs=0, seed=seed, structured_outputs=config.structured_outputs)


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
        routed = self.engine.routing_format is not None  # a mixture of experts: replayable
        params = [dataclasses.replace(rollout_params(config, self.seed + key),
                                      return_routed_experts=routed) for key, _ in examples]
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

    def restart_stale(self, max_staleness: int) -> int:
        """Abort and queue again, from its prompt, each unfinished request that holds a token
        more than ``max_staleness`` versions older than the weights served now."""
        oldest = self.engine.weight_version - max_staleness
        stale = [request_id for request_id in self._started
                 if any(v < oldest for c in self.engine.request_output(request_id).outputs
                        for v in c.token_weight_versions)]
        restarted = []
        for request_id in stale:
            self.engine.abort_request(request_id)
            key, example, _ = self._started.pop(request_id)
            restarted.append((key, example))
        if restarted:
            self.start(restarted)
        return len(restarted)

    @property
    def weight_version(self) -> int:
        """The version of the weights the engine serves now."""
        return self.engine.weight_version

    def _group(self, output: RequestOutput) -> Group:
        key, example, prompt = self._started.pop(output.request_id)
        completions = output.outputs
        return Group(key, example, [prompt] * len(completions),
                     [list(c.token_ids) for c in completions], [c.text for c in completions],
                     [list(c.logprobs) for c in completions],
                     token_weight_versions=[list(c.token_weight_versions) for c in completions],
                     sampling_thresholds=None if completions[0].sampling_thresholds is None
                     else [list(c.sampling_thresholds) for c in completions],
                     routed_experts=None if completions[0].routed_experts is None
                     else [c.routed_experts for c in completions])


class EpisodeSource:
    """Multi-turn groups: ``num_generations`` episodes per example (see ``EpisodeRunner``);
    a row's completion is everything after its first prompt."""

    def __init__(self, llm: LLM, tokenizer: PreTrainedTokenizerBase, config: RolloutConfig,
                 seed: int, make_environment: Callable[[Example], Environment]) -> None:
        routed = llm.engine.routing_format is not None  # a mixture of experts: replayable
        params = dataclasses.replace(rollout_params(config, seed), return_routed_experts=routed)
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

    def restart_stale(self, max_staleness: int) -> int:
        """Restart from its first prompt each unfinished group with an episode holding a
        token more than ``max_staleness`` versions old; returns how many."""
        stale = self.runner.stale_groups(self.runner.engine.weight_version - max_staleness)
        for key in stale:
            self.runner.restart(key, self._examples[key], self.make_environment)
        return len(stale)

    @property
    def weight_version(self) -> int:
        """The version of the weights the engine serves now."""
        return self.runner.engine.weight_version

    def _group(self, key: int, trajectories: list[Trajectory]) -> Group:
        return Group(
            key, self._examples.pop(key),
            [t.token_ids[:t.num_prompt_tokens] for t in trajectories],
            [t.token_ids[t.num_prompt_tokens:] for t in trajectories],
            [t.messages[t.num_prompt_messages:] for t in trajectories],
            [_spread(t.logprobs, t.loss_mask[t.num_prompt_tokens:]) for t in trajectories],
            [t.loss_mask[t.num_prompt_tokens:] for t in trajectories], trajectories,
            token_weight_versions=[list(t.weight_versions) for t in trajectories],
            routed_experts=None if trajectories[0].routed_experts is None
            else [t.routed_experts for t in trajectories])


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


class GroupCollector:
    """Collects each step's groups from one source, scoring each as it finishes.

    Without dynamic sampling or partial rollouts a step runs all its groups to their end
    (the synchronous step). ``dynamic`` answers each group whose rewards do not spread by
    admitting one more prompt (``extra_example(k)``, the ``k``-th extra of the step) until
    the step's count of spread groups is complete, at most ``max_extra_prompts`` extras;
    ``zero_spread="drop"`` trains on the spread groups (topped up with flat ones at the cap,
    so the batch keeps its size), ``"keep"`` on all. With ``partial`` the first step admits
    ``over_provision`` extra groups, and a step ends as soon as it has its groups: the
    unfinished ones stay in the engine, paused with their KV, and go on in the next step
    (older ones first), as do groups that finished beyond the step's count.
    """

    def __init__(self, source: GroupSource, dynamic: DynamicSamplingConfig,
                 partial: PartialRolloutConfig | None = None) -> None:
        self.source, self.dynamic = source, dynamic
        self.partial = partial if partial is not None and partial.enabled else None
        self._keys = itertools.count()
        self._carried: list[Group] = []  # finished, not yet trained
        self._started = False

    def collect(self, examples: list[Example], extra_example: Callable[[int], Example],
                score: Callable[[Group], None]) -> Collected:
        """The step's groups to train on (``len(examples)`` of them, in key order)."""
        needed = len(examples)
        first = [] if self._started or self.partial is None else \
            [extra_example(k) for k in range(self.partial.over_provision)]
        extras, self._started = len(first), True
        restarted = 0 if self.partial is None else self._restart_stale(self.partial.max_staleness)
        self.source.start([(next(self._keys), example) for example in [*examples, *first]])
        sampled, self._carried = self._carried, []
        try:
            while self.source.has_unfinished_groups() and not self._enough(sampled, needed):
                for group in self.source.poll():
                    score(group)
                    sampled.append(group)
                    if self._replaces(group, extras):
                        self.source.start([(next(self._keys), extra_example(extras))])
                        extras += 1
        except BaseException:
            self.drop_carried()
            raise
        collected = self._choose(sampled, needed, extras)
        if self.partial is not None:
            collected.metrics["partial_restarted_groups"] = float(restarted)
        return collected

    def _restart_stale(self, max_staleness: int) -> int:
        """Restart from its prompt each group, unfinished or finished and carried, with a
        token more than ``max_staleness`` weight versions old; returns how many."""
        oldest = self.source.weight_version - max_staleness
        fresh, stale = [], []
        for group in self._carried:
            old = any(v < oldest for row in group.token_weight_versions for v in row)
            (stale if old else fresh).append(group)
        self._carried = fresh
        if stale:
            self.source.start([(group.key, group.example) for group in stale])
        return len(stale) + self.source.restart_stale(max_staleness)

    def drop_carried(self) -> None:
        """Abort every unfinished group and forget finished ones (at a checkpoint)."""
        self.source.abort()
        self._carried = []
        self._started = False  # the next step over-provisions again

    def _replaces(self, group: Group, extras: int) -> bool:
        return (self.dynamic.enabled and not group.has_spread
                and extras < self.dynamic.max_extra_prompts)

    def _enough(self, sampled: list[Group], needed: int) -> bool:
        """With partial rollouts, True once the step has its groups."""
        if self.partial is None:
            return False
        counted = [g for g in sampled if g.has_spread or not self.dynamic.enabled]
        return len(counted) >= needed

    def _choose(self, sampled: list[Group], needed: int, extras: int) -> Collected:
        """The groups to train on (the rest carried, with partial rollouts), and the counts:
        the share of trained groups whose rewards do not spread always, dynamic sampling's
        own when it is on."""
        dynamic = self.dynamic
        sampled.sort(key=lambda group: group.key)
        spread = [group for group in sampled if group.has_spread]
        if not dynamic.enabled or dynamic.zero_spread == "keep":
            kept = sampled
        else:
            flat = [group for group in sampled if not group.has_spread]
            kept = sorted(spread[:needed] + flat[:max(needed - len(spread), 0)],
                          key=lambda g: g.key)
        if self.partial is not None:
            kept = kept[:needed]
            trained = {id(group) for group in kept}
            self._carried = [group for group in sampled if id(group) not in trained]
            if dynamic.enabled and dynamic.zero_spread == "drop":
                self._carried = [group for group in self._carried if group.has_spread]
        zero = sum(not group.has_spread for group in kept)
        metrics = {"zero_spread_group_fraction": zero / max(len(kept), 1)}
        if dynamic.enabled:
            metrics.update({
                "groups_sampled": float(len(sampled)), "groups_kept": float(len(kept)),
                "groups_dropped": float(len(sampled) - len(kept) - len(self._carried)),
                "groups_zero_spread_kept": float(zero),
                "prompts_per_kept_group": len(sampled) / max(len(kept), 1),
                "dynamic_sampling_cap_reached": float(len(spread) < needed
                                                      and extras >= dynamic.max_extra_prompts)})
        return Collected(kept, sampled, metrics)
