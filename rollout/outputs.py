"""What ``generate`` returns (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    """One completion of a prompt.

    ``token_ids`` end with the EOS or stop token that ended the sequence (a trainer must learn
    to stop); ``text`` leaves it (and a matched stop string) out. ``logprobs`` holds one float
    per token, the sampled token's processed log-prob, when the request asked for log-probs;
    ``top_logprobs`` one dict per token when it asked for k > 0. ``weight_versions`` are the
    engine's weight versions at the first and the last sampled token.
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


@dataclass(slots=True)
class RequestOutput:
    """All completions of one prompt, in child order.

    ``weight_version`` is the newest weight version any of its tokens was sampled under.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    weight_version: int = 0
