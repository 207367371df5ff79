"""The state of one sequence as the scheduler and block manager see it (no tensors)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ..sampling_params import SamplingParams
from ..structured_outputs import Grammar


class SequenceStatus(Enum):
    """Where a sequence is in its life.

    Queued, waiting for its group's prompt (forks from the group's first sequence), holding
    KV blocks, or done.
    """

    WAITING = "waiting"
    FORK_PENDING = "fork_pending"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    """One completion being generated: its tokens, its KV blocks and its progress.

    ``token_ids`` holds the prompt followed by the generated tokens. The model has computed
    (written K/V for) the first ``num_computed_tokens`` of them; the block table lists the
    physical KV blocks that hold them, in order. A sequence whose remaining uncomputed
    tokens are all scheduled in one step samples a new token at the end of that step.
    With overlapped steps (``EngineConfig.async_scheduling``) that token stays on the device
    until the host reads it a step later: until then it counts in ``num_pending_tokens``
    (and in ``num_tokens``), but not in ``token_ids``.

    ``block_hashes`` are the prefix-cache hashes of its full blocks, in order;
    ``prompt_logprobs`` the prompt positions scored so far (when asked); ``routed_experts``
    (when asked, ``return_routed_experts``) the experts its computed positions were routed
    to, by the first position of each step's chunk, as the runner encodes them (a chunk
    from a position on supersedes every chunk recorded from there: a recompute, after a
    preemption); positions before ``routing_inherited`` it did not compute itself, but took
    with their KV from ``routing_parent`` (a group's child its prompt's from the first
    sequence, a continuation the held sequence's). A sequence with
    ``hold_kv`` keeps its blocks when it finishes (see ``held.py``); ``resume_from`` is the
    held sequence a continuation takes its blocks from when it is admitted. The first
    sequence of a group carries the others in ``pending_children`` until its prompt is
    prefilled; then they fork from it, sharing its blocks. A request with
    ``structured_outputs`` gives each sequence its own grammar ``matcher`` (xgrammar's),
    advanced on every token it samples.
    """

    seq_id: int
    request_id: str
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed: int | None = None
    num_computed_tokens: int = 0
    num_pending_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    group_tables: list[list[int]] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    pending_children: list[Sequence] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)
    routed_experts: dict[int, bytes] = field(default_factory=dict)
    routing_parent: Sequence | None = None
    routing_inherited: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_weight_versions: list[int] = field(default_factory=list)
    sampling_thresholds: list[float] = field(default_factory=list)
    hold_kv: bool = False
    resume_from: Sequence | None = None
    matcher: Any = None

    def tables(self) -> list[list[int]]:
        """Its block table in every KV group: ``block_table`` (group 0), then
        ``group_tables`` (``kv_groups.py``)."""
        return [self.block_table, *self.group_tables]

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens, those still on the device included."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far (that the host knows: pending ones left out)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens (a copy)."""
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def weight_versions(self) -> tuple[int, int] | None:
        """The weight versions of the first and the last sampled token (None before any)."""
        versions = self.token_weight_versions
        return (versions[0], versions[-1]) if versions else None

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K/V the model has not written yet (a pending one included)."""
        return len(self.token_ids) + self.num_pending_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        """True once a stop condition ended the sequence or it was aborted."""
        return self.status is SequenceStatus.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """True while the request asked for prompt log-probs and this sequence, the one that
        prefills the prompt, has not scored every prompt position yet."""
        return (self.sampling_params.prompt_logprobs is not None and self.index == 0
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    @property
    def records_routing(self) -> bool:
        """True when the request asked for the experts each position was routed to."""
        return self.sampling_params.return_routed_experts

    def record_routing(self, start: int, chunk: bytes) -> None:
        """The experts of the positions from ``start`` that one step computed; chunks
        recorded from ``start`` on before are stale (a recompute), and go."""
        for stale in [key for key in self.routed_experts if key >= start]:
            del self.routed_experts[stale]
        self.routed_experts[start] = chunk

    def inherit_routing(self, parent: Sequence, positions: int) -> None:
        """Take the routing of the first ``positions`` positions from ``parent``, whose KV
        this sequence took (when it records routing)."""
        if self.records_routing and positions:
            self.routing_parent, self.routing_inherited = parent, positions

    def append_token(self, token_id: int, logprob: float, top_logprobs: dict[int, float] | None,
                     weight_version: int, threshold: float | None = None) -> None:
        """Append a sampled token with its log-probs, the weight version it was sampled
        under and its truncation threshold (when sampling truncated)."""
        self.token_ids.append(token_id)
        if self.matcher is not None:
            self.matcher.accept_token(token_id)
        self.logprobs.append(logprob)
        if top_logprobs is not None:
            self.top_logprobs.append(top_logprobs)
        if threshold is not None:
            self.sampling_thresholds.append(threshold)
        self.token_weight_versions.append(weight_version)


def child_seed(seed: int, index: int) -> int:
    """Seed of the ``index``-th completion of a request seeded with ``seed``.

    Child 0 keeps the request's seed, so an n=1 request and the first child of a group with
    the same seed sample the same tokens.
    """
    return (seed + index * 0x9E3779B97F4A7C15) % (1 << 64)


@dataclass(slots=True)
class Request:
    """One prompt and its ``n`` sequences (a *group* when n > 1), and the compiled
    ``grammar`` of its ``structured_outputs`` (None without)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    grammar: Grammar | None = None
    seqs: list[Sequence] = field(default_factory=list)

    @property
    def is_finished(self) -> bool:
        """True once every sequence of the request has finished."""
        return all(seq.is_finished for seq in self.seqs)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far by all its sequences."""
        return sum(seq.num_output_tokens for seq in self.seqs)

    def make_sequences(self, seq_ids: Iterator[int], hold_kv: bool) -> Sequence:
        """Create the request's ``n`` sequences (ids from ``seq_ids``); return the first,
        which carries the others as ``pending_children`` until its prompt is prefilled."""
        params, prompt = self.sampling_params, self.prompt_token_ids
        self.seqs = [Sequence(
            seq_id=next(seq_ids), request_id=self.request_id, index=index,
            token_ids=list(prompt), num_prompt_tokens=len(prompt), sampling_params=params,
            seed=None if params.seed is None else child_seed(params.seed, index),
            hold_kv=hold_kv, matcher=self.grammar and self.grammar.matcher())
            for index in range(params.n)]
        first, *children = self.seqs
        for child in children:
            child.status = SequenceStatus.FORK_PENDING
        first.pending_children = children
        return first
