"""Continuous batching: which sequences run in the next step, and what each step did to them.

The scheduler fills a token budget per step: running decodes first (one token each), then
prefill chunks of admitted and waiting sequences, mixed in one step. When blocks run out it
preempts the newest running sequence (recompute: its blocks are freed with their hashes
kept, so its recompute hits the prefix cache). A group's prompt is prefilled once by its
first sequence; when it completes, the other sequences fork from it. After the step it
appends each sampled token and decides every stop (EOS, stop ids, stop strings through the
output processor's incremental detokenizer, max_tokens, max_model_len). It never touches a
tensor; the model runner turns its ``ScheduledBatch`` into one.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..outputs import SamplerOutput
from .block_manager import BlockManager
from .held import HeldSequences
from .scheduled_batch import DecodeGroup, ScheduledBatch, live_seqs
from .sequence import Sequence, SequenceStatus

StopStringMatcher = Callable[[Sequence], str | None]
# Most prompt positions one step scores for prompt_logprobs: their logits, [positions,
# vocabulary] in float32 and again as log-probs, are a step's largest tensors (512 rows of a
# 152k vocabulary take 0.9 GB); the memory plan reserves them (memory.py).
MAX_SCORED_TOKENS = 512


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """The scheduler's part of the engine's configuration, resolved
    (``EngineConfig.scheduler_config``).

    Attributes:
        max_num_seqs: most sequences running at once.
        max_num_batched_tokens: most tokens computed in one step.
        max_model_len: the longest sequence.
        group_decodes: hand the runner each request's decode groups (only an attention
            backend that reads the cascade layout uses them: the torch kernels').
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    group_decodes: bool = False


class Scheduler:
    """Admits, batches, preempts and retires sequences under a token and a block budget.

    Args:
        config: the budgets and the batch's layout.
        block_manager: the KV pool's bookkeeping.
        eos_token_ids: the model's end-of-sequence tokens.
        match_stop_string: the stop string a sequence's newest text holds, if any (the
            output processor's incremental detokenizer); asked only of requests with
            stop strings.
        held: the finished sequences kept for continuation (their blocks are released,
            least recently finished first, before any running sequence is preempted).
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 eos_token_ids: set[int], match_stop_string: StopStringMatcher,
                 held: HeldSequences) -> None:
        self.config = config
        self.block_manager = block_manager
        self.eos_token_ids = eos_token_ids
        self.match_stop_string = match_stop_string
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.held = held
        self.num_preemptions = 0
        self.num_prefill_tokens = 0
        self.num_decode_steps = 0  # steps that decoded, and the sequences they decoded
        self.num_decoded_seqs = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence at the back of the waiting queue."""
        self.waiting.append(seq)

    def stats(self) -> dict[str, int]:
        """The queues' lengths (``num_running``, ``num_waiting``, in sequences) and what
        this scheduler did since it was made: ``preemptions``, ``prefill_tokens`` computed,
        ``decode_steps`` and the ``decoded_seqs`` they decoded."""
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "preemptions": self.num_preemptions,
            "prefill_tokens": self.num_prefill_tokens,
            "decode_steps": self.num_decode_steps,
            "decoded_seqs": self.num_decoded_seqs,
        }

    def schedule(self) -> ScheduledBatch:
        """Pick this step's sequences: decodes, then running prefills, then admissions."""
        batch = ScheduledBatch()
        budget = self._schedule_decodes(batch, self.config.max_num_batched_tokens)
        batch.num_decodes = len(batch.seqs)
        self.num_decode_steps += bool(batch.num_decodes)
        self.num_decoded_seqs += batch.num_decodes
        if self.config.group_decodes:
            batch.decode_groups = self._decode_groups(batch.seqs)
        for seq in [s for s in self.running if s.num_uncomputed_tokens > 1]:
            if budget == 0 or self._defers(seq, budget):
                break
            budget -= self._schedule_chunk(batch, seq, budget)
        while (budget > 0 and self.waiting and self._can_admit(self.waiting[0])
               and not self.waiting[0].num_pending_tokens  # preempted with its token away
               and not self._defers(self.waiting[0], budget)):
            scheduled = self._schedule_chunk(batch, self.waiting[0], budget)
            if not scheduled:
                break
            self._start(self.waiting.popleft())
            budget -= scheduled
        return batch

    def _defers(self, seq: Sequence, budget: int) -> bool:
        """True when ``seq``'s prefill should wait for the next step: this step already
        holds half its token budget and ``budget`` (what is left) would not finish it.

        A chunk that finishes no prompt only delays the step's end, and with it the first
        tokens of every prompt the step does finish: ending the step at a prompt's end
        instead gives each prompt of a burst its first token one prompt's time after the
        previous one (shortest remaining work first). Past half the budget the smaller
        step costs little.
        """
        if budget * 2 > self.config.max_num_batched_tokens or seq.num_uncomputed_tokens <= budget:
            return False  # (fitting uncached, it needs no prefix lookup, which hashes)
        return self.block_manager.num_tokens_to_compute(seq, _uses_cache(seq)) > budget

    def _schedule_decodes(self, batch: ScheduledBatch, budget: int) -> int:
        """Schedule the running decodes, oldest first, within ``budget``; the budget left.

        Most decodes write into a block they hold alone (``appends_in_place``) and need no
        allocation; the others go through ``allocate_slots`` and may preempt. A sequence
        whose pending token surely ends it (``max_tokens``, ``max_model_len``) waits for it.
        """
        appends_in_place = self.block_manager.appends_in_place
        for seq in [s for s in self.running if s.num_uncomputed_tokens == 1]:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop for an older one
            if seq.num_pending_tokens and self._ends_at_length(seq):
                continue
            if appends_in_place(seq):
                batch.add(seq, 1)
            elif not self._schedule_decode(batch, seq):
                continue
            budget -= 1
        return budget

    def _schedule_decode(self, batch: ScheduledBatch, seq: Sequence) -> bool:
        """Schedule ``seq``'s next token, preempting the newest sequences for room.

        Returns False when ``seq`` itself had to be preempted.
        """
        while (allocation := self.block_manager.allocate_slots(seq, 1)) is None:
            if self.release_held_kv(1):
                continue
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        batch.add(seq, 1, allocation.copies)
        return True

    def _schedule_chunk(self, batch: ScheduledBatch, seq: Sequence, budget: int) -> int:
        """Schedule a prefill chunk of ``seq`` within ``budget`` (and, when it scores prompt
        log-probs, within what ``MAX_SCORED_TOKENS`` leaves of the step); the tokens
        scheduled (0: the pool is short, or the step scores all it may)."""
        scores = seq.needs_prompt_logprobs
        if scores:
            budget = min(budget, MAX_SCORED_TOKENS - batch.num_scored_tokens)
            if budget <= 0:
                return 0
        if seq.resume_from is not None:
            self._resume(seq)
        while (allocation := self.block_manager.allocate_slots(seq, budget, _uses_cache(seq))
               ) is None:
            if not self.release_held_kv(1):
                if seq.status is SequenceStatus.WAITING and seq.block_table:
                    self._drop_blocks(seq)  # never wait holding blocks: recompute instead
                return 0
        seq.num_computed_tokens += allocation.num_cached_tokens
        batch.add(seq, allocation.num_new_tokens, allocation.copies)
        batch.num_scored_tokens += allocation.num_new_tokens if scores else 0
        self.num_prefill_tokens += allocation.num_new_tokens
        return allocation.num_new_tokens

    def _resume(self, seq: Sequence) -> None:
        """Give a continuation the blocks of the held sequence it continues, if it still
        holds them (its tokens are a prefix of the continuation's)."""
        held, seq.resume_from = seq.resume_from, None
        self.held.remove(held)
        seq.block_table, held.block_table = held.block_table, []
        seq.group_tables, held.group_tables = held.group_tables, []
        seq.block_hashes, held.block_hashes = held.block_hashes, []
        seq.num_computed_tokens = held.num_computed_tokens if seq.block_table else 0
        seq.inherit_routing(held, seq.num_computed_tokens)

    def release_held_kv(self, count: int | None = None) -> bool:
        """Free the blocks of the ``count`` least recently finished held sequences (None:
        all); they stay held, to be recomputed through the prefix cache. Returns False when
        no held sequence had blocks."""
        victims = self.held.with_blocks()[:count]
        for seq in victims:
            self._drop_blocks(seq)
        return bool(victims)

    def release_held(self, seq: Sequence) -> None:
        """Stop holding ``seq`` and free its blocks."""
        self.held.remove(seq)
        if seq.block_table:
            self._drop_blocks(seq)

    def register_computed_blocks(self) -> None:
        """Hash every full block the running sequences have computed (with overlapped steps
        a block whose last token was pending at its step waits to be hashed): before the
        weights change, so those blocks key on the weights they were computed under."""
        for seq in self.running:
            self.block_manager.register_computed_blocks(seq)

    def _drop_blocks(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0

    def _can_admit(self, seq: Sequence) -> bool:
        """True when ``seq`` and the rest of its group fit under ``max_num_seqs``."""
        return len(self.running) + 1 + len(seq.pending_children) <= self.config.max_num_seqs

    def _start(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _decode_groups(self, decodes: list[Sequence]) -> list[DecodeGroup]:
        """The decodes of each request, in order of first appearance, with the leading
        blocks they share (none for a request with one decode)."""
        rows_of: dict[str, list[int]] = {}
        for row, seq in enumerate(decodes):
            rows_of.setdefault(seq.request_id, []).append(row)
        return [DecodeGroup(rows, self._num_shared_blocks([decodes[r] for r in rows]))
                for rows in rows_of.values()]

    def _num_shared_blocks(self, seqs: list[Sequence]) -> int:
        return self.block_manager.shared_prefix_blocks(seqs) if len(seqs) > 1 else 0

    def preempt_all(self) -> None:
        """Preempt every running sequence, newest first, so the oldest waits at the front."""
        for seq in reversed(list(self.running)):
            self.preempt(seq)

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and requeue it at the front; it is recomputed later."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def update_from_output(self, batch: ScheduledBatch, output: SamplerOutput,
                           weight_version: int) -> list[Sequence]:
        """``advance`` then ``append_sampled``: a step's whole update, for a step whose
        output is at hand. Returns the sequences finished in this step."""
        sampled = self.advance(batch)
        return self.append_sampled(batch, sampled, output, weight_version)

    def advance(self, batch: ScheduledBatch) -> list[Sequence]:
        """Advance each scheduled sequence past its chunk and fork completed group prompts,
        once the step is launched; each sequence that samples gets a pending token.

        Returns the sampling sequences, one per row of the step's output (the order of
        ``batch.sampling_groups()``).
        """
        sampled: list[Sequence] = []
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            num_tokens = len(seq.token_ids) + seq.num_pending_tokens  # (inlined: hot)
            samples = seq.num_computed_tokens + num_new == num_tokens
            seq.num_computed_tokens += num_new
            if not samples:
                continue
            for member in self._fork(seq) if seq.pending_children else (seq,):
                member.num_pending_tokens += 1
                sampled.append(member)
        return sampled

    def append_sampled(self, batch: ScheduledBatch, sampled: list[Sequence],
                       output: SamplerOutput, weight_version: int) -> list[Sequence]:
        """Append the step's sampled tokens (``output``, one row per ``sampled`` sequence,
        sampled under ``weight_version``) and its prompt log-probs, and retire the
        sequences they end; returns those.

        A sequence that ended (a stop, an abort) while its token was on the device drops
        it: a token sampled past a stop is never emitted.
        """
        finished: list[Sequence] = []
        for i, scored in output.prompt_logprobs.items():
            batch.seqs[i].prompt_logprobs += scored
        for i, (start, routed) in output.routed_experts.items():
            batch.seqs[i].record_routing(start, routed)
        rows = zip(sampled, output.token_ids, output.logprobs, output.top_logprobs,
                   output.thresholds or itertools.repeat(None))
        for seq, token_id, logprob, top_logprobs, threshold in rows:
            if seq.status is SequenceStatus.FINISHED:
                continue
            seq.num_pending_tokens -= 1
            seq.append_token(token_id, logprob, top_logprobs, weight_version, threshold)
            finish_reason = self._stop_reason(seq)
            if finish_reason is not None:
                self.finish(seq, finish_reason)
                finished.append(seq)
        return finished

    def _ends_at_length(self, seq: Sequence) -> bool:
        """True when ``seq``'s tokens, pending ones counted, reach ``max_tokens`` or
        ``max_model_len``."""
        return (seq.num_tokens - seq.num_prompt_tokens >= seq.sampling_params.max_tokens
                or seq.num_tokens >= self.config.max_model_len)

    def _stop_reason(self, seq: Sequence) -> str | None:
        """The finish reason if ``seq``'s newest token ends it ("stop" or "length"), else None.

        Sets ``seq.stop_reason`` to the stop token id or stop string that matched.
        """
        params, token_ids = seq.sampling_params, seq.token_ids
        token = token_ids[-1]
        if seq.matcher is not None and seq.matcher.is_terminated():
            return "stop"  # the grammar ended (on a stop token), whatever ignore_eos says
        num_output_tokens = len(token_ids) - seq.num_prompt_tokens
        if num_output_tokens >= params.min_tokens:
            if token in params.stop_token_ids:
                seq.stop_reason = token
                return "stop"
            if token in self.eos_token_ids and not params.ignore_eos:
                return "stop"
            matched = self.match_stop_string(seq) if params.stop else None
            if matched is not None:
                seq.stop_reason = matched
                return "stop"
        if num_output_tokens >= params.max_tokens or len(token_ids) >= self.config.max_model_len:
            return "length"
        return None

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Start ``parent``'s pending children on its blocks; return the whole group."""
        children = live_seqs(parent.pending_children)
        parent.pending_children = []
        for child in children:
            self.block_manager.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            child.inherit_routing(parent, parent.num_prompt_tokens)
            child.status = SequenceStatus.RUNNING
            self.running.append(child)
        return [parent, *children]

    def finish(self, seq: Sequence, finish_reason: str) -> None:
        """Retire ``seq`` (done or aborted) and return its blocks to the pool, or, for a
        sequence that holds its KV and was not aborted, hold it with them."""
        holds = seq.hold_kv and finish_reason != "abort"
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            if not holds:
                self.block_manager.free(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            if seq.block_table:  # it resumed blocks, then waited for the rest
                self.block_manager.free(seq)
            if seq.resume_from is not None:  # the held sequence it would have continued
                self.release_held(seq.resume_from)
        if holds:
            self.held.add(seq)
        # a FORK_PENDING child holds nothing; its parent will skip it
        if seq.num_pending_tokens:  # its tokens on the device are dropped, their K/V unused
            seq.num_pending_tokens = 0
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = finish_reason


def _uses_cache(seq: Sequence) -> bool:
    """Whether ``seq``'s prompt may come from the prefix cache: not when its prompt
    log-probs or its routed experts are asked for (a cache hit has no logits to score and
    no routing)."""
    return not seq.needs_prompt_logprobs and not seq.records_routing
