"""The bodies of OpenAI's successful responses, built from ``RequestOutput``s: whole
completions and chat completions, streamed chunks (``DeltaTracker`` cuts a request's
successive outputs into deltas) and ``usage``. Where tool calls are parsed, a chat
completion's text is cut by ``ToolCallParser`` into ``content`` and OpenAI's ``tool_calls``
(in a stream, each call as one delta once it is closed), and a completion that called a tool
finishes with ``"tool_calls"``.

Beyond OpenAI's fields, every body carries Tandem's ``weight_version`` and every choice the
``weight_versions`` its tokens were sampled under, so a trainer can see which weights
sampled a rollout.
"""

from __future__ import annotations

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

    def completion_choice(self, index: int, completion: CompletionOutput,
                          prompt_token_ids: list[int] | None, return_token_ids: bool,
                          prompt_logprobs: list | None = None) -> dict[str, Any]:
        """One ``text_completion`` choice (whole, or a streamed delta), with the prompt's
        log-probs when given (vLLM's field)."""
        choice = {"index": index, "text": completion.text,
                  "logprobs": self._completion_logprobs(completion),
                  "finish_reason": completion.finish_reason,
                  "stop_reason": completion.stop_reason,
                  "weight_versions": completion.weight_versions}
        if return_token_ids:
            choice |= {"token_ids": completion.token_ids, "prompt_token_ids": prompt_token_ids}
        if prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs
        return choice

    def chat_choice(self, index: int, completion: CompletionOutput, stream: bool,
                    return_token_ids: bool, parser: ToolCallParser | None = None
                    ) -> dict[str, Any]:
        """One chat choice: a ``message``, or in a stream a ``delta``; with a ``parser``
        (the completion's own, fed every delta in turn) holding its tool calls."""
        message = _chat_message(completion, parser, stream)
        if stream:
            choice = {"index": index, "delta": message}
        else:
            choice = {"index": index, "message": {"role": "assistant", **message}}
        finish_reason = completion.finish_reason
        if finish_reason is not None and parser is not None and parser.num_tool_calls:
            finish_reason = "tool_calls"
        choice |= {"logprobs": self._chat_logprobs(completion),
                   "finish_reason": finish_reason,
                   "stop_reason": completion.stop_reason,
                   "weight_versions": completion.weight_versions}
        if return_token_ids:
            choice["token_ids"] = completion.token_ids
        return choice

    def _completion_logprobs(self, completion: CompletionOutput) -> dict[str, Any] | None:
        if completion.logprobs is None:
            return None
        tokens = [self._token(t) for t in completion.token_ids]
        offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        top = None
        if completion.top_logprobs is not None:
            top = [{self._token(t): lp for t, lp in entry.items()}
                   for entry in completion.top_logprobs]
        return {"tokens": tokens, "token_logprobs": completion.logprobs,
                "top_logprobs": top, "text_offset": offsets}

    def _chat_logprobs(self, completion: CompletionOutput) -> dict[str, Any] | None:
        if completion.logprobs is None:
            return None
        tops = completion.top_logprobs or [{}] * len(completion.token_ids)
        return {"content": [
            {**self._chat_token(token_id, logprob),
             "top_logprobs": [self._chat_token(t, lp) for t, lp in top.items()]}
            for token_id, logprob, top in zip(completion.token_ids, completion.logprobs, tops)]}

    def _chat_token(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self._token(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    def _token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])


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
