"""Turns last-position logits into tokens and the log-probs the trainer needs.

Order of processing, per row: the grammar mask of structured outputs, repetition /
presence / frequency penalties, min_tokens suppression of stop tokens (not once a grammar
is complete: it allows nothing else), temperature, top-k, top-p, min-p. The returned log-prob of a
token is its log-prob under that *processed* distribution (float32): after temperature, and
renormalised over the tokens that truncation kept. Greedy rows (temperature 0) take the
argmax and report log-probs of the penalised logits at temperature 1, untruncated.

A seeded sequence draws the uniform of its k-th token from its seed and k alone
(``seeded_uniforms``: a counter-based hash, as JAX's and Philox's keyed streams): the same
tokens whatever batch, step or overlap it runs in, with no per-sequence generator to keep.
"""

from __future__ import annotations

import numpy as np
import torch

from ..core.sequence import Sequence
from ..outputs import SamplerOutput
from ..structured_outputs import apply_grammar_masks
from .attention_layout import long_tensor, to_device
from .device_sample import DeviceSample


class Sampler:
    """Samples seeded rows from their seeds (``seeded_uniforms``); unseeded rows share the
    engine's generator."""

    def __init__(self, eos_token_ids: set[int], seed: int, device: torch.device) -> None:
        self.eos_token_ids = sorted(eos_token_ids)
        self.device = device
        self.generator = torch.Generator(device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """Sample one token for each ``seqs[i]`` from ``logits[i]``."""
        return self.sample(logits, seqs).to_host({}).result()

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> DeviceSample:
        """As ``__call__``, leaving the samples on the device: nothing here waits for it
        (on CUDA every host tensor goes over by a non-blocking copy)."""
        logits = logits.float()
        # The requests of a batch mostly share a few SamplingParams: a step asks each one
        # once whether it uses a feature, and walks the rows only for features in use.
        distinct = list({id(s.sampling_params): s.sampling_params for s in seqs}.values())
        apply_grammar_masks(logits, seqs)
        if any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty
               for p in distinct):
            self._apply_penalties(logits, seqs)
        if any(p.min_tokens for p in distinct):
            self._suppress_stop_tokens(logits, seqs)
        processed = logits if all((p.temperature or 1.0) == 1.0 for p in distinct) \
            else self._apply_temperature(logits, seqs)
        truncated = self._truncate(processed, seqs) if any(p.truncates for p in distinct) \
            else processed
        logprobs = torch.log_softmax(truncated, dim=-1)
        token_ids = self._draw(logprobs, seqs, any(p.greedy for p in distinct))
        chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
        sample = DeviceSample(token_ids, chosen)
        if truncated is not processed:
            sample.thresholds = kept_thresholds(processed, truncated)
            sample.threshold_rows = [s.sampling_params.truncates for s in seqs]
        if any(p.logprobs for p in distinct):
            sample.top_ks = [s.sampling_params.logprobs or 0 for s in seqs]
            sample.top_values, sample.top_indices = logprobs.topk(max(sample.top_ks), dim=-1)
        return sample

    @staticmethod
    def prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor,
                        k: int) -> list[dict[int, float]]:
        """Per row, the raw log-prob of ``target_ids[row]`` (the next prompt token) and the
        top ``k`` (all of them for k beyond the vocabulary): the log-softmax of the model's
        logits, in float32, nothing applied."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = logprobs.gather(1, target_ids[:, None]).squeeze(1).tolist()
        rows = [{token: logprob} for token, logprob in zip(target_ids.tolist(), chosen)]
        if k:
            values, indices = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
            for row, top_ids, top_values in zip(rows, indices.tolist(), values.tolist()):
                row.update(zip(top_ids, top_values))
        return rows

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Repetition penalties over each row's prompt and output, then frequency and
        presence penalties over its output, in place: the tokens go over as index lists,
        every row's penalty in one masked operation (no host read, nothing per row)."""
        rows = len(seqs)
        seen, counted = ([], []), ([], [])
        repetition, frequency, presence = [1.0] * rows, [0.0] * rows, [0.0] * rows
        for row, seq in enumerate(seqs):
            params = seq.sampling_params
            if params.repetition_penalty != 1.0:
                repetition[row] = params.repetition_penalty
                seen[0].extend([row] * len(seq.token_ids))
                seen[1].extend(seq.token_ids)
            if params.presence_penalty or params.frequency_penalty:
                frequency[row], presence[row] = params.frequency_penalty, params.presence_penalty
                counted[0].extend([row] * len(seq.output_token_ids))
                counted[1].extend(seq.output_token_ids)
        if seen[0]:
            mask = torch.zeros_like(logits, dtype=torch.bool)
            mask[self._long(seen[0]), self._long(seen[1])] = True
            penalty = self._floats(repetition)
            logits.copy_(torch.where(mask, torch.where(logits > 0, logits / penalty,
                                                       logits * penalty), logits))
        if any(frequency) or any(presence):
            counts = torch.zeros_like(logits)
            counts.index_put_((self._long(counted[0]), self._long(counted[1])),
                              torch.ones(len(counted[0]), device=logits.device),
                              accumulate=True)
            logits -= self._floats(frequency) * counts \
                + self._floats(presence) * (counts > 0).float()

    def _suppress_stop_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        rows, stops = [], []
        for row, seq in enumerate(seqs):
            params = seq.sampling_params
            # Counting a token still on the device (overlapped steps): this row samples the next.
            if seq.num_tokens - seq.num_prompt_tokens < params.min_tokens and not (
                    seq.matcher is not None and seq.matcher.is_completed()):
                ids = params.stop_token_ids + ([] if params.ignore_eos else self.eos_token_ids)
                rows += [row] * len(ids)
                stops += ids
        if rows:  # one write, its indices copied over as the step's other inputs
            logits[self._long(rows), self._long(stops)] = float("-inf")

    def _apply_temperature(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        temperatures = [s.sampling_params.temperature or 1.0 for s in seqs]
        if all(t == 1.0 for t in temperatures):
            return logits
        return logits / self._floats(temperatures)

    def _truncate(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        sampled = [not s.sampling_params.greedy for s in seqs]
        top_k = [s.sampling_params.top_k if g else 0 for s, g in zip(seqs, sampled)]
        top_p = [s.sampling_params.top_p if g else 1.0 for s, g in zip(seqs, sampled)]
        min_p = [s.sampling_params.min_p if g else 0.0 for s, g in zip(seqs, sampled)]
        if any(top_k):
            logits = apply_top_k(logits, top_k)
        if any(p < 1.0 for p in top_p):
            logits = apply_top_p(logits, self._to_device(torch.tensor(top_p)))
        if any(min_p):
            logits = apply_min_p(logits, self._to_device(torch.tensor(min_p)))
        return logits

    def _draw(self, logprobs: torch.Tensor, seqs: list[Sequence], any_greedy: bool
              ) -> torch.Tensor:
        """Argmax for greedy rows; inverse-CDF sampling with one uniform per row otherwise.

        One uniform per row is cheap (per-element noise costs tens of ms per step on a CPU
        at a 49k vocabulary), and lets each seeded row draw its own: the engine's generator
        draws one for every sampled row, and a seeded row's ``seeded_uniforms`` value
        replaces it (so unseeded rows draw the same whatever rows are seeded).
        """
        device = logprobs.device
        rows = [i for i, s in enumerate(seqs) if not s.sampling_params.greedy] \
            if any_greedy else range(len(seqs))
        if any_greedy or not rows:
            token_ids = logprobs.argmax(dim=-1)
            if not rows:
                return token_ids
        uniform = torch.rand(len(rows), 1, generator=self.generator, device=device)
        row_seqs = seqs if len(rows) == len(seqs) else [seqs[i] for i in rows]
        seeded = [j for j, s in enumerate(row_seqs) if s.seed is not None]
        if seeded:
            every = len(seeded) == len(row_seqs)
            chosen = row_seqs if every else [row_seqs[j] for j in seeded]
            values = self._to_device(seeded_uniforms(  # at each one's output index, pending
                [s.seed for s in chosen],              # tokens counted
                [len(s.token_ids) + s.num_pending_tokens - s.num_prompt_tokens for s in chosen]))
            if every:
                uniform = values[:, None]
            else:
                uniform[long_tensor(seeded, device), 0] = values
        some = len(rows) < len(seqs)
        rows_t = long_tensor(list(rows), device) if some else None
        cdf = (logprobs[rows_t] if some else logprobs).exp().cumsum_(dim=-1)
        # Scaling by the row total absorbs float32 rounding in the cumulative sum; a token of
        # probability 0 adds nothing to the sum, so "first entry above u" never picks it.
        sampled = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(1)
        sampled = sampled.clamp(max=logprobs.shape[1] - 1)
        if not some:
            return sampled
        token_ids[rows_t] = sampled
        return token_ids

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return to_device(tensor, self.device)

    def _long(self, values: list[int]) -> torch.Tensor:
        return long_tensor(values, self.device)

    def _floats(self, values: list[float]) -> torch.Tensor:
        """One float32 per row, as a column on the device."""
        return self._to_device(torch.tensor(values, dtype=torch.float32))[:, None]



_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # splitmix64's constants
_MIX = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over uint64 (array arithmetic wraps modulo 2^64)."""
    z = (z ^ (z >> np.uint64(30))) * _MIX[0]
    z = (z ^ (z >> np.uint64(27))) * _MIX[1]
    return z ^ (z >> np.uint64(31))


def seeded_uniforms(seeds: list[int], counters: list[int]) -> torch.Tensor:
    """One float32 uniform in [0, 1) per ``(seed, counter)`` pair: splitmix64 of the seed,
    then of that plus the counter's step, its top 24 bits (a float32's precision). Seeds
    are taken modulo 2^64."""
    keys = _splitmix64(np.array([s % (1 << 64) for s in seeds], dtype=np.uint64) + _GOLDEN)
    mixed = _splitmix64(keys + np.array(counters, dtype=np.uint64) * _GOLDEN)
    return torch.from_numpy((mixed >> np.uint64(40)).astype(np.float32) * np.float32(2**-24))


def apply_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """``logits`` (rows of a vocabulary) with all but each row's ``top_k`` largest at -inf
    (0: all kept)."""
    k = long_tensor([t or logits.shape[1] for t in top_k], logits.device)
    k = k.clamp(max=logits.shape[1])
    sorted_logits = logits.sort(dim=-1, descending=True).values
    threshold = sorted_logits.gather(1, (k - 1)[:, None])
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``logits`` with each row's tokens outside its smallest set of mass ``top_p`` at -inf
    (the most likely token always kept)."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1.0 - top_p[:, None])
    drop[:, -1] = False  # always keep the most likely token
    return logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """``logits`` with each row's tokens less likely than ``min_p`` times its top one at
    -inf."""
    probs = logits.softmax(dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def kept_thresholds(processed: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """Per row, the logit halfway between the smallest kept and the largest dropped one of
    ``processed`` (``truncated`` is -inf where dropped); -inf when nothing was dropped."""
    kept = torch.isfinite(truncated)
    dropped = ~kept & torch.isfinite(processed)
    lowest_kept = processed.masked_fill(~kept, float("inf")).min(dim=-1).values
    highest_dropped = processed.masked_fill(~dropped, float("-inf")).max(dim=-1).values
    return torch.where(dropped.any(dim=-1), (lowest_kept + highest_dropped) / 2,
                       torch.full_like(lowest_kept, float("-inf")))
