"""What ``generate`` returns (vLLM's shapes)."""

from __future__ import annotations

import base64
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

# How a model's routing is encoded: its MoE layers, the experts per token, the dtype
# (uint8 up to 256 experts, int16 beyond).
RoutingFormat = tuple[int, int, torch.dtype]


@dataclass(slots=True)
class SamplerOutput:
    """What the model runner returns for one step (plain lists, no tensors).

    One sampled token per sampling row, its processed log-prob, and the top-k log-probs if
    asked; ``thresholds`` per row the kept set's threshold where top-k / top-p / min-p
    truncated it (None elsewhere; see ``CompletionOutput``); ``prompt_logprobs`` maps a
    batch row to the prompt log-probs its chunk scored (one dict per prompt position, see
    ``RequestOutput.prompt_logprobs``); ``routed_experts`` maps a batch row that records
    its routing to its chunk's first position and the chunk's experts, encoded (see
    ``ModelRunner.routing``).
    """

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float] | None]
    thresholds: list[float | None] | None = None
    prompt_logprobs: dict[int, list[dict[int, float]]] = field(default_factory=dict)
    routed_experts: dict[int, tuple[int, bytes]] = field(default_factory=dict)


@dataclass(slots=True)
class CompletionOutput:
    """One completion of a prompt.

    ``token_ids`` end with the EOS or stop token that ended the sequence (a trainer must learn
    to stop); ``text`` leaves it (and a matched stop string) out. ``logprobs`` holds one float
    per token, the sampled token's processed log-prob, when the request asked for log-probs;
    ``top_logprobs`` one dict per token when it asked for k > 0. ``weight_versions`` are the
    engine's weight versions at the first and the last sampled token;
    ``token_weight_versions`` the version each token was sampled under (they differ when a
    sequence decodes across a weight update). ``sampling_thresholds`` (requests that
    truncate with top-k, top-p or min-p) give per token the logit, after penalties and
    temperature, halfway between the last kept and the first dropped token: the kept set is
    every token at or above it, so a trainer rebuilds the truncated distribution exactly.
    """

    index: int
    token_ids: list[int]
    text: str
    cumulative_logprob: float | None
    logprobs: list[float] | None
    top_logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    weight_versions: tuple[int, int] | None = None
    token_weight_versions: list[int] = field(default_factory=list)
    sampling_thresholds: list[float] | None = None
    routed_experts: torch.Tensor | None = None


@dataclass(slots=True)
class RequestOutput:
    """All completions of one prompt, in child order.

    ``weight_version`` is the newest weight version any of its tokens was sampled under.
    ``prompt_logprobs`` (when the request asked, vLLM's shape) holds None for the first
    prompt token, then for each later one a dict of its log-prob under the model given the
    tokens before it (raw: no penalty, temperature or truncation) and the top k there.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    weight_version: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The output as plain JSON-ready data (``from_dict`` reads it back); routed
        experts as ``{"dtype", "shape", "data"}``, the bytes in base64."""
        return asdict(self, dict_factory=_json_values)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestOutput:
        """The output ``to_dict`` wrote, after a JSON round trip (string keys, lists)."""
        outputs = [CompletionOutput(**{
            **completion,
            "top_logprobs": _int_keys(completion["top_logprobs"]),
            "weight_versions": _pair(completion["weight_versions"]),
            "routed_experts": _tensor(completion.get("routed_experts"))})
            for completion in data["outputs"]]
        prompt_logprobs = data.get("prompt_logprobs")
        if prompt_logprobs is not None:
            prompt_logprobs = [None, *_int_keys(prompt_logprobs[1:])]
        return cls(**{**data, "outputs": outputs, "prompt_logprobs": prompt_logprobs})


def _json_values(items: list[tuple[str, Any]]) -> dict[str, Any]:
    return {key: _encoded(value) if isinstance(value, torch.Tensor) else value
            for key, value in items}


def _encoded(tensor: torch.Tensor) -> dict[str, Any]:
    return {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape),
            "data": base64.b64encode(tensor.contiguous().numpy().tobytes()).decode()}


def _tensor(encoded: dict[str, Any] | None) -> torch.Tensor | None:
    if encoded is None:
        return None
    dtype = {"uint8": torch.uint8, "int16": torch.int16}[encoded["dtype"]]
    data = bytearray(base64.b64decode(encoded["data"]))
    return torch.frombuffer(data, dtype=dtype).view(encoded["shape"]) if data \
        else torch.empty(encoded["shape"], dtype=dtype)


def _int_keys(top_logprobs: list[dict[str, float]] | None) -> list[dict[int, float]] | None:
    if top_logprobs is None:
        return None
    return [{int(token_id): logprob for token_id, logprob in entry.items()}
            for entry in top_logprobs]


def _pair(versions: list[int] | None) -> tuple[int, int] | None:
    return None if versions is None else (versions[0], versions[1])
