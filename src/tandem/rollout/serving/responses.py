"""The bodies of OpenAI's successful responses, built from ``RequestOutput``s: whole
completions and chat completions, streamed chunks (``DeltaTracker`` cuts a request's
successive outputs into deltas) and ``usage``. Where tool calls are parsed, a chat
completion's text is cut by ``ToolCallParser`` into ``content`` and OpenAI's ``tool_calls``
(in a stream, each call as one delta once it is closed), and a completion that called a tool
finishes with ``"tool_calls"``.

Beyond OpenAI's fields, every body carries Tandem's ``weight_version`` and every choice the
``weight_versions`` its tokens were sampled under, so a trainer can see which weights
sampled a rollout.

vLLM's extras, as its server writes them (vllm/entrypoints/openai/completion/serving.py
and chat_completion/serving.py): with ``echo`` a completion choice starts with its prompt
(text, tokens and, with log-probs, the prompt's own: the first token's null) and a chat
reply with the last message's content; ``prompt_logprobs`` per prompt position as
``{token id: {"logprob", "rank", "decoded_token"}}``; ``return_tokens_as_token_ids``
names log-prob tokens ``token_id:N``. A completion's ``top_logprobs`` hold, as OpenAI's
and vLLM's, the chosen token and up to ``logprobs`` more.
"""

from __future__ import annotations

import itertools
import json
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from ..outputs import CompletionOutput, RequestOutput
from ..tool_calls import ToolCall, ToolCallParser

# JSON has no infinity: -inf (a top log-prob of a token the sampler dropped, the threshold of
# a step that dropped nothing) is sent as vLLM's stand-in.
NEGATIVE_INFINITY_IN_JSON = -9999.0


def json_safe(value: Any) -> Any:
    """``value`` (JSON-ready data) with every -inf float as ``NEGATIVE_INFINITY_IN_JSON``."""
    if isinstance(value, float):
        return NEGATIVE_INFINITY_IN_JSON if value == float("-inf") else value
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(item) for item in value]
    return value


def sse_event(payload: dict[str, Any]) -> str:
    """One server-sent event carrying ``payload`` as ``json_safe`` JSON."""
    try:  # most chunks hold no -inf: one pass in C, not a walk of every value first
        body = json.dumps(payload, allow_nan=False)
    except ValueError:
        body = json.dumps(json_safe(payload), allow_nan=False)
    return f"data: {body}\n\n"


@dataclass(slots=True)
class DeltaTracker:
    """Turns a request's successive outputs into per-completion deltas for a stream.

    A delta is a ``CompletionOutput`` holding only what is new: tokens, their log-probs and
    text. Text that might still turn into a stop string (its last ``hold_back``
    characters) or an unfinished UTF-8 character waits, so the streamed text adds up to
    the final text.
    """

    hold_back: int
    sent_tokens: dict[int, int] = field(default_factory=dict)
    sent_text: dict[int, str] = field(default_factory=dict)
    done: set[int] = field(default_factory=set)

    def deltas(self, output: RequestOutput) -> list[CompletionOutput]:
        """What each completion added since the last call (completions with nothing new
        left out); a finished completion's delta carries its finish reason, once."""
        deltas = []
        for completion in output.outputs:
            if completion.index in self.done:
                continue
            delta = self._delta(completion)
            if delta.token_ids or delta.text or delta.finish_reason:
                deltas.append(delta)
        return deltas

    def _delta(self, completion: CompletionOutput) -> CompletionOutput:
        index = completion.index
        start = self.sent_tokens.get(index, 0)
        sent = self.sent_text.get(index, "")
        if completion.finish_reason is None:
            ready = completion.text[:max(len(completion.text) - self.hold_back, 0)]
            text = ready.rstrip("\ufffd")[len(sent):]
        else:
            text = completion.text[len(sent):]
            self.done.add(index)
        self.sent_tokens[index] = len(completion.token_ids)
        self.sent_text[index] = sent + text
        return replace(completion, token_ids=completion.token_ids[start:], text=text,
                       logprobs=_tail(completion.logprobs, start),
                       top_logprobs=_tail(completion.top_logprobs, start))


def _tail(values: list | None, start: int) -> list | None:
    return None if values is None else values[start:]


@dataclass(frozen=True, slots=True)
class ChoiceForm:
    """How one request's choices are written, beyond what its outputs hold.

    ``token_id_names``: log-prob tokens named ``token_id:N`` (vLLM's
    ``return_tokens_as_token_ids``). ``top_logprobs``: a completion's ``logprobs`` k (each
    ``top_logprobs`` entry holds the chosen token and up to k more). ``echo``: a completion
    choice starts with its prompt; ``prompt_only``: echo with ``max_tokens`` 0, nothing
    generated shown. ``chat_echo``: the text each chat reply starts with.
    """

    return_token_ids: bool = False
    token_id_names: bool = False
    top_logprobs: int = 0
    echo: bool = False
    prompt_only: bool = False
    chat_echo: str = ""


def nothing_generated(output: RequestOutput) -> RequestOutput:
    """``output`` with nothing generated shown (echo with ``max_tokens`` 0, for which the
    engine sampled one token): each completion empty and, once finished, finished by its
    0 tokens (``"length"``) unless aborted."""
    return replace(output, outputs=[_emptied(c) for c in output.outputs])


def _emptied(completion: CompletionOutput) -> CompletionOutput:
    end = len(completion.token_ids)
    finish_reason = completion.finish_reason
    if finish_reason not in (None, "abort"):
        finish_reason = "length"
    return replace(completion, token_ids=[], text="", cumulative_logprob=None,
                   logprobs=_tail(completion.logprobs, end),
                   top_logprobs=_tail(completion.top_logprobs, end),
                   finish_reason=finish_reason, stop_reason=None)


@dataclass(slots=True)
class _Scored:
    """Text and its tokens with, per token, its log-prob and its entry (its own and the top
    k's log-probs), None where unscored; ``logprobs`` None: none asked."""

    text: str
    token_ids: list[int]
    logprobs: list[float | None] | None
    entries: list[dict[int, float] | None] | None

    def __add__(self, other: _Scored) -> _Scored:
        scored = self.logprobs is not None and other.logprobs is not None
        return _Scored(self.text + other.text, self.token_ids + other.token_ids,
                       self.logprobs + other.logprobs if scored else None,
                       self.entries + other.entries if scored else None)


def _generated(completion: CompletionOutput) -> _Scored:
    """A completion's tokens, each entry its chosen token's log-prob and its top k."""
    if completion.logprobs is None:
        return _Scored(completion.text, completion.token_ids, None, None)
    tops = completion.top_logprobs or [{}] * len(completion.token_ids)
    return _Scored(completion.text, completion.token_ids, list(completion.logprobs),
                   [{token_id: logprob} | top for token_id, logprob, top
                    in zip(completion.token_ids, completion.logprobs, tops)])


class ResponseBuilder:
    """Builds OpenAI response bodies (whole or streamed chunks) from outputs.

    Args:
        tokenizer: decodes each token for the log-prob entries.
        model_name: the ``model`` field of every response.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, model_name: str) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name

    def envelope(self, response_id: str, obj: str, created: int,
                 choices: list[dict[str, Any]], weight_version: int) -> dict[str, Any]:
        """The fields around the choices: id, object, created, model, weight_version."""
        return {"id": response_id, "object": obj, "created": created, "model": self.model_name,
                "choices": choices, "weight_version": weight_version}

    def completion_choice(self, index: int, output: RequestOutput,
                          completion: CompletionOutput, form: ChoiceForm, echo: bool,
                          text_offset: int = 0, prompt_logprobs: list | None = None
                          ) -> dict[str, Any]:
        """One ``text_completion`` choice (whole, or a streamed delta) of ``output``: with
        ``echo`` the prompt first (vLLM's; a stream echoes in each choice's first chunk);
        ``text_offset`` is where its text starts in the choice's whole text (a stream's
        later chunks); with the prompt's log-probs in vLLM's shape when given."""
        scored = self._echoed_prompt(output) + _generated(completion) if echo \
            else _generated(completion)
        choice = {"index": index, "text": scored.text,
                  "logprobs": self._completion_logprobs(scored, form, text_offset),
                  "finish_reason": completion.finish_reason,
                  "stop_reason": completion.stop_reason,
                  "weight_versions": completion.weight_versions}
        if form.return_token_ids:
            choice |= {"token_ids": completion.token_ids,
                       "prompt_token_ids": output.prompt_token_ids}
        if prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs
        return choice

    def chat_choice(self, index: int, completion: CompletionOutput, stream: bool,
                    form: ChoiceForm, parser: ToolCallParser | None = None) -> dict[str, Any]:
        """One chat choice: a ``message`` (starting with ``form.chat_echo``), or in a stream
        a ``delta``; with a ``parser`` (the completion's own, fed every delta in turn)
        holding its tool calls."""
        message = _chat_message(completion, parser, stream)
        if stream:
            choice = {"index": index, "delta": message}
        else:
            if form.chat_echo:
                message["content"] = form.chat_echo + (message["content"] or "")
            choice = {"index": index, "message": {"role": "assistant", **message}}
        finish_reason = completion.finish_reason
        if finish_reason is not None and parser is not None and parser.num_tool_calls:
            finish_reason = "tool_calls"
        choice |= {"logprobs": self._chat_logprobs(completion, form.token_id_names),
                   "finish_reason": finish_reason,
                   "stop_reason": completion.stop_reason,
                   "weight_versions": completion.weight_versions}
        if form.return_token_ids:
            choice["token_ids"] = completion.token_ids
        return choice

    def prompt_logprobs(self, output: RequestOutput, k: int) -> list[Any] | None:
        """vLLM's ``prompt_logprobs`` of ``output`` (asked with ``k``; None when not asked):
        null for the first prompt token, then per position ``{token id as text: {"logprob",
        "rank", "decoded_token"}}`` for the prompt token and the top k. Ranks count from 1
        (the most likely); the prompt token's is null when it is not among the top k (the
        engine keeps no rank beyond them)."""
        entries = output.prompt_logprobs
        if entries is None:
            return None
        return [None, *(self._ranked_entry(entry, token_id, k) for token_id, entry
                        in zip(output.prompt_token_ids[1:], entries[1:]))]

    def _ranked_entry(self, entry: dict[int, float], token_id: int, k: int
                      ) -> dict[str, dict[str, Any]]:
        # The top k are the entry but the prompt token, unless it is among them (then the
        # entry holds k, or the whole vocabulary when smaller).
        top = [t for t in entry if t != token_id or len(entry) <= k]
        ranks = {t: rank for rank, t in enumerate(
            sorted(top, key=entry.__getitem__, reverse=True), 1)}
        return {str(t): {"logprob": logprob, "rank": ranks.get(t),
                         "decoded_token": self._decoded([t])} for t, logprob in entry.items()}

    def _echoed_prompt(self, output: RequestOutput) -> _Scored:
        """The prompt as echoed: its text (given, or its tokens decoded) and its tokens,
        each with its log-prob entry (the first, which nothing predicts, null)."""
        token_ids = output.prompt_token_ids
        text = output.prompt if output.prompt is not None else self._decoded(token_ids) or ""
        entries = output.prompt_logprobs or [None] * len(token_ids)
        logprobs = [None if entry is None else entry[token_id]
                    for token_id, entry in zip(token_ids, entries)]
        return _Scored(text, token_ids, logprobs, list(entries))

    def _completion_logprobs(self, scored: _Scored, form: ChoiceForm,
                             text_offset: int) -> dict[str, Any] | None:
        if scored.logprobs is None:
            return None
        tokens = [self._token(t, form.token_id_names) for t in scored.token_ids]
        offsets = list(itertools.accumulate(map(len, tokens), initial=text_offset))[:-1]
        top = [None if entry is None else {
            self._token(t, form.token_id_names): logprob
            for t, logprob in itertools.islice(entry.items(), form.top_logprobs + 1)}
            for entry in scored.entries]
        return {"tokens": tokens, "token_logprobs": scored.logprobs,
                "top_logprobs": top, "text_offset": offsets}

    def _chat_logprobs(self, completion: CompletionOutput,
                       token_id_names: bool) -> dict[str, Any] | None:
        if completion.logprobs is None:
            return None
        tops = completion.top_logprobs or [{}] * len(completion.token_ids)
        return {"content": [
            {**self._chat_token(token_id, logprob, token_id_names),
             "top_logprobs": [self._chat_token(t, lp, token_id_names)
                              for t, lp in top.items()]}
            for token_id, logprob, top in zip(completion.token_ids, completion.logprobs, tops)]}

    def _chat_token(self, token_id: int, logprob: float, token_id_names: bool
                    ) -> dict[str, Any]:
        token = self._token(token_id, token_id_names)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    def _token(self, token_id: int, token_id_names: bool) -> str:
        """A log-prob token's name: its text, or ``token_id:N`` when asked or untokenized."""
        if token_id_names or self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def _decoded(self, token_ids: list[int]) -> str | None:
        """The text of token ids, special tokens included (None without a tokenizer)."""
        return None if self.tokenizer is None else self.tokenizer.decode(token_ids)


def _chat_message(completion: CompletionOutput, parser: ToolCallParser | None,
                  stream: bool) -> dict[str, Any]:
    """The content of a message (or delta), and its tool calls when the parser finds some
    (then blank content is null)."""
    if parser is None:
        return {"content": completion.text}
    first = parser.num_tool_calls
    parsed = parser.feed(completion.text, final=completion.finish_reason is not None)
    if not parsed.tool_calls:
        return {"content": parsed.content}
    return {"content": parsed.content if parsed.content.strip() else None,
            "tool_calls": [_tool_call(call, first + i if stream else None)
                           for i, call in enumerate(parsed.tool_calls)]}


def _tool_call(call: ToolCall, index: int | None) -> dict[str, Any]:
    """OpenAI's tool call (arguments as a JSON string); a streamed one has its ``index``."""
    entry = {"id": f"call_{uuid.uuid4().hex}", "type": "function",
             "function": {"name": call.name,
                          "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
    return entry if index is None else {"index": index, **entry}


def usage(outputs: list[RequestOutput]) -> dict[str, int]:
    """OpenAI's ``usage``: prompt tokens (once per prompt) and generated tokens."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}
