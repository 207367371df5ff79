"""From a user's prompt to checked token ids, once: the one place prompts are tokenized.

Every entry point (``LLM.generate``, the server's routes, ``/v1/rollouts``, the TRL shim)
hands its prompts to ``InputProcessor.process``, which tokenizes text (or checks given ids)
and checks the length against the model and the KV pool. The result, a ``ProcessedPrompt``,
is what ``LLMEngine.add_request`` queues without looking at it again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from .sampling_params import SamplingParams
from .structured_outputs import Grammar, GrammarCache

Prompt = str | list[int]


@dataclass(frozen=True, slots=True)
class ProcessedPrompt:
    """A prompt ready to queue: its token ids and, when it came as text, the text."""

    prompt_token_ids: list[int]
    prompt: str | None = None


class InputProcessor:
    """Tokenizes and checks prompts for one engine.

    Args:
        tokenizer: the model's tokenizer (None when the folder has none: ids only).
        vocab_size: the model's vocabulary (token ids must lie below it).
        max_model_len: the longest sequence; a prompt must leave room for one new token.
        stop_token_ids: the tokens that end a completion (a grammar allows them at its end).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int,
                 max_model_len: int, stop_token_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.grammars = GrammarCache(tokenizer, vocab_size, sorted(stop_token_ids))

    def grammar(self, params: SamplingParams) -> Grammar | None:
        """The compiled constraint of a request's ``structured_outputs`` (None without one).

        Raises:
            ValueError: as ``GrammarCache.get``.
        """
        spec = params.structured_outputs
        return None if spec is None else self.grammars.get(spec)

    def process(self, prompt: Prompt | ProcessedPrompt) -> ProcessedPrompt:
        """The checked token ids of a prompt given as text, ids, or already processed.

        Text is encoded with the tokenizer's special tokens (such as BOS), as vLLM does.

        Raises:
            ValueError: for text without a tokenizer, ids outside the vocabulary, or a
                prompt that is empty or leaves no room under max_model_len.
        """
        if isinstance(prompt, ProcessedPrompt):
            return prompt
        if isinstance(prompt, str):
            processed = ProcessedPrompt(self._encode(prompt), prompt)
        else:
            processed = ProcessedPrompt(self._checked_ids(prompt))
        self._check_length(processed.prompt_token_ids)
        return processed

    def apply_chat_template(self, conversation: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The token ids of a conversation under the model's chat template, with ``tools``
        (OpenAI's ``{"type": "function", "function": {...}}`` dicts) rendered by it.

        The template supplies the special tokens (nothing is added on top). Jinja ignores
        a variable a template does not read, so a template that ignores ``tools`` is told by
        rendering the conversation without them too: the same text means it ignores them.

        Raises:
            ValueError: when the model has no tokenizer or chat template, the template
                refuses the messages, or it ignores ``tools``.
        """
        if tools and (self._chat_template(conversation, add_generation_prompt, tools, False)
                      == self._chat_template(conversation, add_generation_prompt, None, False)):
            raise ValueError("this model's chat template does not render tools (the prompt is "
                             "the same without them): leave tools out and describe them in a "
                             "message, or serve a model whose template renders them.")
        return self._chat_template(conversation, add_generation_prompt, tools, True)

    def _chat_template(self, conversation: list[dict[str, Any]], add_generation_prompt: bool,
                       tools: list[dict[str, Any]] | None, tokenize: bool) -> Any:
        tokenizer = self.tokenizer
        if tokenizer is None or not tokenizer.chat_template:
            raise ValueError("this model has no chat template: give a prompt instead.")
        try:
            rendered = tokenizer.apply_chat_template(
                conversation, tools=tools, tokenize=tokenize, return_dict=False,
                add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # jinja's errors, and a template's own raise_exception
            raise ValueError(f"the chat template refused the messages: {exc}") from exc
        return list(rendered) if tokenize else rendered

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer: pass prompts as token ids.")
        return self.tokenizer.encode(text)

    def _checked_ids(self, token_ids: object) -> list[int]:
        if not isinstance(token_ids, list | tuple):
            raise ValueError(f"a prompt is a text or a list of token ids, not "
                             f"{type(token_ids).__name__} ({token_ids!r:.40}).")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size
                   for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size}) "
                             "(not booleans).")
        return list(token_ids)

    def _check_length(self, token_ids: list[int]) -> None:
        """The pool always holds one max_model_len sequence (checked at start), so a prompt
        that leaves room under max_model_len also fits the pool."""
        num_tokens = len(token_ids)
        if num_tokens == 0:
            raise ValueError("the prompt is empty: give at least one token.")
        if num_tokens >= self.max_model_len:
            raise ValueError(f"the prompt has {num_tokens} tokens, but max_model_len="
                             f"{self.max_model_len} (which the KV pool is sized to hold) leaves "
                             "no room for a new token: shorten the prompt, or raise "
                             "max_model_len and the KV budget (num_kv_blocks or "
                             "kv_cache_memory_bytes).")


def check_request_lists(request_ids: Sequence[str], prompts: Sequence[Any],
                        params: Sequence[SamplingParams], max_num_seqs: int) -> None:
    """Check one call's requests among themselves: one id, prompt and ``SamplingParams``
    each, distinct ids, and each group (``n``) within ``max_num_seqs``.

    Raises:
        ValueError: naming what to change.
    """
    if not len(request_ids) == len(prompts) == len(params):
        raise ValueError(f"{len(request_ids)} request ids, {len(prompts)} prompts and "
                         f"{len(params)} sampling params: give one of each per request.")
    for p in params:
        if p.n > max_num_seqs:
            raise ValueError(f"n={p.n} exceeds max_num_seqs={max_num_seqs} (a group runs in "
                             "one batch): lower n or raise max_num_seqs.")
    if len(set(request_ids)) != len(request_ids):
        raise ValueError("request ids repeat within one call: give each its own id.")
