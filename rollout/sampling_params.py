"""Sampling parameters of one request, validated when built (vLLM's names and meanings)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    """How to sample the completions of one prompt.

    Attributes follow vLLM: ``n`` completions per prompt (a *group* when n > 1),
    ``temperature`` (0 means greedy), ``top_p``, ``top_k`` (0 or -1 disables), ``min_p``,
    ``repetition_penalty`` (over prompt and output, 1 disables), ``presence_penalty`` and
    ``frequency_penalty`` (over the output, 0 disables), ``max_tokens``, ``min_tokens`` (EOS and
    stop tokens are suppressed before it), ``stop`` strings, ``stop_token_ids``,
    ``ignore_eos``, ``seed`` (per-request generator), ``logprobs`` (None: none returned; 0: the
    sampled token's processed log-prob; k > 0: also the top k), ``prompt_logprobs`` (None:
    none; 0: each prompt token's log-prob under the model given the tokens before it, raw:
    no penalty, temperature or truncation; k > 0: also the top k at each position; such a
    prompt is computed in full, never served from the prefix cache) and
    ``skip_special_tokens``.

    Raises:
        ValueError: on any value outside its range, naming the field and the valid range.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        _check(self.n >= 1, "n", self.n, "an integer >= 1")
        _check(self.temperature >= 0.0, "temperature", self.temperature, ">= 0 (0 is greedy)")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "in (0, 1]")
        _check(self.top_k >= 0, "top_k", self.top_k, ">= 0 (0 or -1 disables)")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "in [0, 1]")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", self.repetition_penalty, "> 0")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty,
               "in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               self.frequency_penalty, "in [-2, 2]")
        _check(self.max_tokens >= 1, "max_tokens", self.max_tokens, "an integer >= 1")
        _check(0 <= self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
               f"in [0, max_tokens={self.max_tokens}]")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
               "a list of non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", self.stop_token_ids, "a list of token ids >= 0")
        _check(self.logprobs is None or self.logprobs >= 0, "logprobs", self.logprobs,
               "None, 0 (the sampled token) or k > 0 (also the top k)")
        _check(self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs",
               self.prompt_logprobs, "None, 0 (each prompt token) or k > 0 (also the top k)")

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax token (temperature 0)."""
        return self.temperature == 0.0


def _check(ok: bool, name: str, value: object, valid: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r} is invalid: it must be {valid}.")
