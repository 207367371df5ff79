"""What the server holds per request: ``TrackedRequest`` (where its outputs arrive, its
latency marks) and, when it streams, ``StreamedOutput``: its output so far, grown from the
``TokenDelta``s the engine core reports, and read as one snapshot whenever the stream's
consumer is ready for its next chunk.

The core sends only new token ids and log-probs; the text is decoded here, off the
engine's path, and only when a chunk is written: a consumer that fell behind several steps
decodes once and writes one chunk carrying every token since its last.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from ..input_processor import ProcessedPrompt
from ..outputs import CompletionOutput, RequestOutput
from ..sampling_params import SamplingParams
from .admission import Deadline
from .core_messages import TokenDelta


@dataclass(slots=True)
class _Completion:
    """One completion's tokens so far, and its text as of the last snapshot."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[dict[int, float]] | None = None
    token_weight_versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""
    num_decoded: int = 0

    def add(self, delta: TokenDelta) -> None:
        self.token_ids += delta.token_ids
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        if delta.top_logprobs is not None:
            self.top_logprobs = (self.top_logprobs or []) + delta.top_logprobs
        self.token_weight_versions += delta.token_weight_versions
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
            self.text, self.num_decoded = delta.text or "", len(self.token_ids)


class StreamedOutput:
    """A streamed request's output so far.

    Args:
        request_id: the request's id.
        prompt: its processed prompt.
        params: its sampling parameters (``skip_special_tokens`` decides the text).
        tokenizer: decodes the text (None: no text, as the engine's).
    """

    def __init__(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                 tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.tokenizer = tokenizer
        self.completions: dict[int, _Completion] = {}
        self.fresh = False  # tokens arrived since the last snapshot

    def add(self, deltas: list[TokenDelta]) -> None:
        """Append what the core reported."""
        for delta in deltas:
            completion = self.completions.get(delta.index)
            if completion is None:
                completion = self.completions[delta.index] = _Completion(delta.index)
            completion.add(delta)
        self.fresh = True

    def snapshot(self, weight_version: int) -> RequestOutput:
        """The output so far (``finished`` False), as ``LLMEngine.request_output`` gives it:
        each unfinished completion's text is its tokens decoded whole."""
        self.fresh = False
        outputs = [self._completion(self.completions[i]) for i in sorted(self.completions)]
        versions = [c.token_weight_versions[-1] for c in outputs if c.token_weight_versions]
        return RequestOutput(self.request_id, self.prompt.prompt, self.prompt.prompt_token_ids,
                             outputs, finished=False,
                             weight_version=max(versions, default=weight_version))

    def _completion(self, completion: _Completion) -> CompletionOutput:
        if completion.num_decoded != len(completion.token_ids) and self.tokenizer is not None:
            completion.text = self.tokenizer.decode(
                completion.token_ids, skip_special_tokens=self.params.skip_special_tokens)
            completion.num_decoded = len(completion.token_ids)
        versions = completion.token_weight_versions
        return CompletionOutput(  # copies: the lists grow on, the snapshot stays
            index=completion.index, token_ids=list(completion.token_ids),
            text=completion.text, cumulative_logprob=None,
            logprobs=_copy(completion.logprobs), top_logprobs=_copy(completion.top_logprobs),
            finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
            weight_versions=(versions[0], versions[-1]) if versions else None,
            token_weight_versions=list(versions))


def _copy(values: list | None) -> list | None:
    return None if values is None else list(values)


@dataclass(slots=True)
class TrackedRequest:
    """A request the server follows: its id, what arrived for it (``streamed``: a streamed
    request's tokens so far; ``final``: its final output, or the exception that ended it),
    ``ready`` (set when either changed), and its latency marks (``scheduled_time``: the
    start of the first step that scheduled it)."""

    request_id: str
    stream: bool
    arrival: float
    deadline: Deadline | None = None
    streamed: StreamedOutput | None = None
    final: RequestOutput | BaseException | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    num_output_tokens: int = 0
    last_token_time: float | None = None
    scheduled_time: float | None = None

    def end(self, final: RequestOutput | BaseException) -> None:
        """Deliver the final output (or the error that ended the request)."""
        self.final = final
        self.ready.set()

    def take(self, weight_version: int) -> RequestOutput | BaseException | None:
        """The final output (or error) once there; else a snapshot when tokens arrived
        since the last one; else None."""
        if self.final is not None:
            return self.final
        if self.streamed is not None and self.streamed.fresh:
            return self.streamed.snapshot(weight_version)
        return None
