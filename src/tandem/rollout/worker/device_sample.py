"""A step's samples while they are still on the device, and their copy to the host.

The sampler leaves its tokens and log-probs on the device (``DeviceSample``): the next step
can read its inputs from them there, and the host learns them from a non-blocking copy to
pinned memory that an event marks done (``HostCopy``), not from a ``.tolist()`` that would
wait for the device to drain. On CPU the copy is the tensors themselves (``.to`` returns
them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..outputs import SamplerOutput

PromptLogprobs = dict[int, list[dict[int, float]]]


@dataclass(slots=True)
class DeviceSample:
    """One token per sampling row and its processed log-prob; the top log-probs
    (``top_values``, ``top_indices``: ``[rows, max k]``) when a row asked, with each row's
    ``top_ks``; the truncation ``thresholds`` of the rows ``threshold_rows`` marks."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    top_values: torch.Tensor | None = None
    top_indices: torch.Tensor | None = None
    top_ks: list[int] | None = None
    thresholds: torch.Tensor | None = None
    threshold_rows: list[bool] | None = None

    def to_host(self, prompt_logprobs: PromptLogprobs,
                routed: RoutedExperts | None = None) -> HostCopy:
        """Start copying every tensor to the host, the step's routed experts with them, and
        keep its prompt log-probs (already on the host) to hand back with them."""
        tensors = [self.token_ids, self.logprobs, self.top_values, self.top_indices,
                   self.thresholds, None if routed is None else routed.experts]
        copies = [None if t is None else t.to("cpu", non_blocking=True) for t in tensors]
        return HostCopy(self, copies, copied_event(self.token_ids.device), prompt_logprobs,
                        {} if routed is None else routed.chunks)


@dataclass(slots=True)
class RoutedExperts:
    """A step's routing on the device: the experts of its tokens ``[tokens, layers, top_k]``
    (encoded, ``ModelRunner.routing``), and per batch row that records its routing, its
    chunk's first position, first token and token count."""

    experts: torch.Tensor
    chunks: dict[int, tuple[int, int, int]]

    @staticmethod
    def encode(experts: torch.Tensor, chunks: dict[int, tuple[int, int, int]]
               ) -> dict[int, tuple[int, bytes]]:
        """Per row of ``chunks``, its first position and its tokens' experts as bytes, from
        ``experts`` on the host."""
        return {row: (position, experts[first:first + count].numpy().tobytes())
                for row, (position, first, count) in chunks.items()}


def copied_event(device: torch.device) -> torch.cuda.Event | None:
    """An event marking the end of the copies queued so far on ``device``'s current stream
    (the stream a copy from a tensor of ``device`` runs on, whichever device this thread
    calls current), which ``synchronize`` waits for without spinning a core; None off
    CUDA, where a copy is done when it returns."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(blocking=True)
    event.record(torch.cuda.current_stream(device))
    return event


@dataclass(slots=True)
class HostCopy:
    """A ``DeviceSample`` on its way to host memory (``event`` marks the copy's end; None
    on CPU), with the step's routing chunks (``RoutedExperts``; its experts the last of
    ``tensors``)."""

    sample: DeviceSample
    tensors: list[torch.Tensor | None]
    event: torch.cuda.Event | None
    prompt_logprobs: PromptLogprobs
    routed_chunks: dict[int, tuple[int, int, int]]

    def result(self) -> SamplerOutput:
        """Wait for the copy; the samples as plain lists."""
        if self.event is not None:
            self.event.synchronize()
        token_ids, logprobs, top_values, top_indices, thresholds, experts = self.tensors
        sample = self.sample
        num_rows = len(token_ids)
        top: list[dict[int, float] | None] = [None] * num_rows
        if top_values is not None:
            values, indices = top_values.tolist(), top_indices.tolist()
            top = [dict(zip(indices[row][:k], values[row][:k])) if k else None
                   for row, k in enumerate(sample.top_ks)]
        kept = None
        if thresholds is not None:
            kept = [value if row else None
                    for value, row in zip(thresholds.tolist(), sample.threshold_rows)]
        return SamplerOutput(token_ids.tolist(), logprobs.tolist(), top, kept,
                             self.prompt_logprobs,
                             {} if experts is None else RoutedExperts.encode(experts,
                                                                             self.routed_chunks))
