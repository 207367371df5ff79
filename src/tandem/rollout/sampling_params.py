"""Sampling parameters of one request, validated when built (vLLM's names and meanings)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .structured_outputs import StructuredOutputsParams, as_structured_outputs


@dataclass(slots=True)
class SamplingParams:
    """How to sample the completions of one prompt, with vLLM's names and meanings.

    Each field's help is in its metadata (``help``), which the server's request schema
    carries too.

    Raises:
        ValueError: on any value outside its range, naming the field and the valid range.
    """

    n: int = field(default=1, metadata={"help": "completions per prompt (a group when > 1)."})
    temperature: float = field(default=1.0, metadata={"help": "0 means greedy."})
    top_p: float = field(default=1.0, metadata={"help": "the nucleus: top probability mass kept."})
    top_k: int = field(default=0, metadata={"help": "the k most likely kept (0 or -1: all)."})
    min_p: float = field(default=0.0, metadata={"help": (
        "keep tokens at least min_p times as likely as the most likely one.")})
    repetition_penalty: float = field(default=1.0, metadata={"help": (
        "divides the logits of tokens seen in prompt or output (1 disables).")})
    presence_penalty: float = field(default=0.0, metadata={"help": "once per output token seen."})
    frequency_penalty: float = field(default=0.0, metadata={"help": "per output occurrence."})
    max_tokens: int = field(default=16, metadata={"help": "most tokens per completion."})
    min_tokens: int = field(default=0, metadata={"help": (
        "EOS and stop tokens are suppressed before this many tokens.")})
    stop: list[str] = field(default_factory=list, metadata={"help": (
        "strings that end a completion (left out of its text).")})
    stop_token_ids: list[int] = field(default_factory=list, metadata={"help": (
        "token ids that end a completion (kept in its token ids).")})
    include_stop_str_in_output: bool = field(default=False, metadata={"help": (
        "keep what ended the completion in its text: the matched stop string, or the "
        "stop token's text (a special token is still left out by skip_special_tokens).")})
    ignore_eos: bool = field(default=False, metadata={"help": "generate past EOS."})
    seed: int | None = field(default=None, metadata={"help": (
        "this request's own seed: its k-th token draws from (seed, k) alone (None: the "
        "engine's generator).")})
    logprobs: int | None = field(default=None, metadata={"help": (
        "None: no log-probs; 0: each sampled token's processed log-prob; k > 0: also the "
        "top k.")})
    prompt_logprobs: int | None = field(default=None, metadata={"help": (
        "None: none; 0: each prompt token's log-prob under the model given the tokens "
        "before it, raw (no penalty, temperature or truncation); k > 0: also the top k at "
        "each position. Such a prompt is computed in full, never served from the prefix "
        "cache.")})
    return_routed_experts: bool = field(default=False, metadata={"help": (
        "(mixture-of-experts models) return, per position of prompt and completion whose "
        "forward ran, the top-k experts each MoE layer routed it to (routing replay). Such "
        "a prompt is computed in full, never served from the prefix cache.")})
    skip_special_tokens: bool = field(default=True, metadata={"help": (
        "leave special tokens out of the text.")})
    structured_outputs: StructuredOutputsParams | None = field(default=None, metadata={
        "help": (
            "constrain each completion to a JSON schema (json), a regex, one of a choice "
            "list, an EBNF grammar, any JSON object (json_object) or a structural tag "
            "(xgrammar's); the log-probs are those of the constrained distribution.")})

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.structured_outputs = as_structured_outputs(self.structured_outputs)
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

    @property
    def truncates(self) -> bool:
        """True when sampling keeps only part of the vocabulary (top-k, top-p or min-p)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)


def _check(ok: bool, name: str, value: object, valid: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r} is invalid: it must be {valid}.")
