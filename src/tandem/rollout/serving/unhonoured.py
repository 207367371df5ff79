"""The request fields of vLLM's and OpenAI's that this server does not honour, each with
why: a body that sends one with a value that would change anything is refused with a 400
naming it (``SamplingRequest`` checks them), never taken and ignored."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any


def _one_of(*values: Any) -> Callable[[Any, Mapping[str, Any]], bool]:
    return lambda value, _: value in values


@dataclasses.dataclass(frozen=True, slots=True)
class Unhonoured:
    """A request field of vLLM's or OpenAI's that this server does not honour: why, and
    ``harmless(value, body)``, true for a value that changes nothing (that one is taken)."""

    why: str
    harmless: Callable[[Any, Mapping[str, Any]], bool] = _one_of(None)


def _spaces_harmless(value: Any, body: Mapping[str, Any]) -> bool:
    return value in (None, False) or body.get("skip_special_tokens", True) is True


_SAMPLED = ("it would change the sampled distribution, which the processed log-probs a "
            "trainer replays do not model")
_NO_DISAGGREGATION = "Tandem has no disaggregated serving"
# What a request gets when it sends one of these with a value that would change anything:
# a 400 naming it and why (a field a body declares is that body's own, never refused).
UNHONOURED: dict[str, Unhonoured] = {
    "suffix": Unhonoured("Tandem has no fill-in-the-middle: put all the text in prompt",
                         _one_of(None, "")),
    "best_of": Unhonoured("Tandem has no best-of: ask for n completions and rank them",
                          _one_of(None, 1)),
    "use_beam_search": Unhonoured("Tandem has no beam search", _one_of(None, False)),
    "length_penalty": Unhonoured("it weighs beam search, which Tandem does not have",
                                 _one_of(None, 1.0)),
    "logit_bias": Unhonoured(_SAMPLED, _one_of(None, {})),
    "allowed_token_ids": Unhonoured(f"{_SAMPLED} (structured_outputs constrains the output "
                                    "with exact log-probs)"),
    "bad_words": Unhonoured(_SAMPLED, _one_of(None, [])),
    "logprob_token_ids": Unhonoured("log-probs of chosen token ids are not computed: ask "
                                    "for the top k with logprobs"),
    "truncate_prompt_tokens": Unhonoured("Tandem never truncates a prompt: shorten it "
                                         "(the server's limit is --max-prompt-tokens)"),
    "truncation_side": Unhonoured("Tandem never truncates a prompt"),
    "add_special_tokens": Unhonoured("a text prompt always gets the tokenizer's special "
                                     "tokens (such as BOS): send token ids to leave them out",
                                     _one_of(None, True)),
    "spaces_between_special_tokens": Unhonoured(
        "the text is the tokenizer's own decoding (as vLLM's fast detokenizer), which puts "
        "no spaces between special tokens", _spaces_harmless),
    "prompt_embeds": Unhonoured("a prompt is text or token ids"),
    "priority": Unhonoured("requests are scheduled first come, first served",
                           _one_of(None, 0)),
    "cache_salt": Unhonoured("the prefix cache is shared, not salted"),
    "kv_transfer_params": Unhonoured(_NO_DISAGGREGATION),
    "ec_transfer_params": Unhonoured(_NO_DISAGGREGATION),
    "vllm_xargs": Unhonoured("Tandem has no custom request extensions"),
    "repetition_detection": Unhonoured("Tandem does not detect repetitions: use stop or "
                                       "max_tokens"),
    "thinking_token_budget": Unhonoured("Tandem has no reasoning budget: use max_tokens"),
    "reasoning_effort": Unhonoured("Tandem has no reasoning control (chat_template_kwargs "
                                   "reach the chat template)"),
    "include_reasoning": Unhonoured("Tandem has no reasoning parser: the reply is the whole "
                                    "text", _one_of(None, True)),
    "stream_interval": Unhonoured("a stream sends every token ready when it writes"),
    "watermarking": Unhonoured("Tandem does not watermark", _one_of(None, False)),
    "routed_experts_prompt_start": Unhonoured("routed experts cover the whole prompt",
                                              _one_of(None, 0)),
    "request_id": Unhonoured("the server names each request (the response's id)"),
    "parallel_tool_calls": Unhonoured("every tool call the model writes is answered (a named "
                                      "tool_choice forces exactly one)", _one_of(None, True)),
    "functions": Unhonoured("OpenAI's deprecated functions: send tools"),
    "function_call": Unhonoured("OpenAI's deprecated function_call: send tool_choice"),
    "chat_template": Unhonoured("the model's own chat template is applied"),
    "documents": Unhonoured("pass them in chat_template_kwargs, which the chat template "
                            "reads"),
    "mm_processor_kwargs": Unhonoured("Tandem serves text models"),
    "media_io_kwargs": Unhonoured("Tandem serves text models"),
    "audio": Unhonoured("Tandem serves text models"),
    "modalities": Unhonoured("Tandem answers text only", _one_of(None, ["text"])),
    "prediction": Unhonoured("Tandem has no predicted outputs"),
    "web_search_options": Unhonoured("Tandem has no web search"),
    "store": Unhonoured("Tandem stores no completion", _one_of(None, False)),
    "service_tier": Unhonoured("Tandem has one service tier",
                               _one_of(None, "auto", "default")),
}
