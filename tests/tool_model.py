"""A tiny model that really calls a tool: a random model never writes a tool call, so this one
is fitted for a few seconds to answer ``QUESTION`` (with ``TOOLS`` in its prompt) by calling
``multiply`` in the Hermes/Qwen format, and to answer the tool's result with ``ANSWER``.

Its chat template is TRL's ``qwen2_5`` (the one TRL's ``add_response_schema`` knows), on the
shared tiny byte-level tokenizer, with ``<|im_end|>`` as EOS as in Qwen2.5-Instruct, so TRL's
tool loop and the server's tool parsing both run on it unchanged.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from .conftest import SMALL, build_tokenizer


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


QUESTION = "What is 3 times 4?"
CALL_TEXT = '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
ANSWER = "The answer is 12."


def qwen2_5_template() -> str:
    """TRL's qwen2_5 chat template (renders ``tools``, ``tool_calls`` and ``tool`` turns)."""
    from trl.chat_template_utils import qwen2_5_chat_template

    return qwen2_5_chat_template


def conversation() -> list[dict]:
    """The fitted episode: the question, the call, the tool's result, the answer."""
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}
    return [{"role": "user", "content": QUESTION},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "multiply", "content": "12"},
            {"role": "assistant", "content": ANSWER}]


def training_pairs(tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, target ids) for both model turns, rendered as at generation time."""
    from transformers.utils import get_json_schema

    tools = [get_json_schema(multiply)]
    messages = conversation()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pairs = []
    for upto, target in ((1, CALL_TEXT), (3, ANSWER)):
        prompt = tokenizer.apply_chat_template(messages[:upto], tools=tools, tokenize=False,
                                               add_generation_prompt=True)
        pairs.append((tokenizer.encode(prompt), tokenizer.encode(target) + [end]))
    return pairs


def fit(model, pairs: list[tuple[list[int], list[int]]], steps: int = 150) -> None:
    """Fit ``model`` to emit each pair's target after its prompt (loss on targets only)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = 0.0
        for prompt, target in pairs:
            ids = torch.tensor([prompt + target])
            labels = torch.tensor([[-100] * len(prompt) + target])
            loss = loss + model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def save_tool_model(path: Path) -> Path:
    """Save the fitted tiny Qwen2 tool caller with its tokenizer (template: TRL's qwen2_5)."""
    tokenizer = build_tokenizer()
    tokenizer.chat_template = qwen2_5_template()
    tokenizer.eos_token = "<|im_end|>"  # as Qwen2.5-Instruct: a turn's end is EOS
    torch.manual_seed(0)
    ends = [tokenizer.eos_token_id, SMALL["eos_token_id"]]
    config = Qwen2Config(vocab_size=len(tokenizer), tie_word_embeddings=False,
                         **{**SMALL, "max_position_embeddings": 2048, "eos_token_id": ends})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fit(model, training_pairs(tokenizer))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
