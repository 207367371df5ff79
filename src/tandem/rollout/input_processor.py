"""From a user's prompt to checked token ids, once: the one place prompts are tokenized.

Every entry point (``LLM.generate``, the server's routes, ``/v1/rollouts``, the TRL shim)
hands its prompts to ``InputProcessor.process``, which tokenizes text (or checks given ids)
and checks the length against the model and the KV pool. The result, a ``ProcessedPrompt``,
is what ``LLMEngine.add_request`` queues without looking at it again. Conversations become
ids by ``apply_chat_template``; the server's ``/tokenize`` and ``/detokenize`` use the same
``encode``, ``apply_chat_template`` and ``decode``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from .sampling_params import SamplingParams
from .structured_outputs import Grammar, GrammarCache

Prompt = str | list[int]
# ``apply_chat_template``'s own arguments (``tokenize``, ``chat_template``, ``padding``, ...):
# ``chat_template_kwargs`` may not set them, only variables the template reads (``documents``
# is one: transformers hands it to the template as it is).
TEMPLATE_ARGUMENTS = frozenset(
    name for name, parameter in inspect.signature(
        PreTrainedTokenizerBase.apply_chat_template).parameters.items()
    if parameter.kind is not inspect.Parameter.VAR_KEYWORD and name not in ("self", "documents"))


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
            processed = ProcessedPrompt(self.encode(prompt), prompt)
        else:
            processed = ProcessedPrompt(self._checked_ids(prompt))
        self._check_length(processed.prompt_token_ids)
        return processed

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of ``text``, with the tokenizer's special tokens (such as BOS)
        unless ``add_special_tokens`` is False; what ``process`` queues for a text prompt.

        Raises:
            ValueError: when the model folder has no tokenizer.
        """
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer: pass prompts as token ids.")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``, special tokens included.

        Raises:
            ValueError: when the model folder has no tokenizer, or for an id outside the
                vocabulary (naming it).
        """
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer: it cannot decode.")
        self._check_vocabulary(token_ids, "token ids")
        return self.tokenizer.decode(token_ids)

    def apply_chat_template(self, conversation: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, *,
                            continue_final_message: bool = False,
                            add_special_tokens: bool = False,
                            chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """The token ids of a conversation under the model's chat template, with ``tools``
        (OpenAI's ``{"type": "function", "function": {...}}`` dicts) rendered by it.

        ``continue_final_message`` leaves the last message open (no end-of-turn marker after
        its content), so a completion continues it; it excludes ``add_generation_prompt``.
        ``chat_template_kwargs`` are further variables the template reads (such as Qwen 3's
        ``enable_thinking``). The template supplies the special tokens; ``add_special_tokens``
        adds the tokenizer's own (such as BOS) on top, as vLLM's. Jinja ignores a variable a
        template does not read, so a template that ignores ``tools`` is told by rendering the
        conversation without them too: the same text means it ignores them.

        Raises:
            ValueError: when the model has no tokenizer or chat template, the template
                refuses the messages, it ignores ``tools``, ``continue_final_message`` and
                ``add_generation_prompt`` are both true, or ``chat_template_kwargs`` sets one
                of ``apply_chat_template``'s own arguments.
        """
        variables = _template_variables(add_generation_prompt, continue_final_message,
                                        chat_template_kwargs)
        if tools and (self._chat_template(conversation, tools, variables, False)
                      == self._chat_template(conversation, None, variables, False)):
            raise ValueError("this model's chat template does not render tools (the prompt is "
                             "the same without them): leave tools out and describe them in a "
                             "message, or serve a model whose template renders them.")
        if add_special_tokens:
            return self.encode(self._chat_template(conversation, tools, variables, False))
        return self._chat_template(conversation, tools, variables, True)

    def _chat_template(self, conversation: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None, variables: dict[str, Any],
                       tokenize: bool) -> Any:
        tokenizer = self.tokenizer
        if tokenizer is None or not tokenizer.chat_template:
            raise ValueError("this model has no chat template: give a prompt instead.")
        try:
            rendered = tokenizer.apply_chat_template(
                conversation, tools=tools, tokenize=tokenize, return_dict=False, **variables)
        except Exception as exc:  # jinja's errors, and a template's own raise_exception
            raise ValueError(f"the chat template refused the messages: {exc}") from exc
        return list(rendered) if tokenize else rendered

    def _checked_ids(self, token_ids: object) -> list[int]:
        if not isinstance(token_ids, list | tuple):
            raise ValueError(f"a prompt is a text or a list of token ids, not "
                             f"{type(token_ids).__name__} ({token_ids!r:.40}).")
        self._check_vocabulary(token_ids, "prompt token ids")
        return list(token_ids)

    def _check_vocabulary(self, token_ids: Sequence[object], what: str) -> None:
        """Raise ValueError naming the first of ``token_ids`` that is not an id of the
        vocabulary (an integer in [0, vocab_size), not a boolean)."""
        for position, token_id in enumerate(token_ids):
            if not (isinstance(token_id, int) and not isinstance(token_id, bool)
                    and 0 <= token_id < self.vocab_size):
                raise ValueError(f"{what} must be integers in [0, {self.vocab_size}) (this "
                                 f"model's vocabulary; not booleans): {token_id!r}, at "
                                 f"position {position}, is not.")

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


def _template_variables(add_generation_prompt: bool, continue_final_message: bool,
                        chat_template_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """What the chat template reads besides the messages and tools.

    Raises:
        ValueError: for both ``add_generation_prompt`` and ``continue_final_message``, or
            ``chat_template_kwargs`` setting one of ``TEMPLATE_ARGUMENTS``.
    """
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be "
                         "true (add_generation_prompt defaults to true): set "
                         "add_generation_prompt to false to continue the last message.")
    reserved = sorted(TEMPLATE_ARGUMENTS.intersection(chat_template_kwargs or {}))
    if reserved:
        raise ValueError(f"chat_template_kwargs cannot set {', '.join(reserved)}: they are "
                         "apply_chat_template's own arguments, not template variables (use "
                         "the request's add_generation_prompt, continue_final_message and "
                         "tools).")
    return {**(chat_template_kwargs or {}), "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message}


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


class InputMethods:
    """What an engine offers its callers of its input processing, through its
    ``input_processor``: ``LLMEngine``'s, and the server's mirror of an engine in another
    process (which tokenizes in the server's), so the routes call one set of methods."""

    input_processor: InputProcessor

    def process_prompt(self, prompt: Prompt | ProcessedPrompt) -> ProcessedPrompt:
        """Tokenize (text) or check (ids) a prompt once; see ``InputProcessor.process``.

        Raises:
            ValueError: for a prompt the engine cannot take (naming the fix).
        """
        return self.input_processor.process(prompt)

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, *,
                            continue_final_message: bool = False,
                            add_special_tokens: bool = False,
                            chat_template_kwargs: dict | None = None) -> list[int]:
        """The token ids of a conversation (and ``tools``) under the model's chat template;
        the options and the ValueError as ``InputProcessor.apply_chat_template``."""
        return self.input_processor.apply_chat_template(
            conversation, add_generation_prompt, tools,
            continue_final_message=continue_final_message,
            add_special_tokens=add_special_tokens, chat_template_kwargs=chat_template_kwargs)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of ``text`` (``InputProcessor.encode``; ValueError as it)."""
        return self.input_processor.encode(text, add_special_tokens)

    def decode(self, token_ids: list[int]) -> str:
        """The text of ``token_ids`` (``InputProcessor.decode``; ValueError as it)."""
        return self.input_processor.decode(token_ids)

    def token_strings(self, token_ids: list[int]) -> list[str]:
        """Each token's string in the vocabulary (the tokenizer's ``convert_ids_to_tokens``)."""
        return self.input_processor.tokenizer.convert_ids_to_tokens(token_ids)
