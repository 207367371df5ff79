"""A step's samples while they are still on the device, and their copy to the host.

The sampler leaves its tokens and log-probs on the device (``DeviceSample``): the next step
can read its inputs from them there, and the host learns them from a non-blocking copy to
pinned memory that an event marks done (``HostCopy``), not from a ``.tolist()`` that would
wait for the device to drain. On CPU the copy is the tensors themselves.
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
                routed_experts: dict[int, tuple[int, bytes]] | None = None) -> HostCopy:
        """Start copying every tensor to the host, with the step's prompt log-probs and
        routed experts (already on the host) to hand back with them."""
        tensors = [self.token_ids, self.logprobs, self.top_values, self.top_indices,
                   self.thresholds]
        if self.token_ids.device.type != "cuda":
            return HostCopy(self, tensors, None, prompt_logprobs, routed_experts or {})
        copies = [None if t is None else t.to("cpu", non_blocking=True) for t in tensors]
        event = torch.cuda.Event()
        event.record()
        return HostCopy(self, copies, event, prompt_logprobs, routed_experts or {})


@dataclass(slots=True)
class HostCopy:
    """A ``DeviceSample`` on its way to host memory (``event`` marks the copy's end; None
    on CPU)."""

    sample: DeviceSample
    tensors: list[torch.Tensor | None]
    event: torch.cuda.Event | None
    prompt_logprobs: PromptLogprobs
    routed_experts: dict[int, tuple[int, bytes]]

    def result(self) -> SamplerOutput:
        """Wait for the copy; the samples as plain lists."""
        if self.event is not None:
            self.event.synchronize()
        token_ids, logprobs, top_values, top_indices, thresholds = self.tensors
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
                             self.prompt_logprobs, self.routed_experts)
