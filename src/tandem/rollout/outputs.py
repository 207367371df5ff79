"""What ``generate`` returns (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class SamplerOutput:
    """What the model runner returns for one step (plain lists, no tensors).

    One sampled token per sampling row, its processed log-prob, and the top-k log-probs if
    asked; ``thresholds`` per row the kept set's threshold where top-k / top-p / min-p
    truncated it (None elsewhere; see ``CompletionOutput``); ``prompt_logprobs`` maps a
    batch row to the prompt log-probs its chunk scored (one dict per prompt position, see
    ``RequestOutput.prompt_logprobs``).
    """

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, float] | None]
    thresholds: list[float | None] | None = None
    prompt_logprobs: dict[int, list[dict[int, float]]] = field(default_factory=dict)


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
        """The output as plain JSON-ready data (``from_dict`` reads it back)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestOutput:
        """The output ``to_dict`` wrote, after a JSON round trip (string keys, lists)."""
        outputs = [CompletionOutput(**{
            **completion,
            "top_logprobs": _int_keys(completion["top_logprobs"]),
            "weight_versions": _pair(completion["weight_versions"])})
            for completion in data["outputs"]]
        prompt_logprobs = data.get("prompt_logprobs")
        if prompt_logprobs is not None:
            prompt_logprobs = [None, *_int_keys(prompt_logprobs[1:])]
        return cls(**{**data, "outputs": outputs, "prompt_logprobs": prompt_logprobs})


def _int_keys(top_logprobs: list[dict[str, float]] | None) -> list[dict[int, float]] | None:
    if top_logprobs is None:
        return None
    return [{int(token_id): logprob for token_id, logprob in entry.items()}
            for entry in top_logprobs]


def _pair(versions: list[int] | None) -> tuple[int, int] | None:
    return None if versions is None else (versions[0], versions[1])
