"""The ``openai`` SDK against a real server, for the routes and vLLM extras
tests/test_server.py does not call through it: completions that echo and score their prompt
(``echo``, ``logprobs``, ``max_tokens=0``), ``prompt_logprobs``, ``return_tokens_as_token_ids``,
chat ``chat_template_kwargs``, and ``/tokenize`` and ``/detokenize`` through the SDK's
generic ``post``. Log-probs are checked against transformers' forward of the same folder,
token ids against the tokenizer's own chat template.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from .conftest import CHAT_TEMPLATE
from .test_server import openai_client, running_server

PROMPT = "The quick brown fox jumps over the lazy dog."
MESSAGES = [{"role": "user", "content": "What is 2+3?"}]
HINT = {"system_hint": "Answer in one word."}
# The tiny models' template, with a system turn when the caller passes ``system_hint``.
HINTED_TEMPLATE = ("{% if system_hint is defined %}<|im_start|>system\n{{ system_hint }}"
                   "<|im_end|>\n{% endif %}" + CHAT_TEMPLATE)
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def hinted_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with ``HINTED_TEMPLATE`` as its chat template."""
    folder = tmp_path_factory.mktemp("hinted")
    shutil.copytree(llama_dir, folder, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    tokenizer.chat_template = HINTED_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def served(hinted_dir: Path) -> Iterator[tuple[str, openai.OpenAI]]:
    with running_server(hinted_dir) as (url, _):
        yield url, openai_client(url)


@pytest.fixture(scope="module")
def tokenizer(hinted_dir: Path):
    return AutoTokenizer.from_pretrained(hinted_dir)


@pytest.fixture(scope="module")
def reference_model(hinted_dir: Path):
    return AutoModelForCausalLM.from_pretrained(hinted_dir, dtype=torch.float32).eval()


def reference_logprobs(model, token_ids: list[int]) -> list[float]:
    """Each token's log-prob given the tokens before it (from the second token on)."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return [logprobs[i - 1, token_ids[i]].item() for i in range(1, len(token_ids))]


def chat_ids(tokenizer, **template_kwargs) -> list[int]:
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False,
                                         **template_kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def test_completion_scores_its_echoed_prompt_without_generating(served, tokenizer,
                                                                  reference_model):
    _, client = served
    reply = client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=1,
                                      max_tokens=0)
    choice = reply.choices[0]
    prompt_ids = tokenizer.encode(PROMPT)
    assert choice.text == PROMPT
    assert "".join(choice.logprobs.tokens) == PROMPT
    assert len(choice.logprobs.token_logprobs) == len(prompt_ids)
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(
        reference_logprobs(reference_model, prompt_ids), abs=LOGPROB_TOLERANCE)
    assert choice.finish_reason == "length"


def test_completion_echoes_its_prompt_before_the_completion(served, tokenizer):
    _, client = served
    reply = client.completions.create(model="tiny", prompt=PROMPT, echo=True, logprobs=1,
                                      max_tokens=3, seed=0, extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    assert len(choice.logprobs.tokens) == len(tokenizer.encode(PROMPT)) + 3
    assert choice.logprobs.token_logprobs[0] is None
    assert None not in choice.logprobs.token_logprobs[1:]


def test_completion_prompt_logprobs_are_the_models(served, tokenizer, reference_model):
    _, client = served
    reply = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1,
                                      extra_body={"prompt_logprobs": 1})
    prompt_logprobs = reply.choices[0].model_extra["prompt_logprobs"]
    prompt_ids = tokenizer.encode(PROMPT)
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(prompt_ids)
    chosen = [entries[str(token_id)]["logprob"]
              for entries, token_id in zip(prompt_logprobs[1:], prompt_ids[1:])]
    assert chosen == pytest.approx(reference_logprobs(reference_model, prompt_ids),
                                   abs=LOGPROB_TOLERANCE)


def test_chat_prompt_logprobs_cover_the_templated_prompt(served, tokenizer, reference_model):
    _, client = served
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1,
                                           extra_body={"prompt_logprobs": 0})
    prompt_logprobs = reply.model_extra["prompt_logprobs"]
    prompt_ids = chat_ids(tokenizer)
    chosen = [entries[str(token_id)]["logprob"]
              for entries, token_id in zip(prompt_logprobs[1:], prompt_ids[1:])]
    assert chosen == pytest.approx(reference_logprobs(reference_model, prompt_ids),
                                   abs=LOGPROB_TOLERANCE)


def test_completion_tokens_as_token_ids_name_the_sampled_ids(served):
    _, client = served
    reply = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=4, logprobs=1, seed=0,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True,
                    "ignore_eos": True})
    choice = reply.choices[0]
    names = [f"token_id:{token_id}" for token_id in choice.model_extra["token_ids"]]
    assert choice.logprobs.tokens == names
    assert all(name in top for name, top in zip(names, choice.logprobs.top_logprobs))


def test_chat_tokens_as_token_ids_name_the_sampled_ids(served):
    _, client = served
    reply = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=1, seed=0,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True,
                    "ignore_eos": True})
    choice = reply.choices[0]
    names = [f"token_id:{token_id}" for token_id in choice.model_extra["token_ids"]]
    assert [entry.token for entry in choice.logprobs.content] == names


def test_chat_template_kwargs_reach_the_chat_template(served, tokenizer):
    _, client = served
    reply = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=1,
        extra_body={"chat_template_kwargs": HINT, "return_token_ids": True})
    assert reply.model_extra["prompt_token_ids"] == chat_ids(tokenizer, **HINT)
    assert chat_ids(tokenizer, **HINT) != chat_ids(tokenizer)


def post(served, route: str, body: dict) -> dict:
    """``body`` posted to ``route`` (beside /v1) with the SDK's own client and key."""
    url, client = served
    response = client.post(f"{url}{route}", body=body, cast_to=httpx.Response)
    assert response.status_code == 200, response.text
    return response.json()


def test_tokenize_a_prompt_as_the_tokenizer(served, tokenizer):
    answer = post(served, "/tokenize", {"model": "tiny", "prompt": PROMPT,
                                        "return_token_strs": True})
    ids = tokenizer.encode(PROMPT)
    assert answer["tokens"] == ids and answer["count"] == len(ids)
    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    assert answer["max_model_len"] == 256


def test_tokenize_a_chat_with_template_kwargs(served, tokenizer):
    answer = post(served, "/tokenize", {"model": "tiny", "messages": MESSAGES,
                                        "chat_template_kwargs": HINT})
    assert answer["tokens"] == chat_ids(tokenizer, **HINT)


def test_detokenize_returns_the_text(served, tokenizer):
    answer = post(served, "/detokenize", {"model": "tiny", "tokens": tokenizer.encode(PROMPT)})
    assert answer == {"prompt": PROMPT}
