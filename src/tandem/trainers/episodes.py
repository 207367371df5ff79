"""Multi-turn episodes on the engine: token in, token out, KV kept, no per-turn barrier.

Each episode's first turn is a request (a group of ``n`` forks as usual, each member then its
own episode with its own environment); every later turn is a ``Continuation`` of the held
completion with the environment's tokens, so the model's sampled tokens are never
re-tokenized and only the new tokens are prefilled. The runner steps the engine and runs
environment steps in worker threads: an episode whose environment has answered joins the
running batch at the next engine step while others still wait on theirs.

Observations are tokenized as a delta through the chat template: the text the template adds
after the model's message (the glue after its end-of-turn token, then the new messages and
the next generation prompt), never the model's own tokens again. That needs a template that
preserves prefixes (rendering more messages only appends); ``ConversationTokenizer`` checks
it at start.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from tandem.rollout import Continuation, LLMEngine, RequestOutput, SamplingParams
from tandem.rollout.core.sequence import child_seed

from .environments import Environment, EnvStep, Message, check_step
from .tasks import Example

MARK = "<tandem-turn-mark>"
PROBE = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
         {"role": "assistant", "content": "a"}, {"role": "tool", "content": "t"}]


class ConversationTokenizer:
    """Token ids of a conversation's first prompt and of each observation delta.

    Raises:
        ValueError: at construction, for a tokenizer without a chat template or one that
            does not preserve prefixes (such as Qwen3's, which drops earlier thinking).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("multi-turn episodes need a tokenizer with a chat template.")
        self.tokenizer = tokenizer
        for end in range(1, len(PROBE)):
            shorter, longer = self.render(PROBE[:end]), self.render(PROBE[:end + 1], True)
            if not longer.startswith(shorter):
                raise ValueError("the chat template does not preserve prefixes (rendering "
                                 "one more message changes earlier text): episodes could "
                                 "not continue token in, token out; use another template.")

    def render(self, messages: list[Message], add_generation_prompt: bool = False) -> str:
        """The template's text of ``messages``."""
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        """The first turn's prompt: the messages and the generation prompt."""
        return self.encode(self.render(messages, add_generation_prompt=True))

    def assistant_turn(self, history: list[Message], turn_ids: list[int]
                       ) -> tuple[Message, str]:
        """The model's turn ``turn_ids`` as a message after ``history``, and the glue: the
        template's text that closes the turn after the sampled tokens (all of its
        end-of-turn marker when the model did not sample it, else what follows it)."""
        rendered = self.render(history + [{"role": "assistant", "content": MARK}])
        suffix = rendered[rendered.rindex(MARK) + len(MARK):]  # e.g. "<|im_end|>\n"
        sampled = self.tokenizer.decode(turn_ids, skip_special_tokens=False)
        kept = next(k for k in range(len(suffix), -1, -1) if sampled.endswith(suffix[:k]))
        return {"role": "assistant", "content": sampled[:len(sampled) - kept]}, suffix[kept:]

    def observation_ids(self, history: list[Message], glue: str,
                        observations: list[Message]) -> list[int]:
        """The tokens after the model's turn (the last message of ``history``): the glue,
        the observation messages and the next generation prompt.

        Raises:
            ValueError: when the template renders the conversation differently once the
                observations are added.
        """
        before = self.render(history)
        after = self.render(history + observations, add_generation_prompt=True)
        if not after.startswith(before):
            raise ValueError("the chat template changed earlier text when the observations "
                             "were added: episodes need a prefix-preserving template.")
        return self.encode(glue + after[len(before):])

    def encode(self, text: str) -> list[int]:
        """Text as ids, with no special tokens added (the template wrote its own)."""
        return self.tokenizer.encode(text, add_special_tokens=False)


@dataclass(slots=True)
class Trajectory:
    """One episode: every token in order, which of them the model sampled, and its log-probs.

    Attributes:
        messages: the conversation (each model turn as its decoded tokens, special tokens
            included, without the end-of-turn marker), for rewards.
        token_ids: prompt, model turn 1, environment 1, model turn 2, ...
        loss_mask: 1 for each token the model sampled, 0 for prompt and environment tokens.
        logprobs: the engine's processed log-prob of each sampled token, in order.
        weight_versions: the weight version each sampled token was sampled under.
        num_prompt_tokens: the first prompt's length.
        num_prompt_messages: how many of ``messages`` the environment's reset gave.
        num_turns: model turns.
        finish_reason: ``"done"`` (the environment ended it), ``"max_turns"``,
            ``"max_total_tokens"`` (no room for the next observation) or ``"length"`` (a turn
            filled the episode's tokens); truncated, not an error. A turn cut at
            ``max_tokens`` is closed by the template's end-of-turn glue and answered.
        rewards: each environment step's reward.
        metrics: summed environment counts (``tool_calls``, ``tool_errors``).
        routed_experts: with ``return_routed_experts`` (a mixture of experts), the experts
            of every position but the last, over all turns: the last turn's, whose
            continuations kept the earlier turns' routing with their KV.
    """

    messages: list[Message]
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_prompt_messages: int = 0
    num_turns: int = 0
    finish_reason: str | None = None
    rewards: list[float] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    routed_experts: torch.Tensor | None = None


@dataclass(slots=True)
class _Episode:
    """A running episode: its environment, its trajectory and where its KV is held."""

    number: int
    environment: Environment
    trajectory: Trajectory
    request_id: str = ""
    index: int = 0
    glue: str = ""


class EpisodeRunner:
    """Runs episodes to their end on one engine, without a per-turn barrier.

    Args:
        engine: the engine (``llm.engine``); the runner drives its steps.
        tokenizer: the model's tokenizer, with a prefix-preserving chat template.
        params: sampling of each model turn (``n`` is the group size of the first turn;
            the sampled tokens' log-probs are always returned).
        max_turns: most model turns per episode.
        max_total_tokens: most tokens per episode (prompt, turns and observations; at most
            the engine's max_model_len).
        max_workers: environment steps running at once.

    ``events`` records ``("turn" | "observation", episode number)`` in the order they
    happened, so callers (and tests) can see that no episode waited for another's tool.
    """

    def __init__(self, engine: LLMEngine, tokenizer: PreTrainedTokenizerBase,
                 params: SamplingParams, max_turns: int = 4,
                 max_total_tokens: int | None = None, max_workers: int = 8) -> None:
        self.engine = engine
        self.conversations = ConversationTokenizer(tokenizer)
        self.params = dataclasses.replace(params, logprobs=params.logprobs or 0)
        self.max_turns = max_turns
        self.max_total_tokens = min(max_total_tokens or engine.max_model_len,
                                    engine.max_model_len)
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="environment")
        self._request_ids = itertools.count()
        self._numbers = itertools.count()
        self._in_engine: dict[str, list[_Episode]] = {}  # request id -> its episodes
        self._pending: dict[Future, _Episode] = {}  # environment steps under way
        self._groups: dict[int, list[_Episode]] = {}  # started, not yet reported
        self.events: list[tuple[str, int]] = []

    def run(self, examples: list[Example],
            make_environment: Callable[[Example], Environment]) -> list[list[Trajectory]]:
        """Each example's ``n`` episodes (its group), run to their end, in order.

        Raises:
            ValueError: as ``poll``.
        """
        self.start(list(enumerate(examples)), make_environment)
        finished: dict[int, list[Trajectory]] = {}
        while self.has_unfinished_groups():
            finished.update(self.poll())
        return [finished[key] for key in range(len(examples))]

    def start(self, examples: list[tuple[int, Example]],
              make_environment: Callable[[Example], Environment]) -> None:
        """Begin the ``n`` episodes of each ``(key, example)``: its group, reported by
        ``poll`` under ``key`` once all of them have ended (keys must be new)."""
        for key, example in examples:
            group = [self._new_episode(next(self._numbers), example, make_environment)
                     for _ in range(self.params.n)]
            self._groups[key] = group
            self._add(group, list(group[0].trajectory.token_ids), self.params)

    def has_unfinished_groups(self) -> bool:
        """True while a started group has an episode that has not ended."""
        return bool(self._groups)

    def poll(self) -> list[tuple[int, list[Trajectory]]]:
        """Advance once (one engine step, or a wait for the first environment to answer
        when no turn is running); return the groups whose last episode ended meanwhile.

        Raises:
            ValueError: for an environment that returns something other than an
                ``EnvStep`` of messages (naming it); every episode is aborted and every
                held block released.
        """
        try:
            self._advance()
        except BaseException:
            self.abort()
            raise
        done = [key for key, group in self._groups.items()
                if all(e.trajectory.finish_reason is not None for e in group)]
        return [(key, [e.trajectory for e in self._groups.pop(key)]) for key in done]

    def abort(self) -> None:
        """End every unfinished episode now and free every block they hold."""
        for key in list(self._groups):
            self._drop_group(key)

    def stale_groups(self, oldest_version: int) -> list[int]:
        """The keys of unfinished groups holding a sampled token (finished turns, or the
        running turn so far) of a weight version below ``oldest_version``."""
        running = {id(e): out for request_id, episodes in self._in_engine.items()
                   for e, out in zip(episodes, self.engine.request_output(request_id).outputs)}
        def stale(episode: _Episode) -> bool:
            versions = list(episode.trajectory.weight_versions)
            if id(episode) in running:
                versions += running[id(episode)].token_weight_versions
            return any(v < oldest_version for v in versions)
        return [key for key, group in self._groups.items() if any(map(stale, group))]

    def restart(self, key: int, example: Example,
                make_environment: Callable[[Example], Environment]) -> None:
        """Drop group ``key`` (its turns, held KV and pending environment steps) and begin
        it again from ``example``'s first prompt with new environments."""
        self._drop_group(key)
        self.start([(key, example)], make_environment)

    def _drop_group(self, key: int) -> None:
        group = self._groups.pop(key)
        members = {id(e) for e in group}
        for request_id in [r for r, eps in self._in_engine.items() if id(eps[0]) in members]:
            self.engine.abort_request(request_id)
            del self._in_engine[request_id]
        for future in [f for f, e in self._pending.items() if id(e) in members]:
            del self._pending[future]  # an environment still running answers no one
        for episode in group:
            if episode.trajectory.finish_reason is None and episode.request_id:
                try:
                    self.engine.release(episode.request_id, episode.index)
                except ValueError:
                    pass  # not held (its turn was aborted above, or is queued)

    def _new_episode(self, number: int, example: Example,
                     make_environment: Callable[[Example], Environment]) -> _Episode:
        environment = make_environment(example)
        messages = environment.reset(example)
        prompt = self.conversations.prompt_ids(messages)
        return _Episode(number, environment, Trajectory(
            list(messages), list(prompt), [0] * len(prompt), num_prompt_tokens=len(prompt),
            num_prompt_messages=len(messages)))

    def _add(self, episodes: list[_Episode], prompt: list[int] | Continuation,
             params: SamplingParams) -> None:
        request_id = f"episode-turn-{next(self._request_ids)}"
        self._in_engine[request_id] = episodes
        self.engine.add_request(request_id, prompt, params, hold_kv=True)

    def _advance(self) -> None:
        if self._in_engine:
            for output in self.engine.step():
                self._after_turn(output)
        elif self._pending:
            wait(list(self._pending), return_when=FIRST_COMPLETED)
        for future in [f for f in self._pending if f.done()]:
            episode = self._pending.pop(future)
            self._after_observation(episode, check_step(future.result(), episode.environment))

    def _after_turn(self, output: RequestOutput) -> None:
        for episode, completion in zip(self._in_engine.pop(output.request_id), output.outputs):
            episode.request_id, episode.index = output.request_id, completion.index
            trajectory = episode.trajectory
            message, episode.glue = self.conversations.assistant_turn(trajectory.messages,
                                                                      completion.token_ids)
            trajectory.token_ids += completion.token_ids
            trajectory.loss_mask += [1] * len(completion.token_ids)
            trajectory.logprobs += completion.logprobs
            trajectory.weight_versions += completion.token_weight_versions
            trajectory.routed_experts = completion.routed_experts
            trajectory.num_turns += 1
            trajectory.messages.append(message)
            self.events.append(("turn", episode.number))
            if len(trajectory.token_ids) >= self.max_total_tokens - 1:  # no room to go on
                self._finish(episode, "length")
            else:  # a turn cut at max_tokens is closed by the glue and answered as any other
                future = self._executor.submit(episode.environment.step,
                                               list(trajectory.messages))
                self._pending[future] = episode

    def _after_observation(self, episode: _Episode, step: EnvStep) -> None:
        trajectory = episode.trajectory
        trajectory.rewards.append(step.reward)
        for key, value in step.metrics.items():
            trajectory.metrics[key] = trajectory.metrics.get(key, 0.0) + value
        self.events.append(("observation", episode.number))
        if step.done or trajectory.num_turns >= self.max_turns:
            trajectory.messages += step.messages
            return self._finish(episode, "done" if step.done else "max_turns")
        ids = self.conversations.observation_ids(trajectory.messages, episode.glue,
                                                 step.messages)
        trajectory.messages += step.messages
        if len(trajectory.token_ids) + len(ids) >= self.max_total_tokens:
            return self._finish(episode, "max_total_tokens")
        trajectory.token_ids += ids
        trajectory.loss_mask += [0] * len(ids)
        seed = self.params.seed
        params = dataclasses.replace(self.params, n=1, seed=None if seed is None else child_seed(
            seed, 1000 * trajectory.num_turns + episode.index))
        self._add([episode], Continuation(episode.request_id, episode.index, ids), params)

    def _finish(self, episode: _Episode, finish_reason: str) -> None:
        episode.trajectory.finish_reason = finish_reason
        self.engine.release(episode.request_id, episode.index)
