"""vLLM's /tokenize and /detokenize, and the chat template's options on
/v1/chat/completions (chat_template_kwargs, continue_final_message, add_special_tokens),
against the tokenizer's own encode, decode and apply_chat_template, and against the prompt
ids the completion routes queue."""

from __future__ import annotations

import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tokenizers import processors
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tandem.rollout import LLMEngine

from .test_server import AUTH, LIMITS, MODEL, openai_client, running_server

# Reads a kwarg (Qwen 3's enable_thinking) and renders tools, so both can be seen arriving.
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for tool in tools %}{{ tool['function']['name'] }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}")
QUESTION = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2+3?"}]
PREFILL = [*QUESTION, {"role": "assistant", "content": "The answer is"}]
TOOLS = [{"type": "function", "function": {"name": "multiply", "description": "a times b",
                                           "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def bos_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a tokenizer that adds BOS to a text (so ``add_special_tokens``
    shows) and the chat template above."""
    folder = tmp_path_factory.mktemp("bos_model")
    shutil.copytree(llama_dir, folder, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    bos = tokenizer.bos_token
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tokenizer.bos_token_id)])
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizer(bos_dir: Path) -> PreTrainedTokenizerBase:
    """The reference: the folder's tokenizer as transformers loads it."""
    loaded = AutoTokenizer.from_pretrained(bos_dir)
    assert loaded.chat_template == TEMPLATE
    assert loaded("Hi").input_ids[0] == loaded.bos_token_id
    return loaded


@pytest.fixture(scope="module")
def served(bos_dir: Path) -> Iterator[tuple[str, LLMEngine]]:
    with running_server(bos_dir, **LIMITS) as served:
        yield served


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", headers=AUTH, json=body, timeout=60)


def tokenized(url: str, body: dict) -> dict:
    answer = post(url, "/tokenize", body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def chat_prompt_ids(url: str, body: dict) -> list[int]:
    answer = post(url, "/v1/chat/completions", body | {"max_tokens": 1, "return_token_ids": True})
    assert answer.status_code == 200, answer.text
    return answer.json()["prompt_token_ids"]


def reference_chat_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict],
                       add_special_tokens: bool = False, **options) -> list[int]:
    """The tokenizer's own ids of a chat, the special tokens added on top if asked."""
    if add_special_tokens:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **options)
        return tokenizer(text, add_special_tokens=True).input_ids
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False,
                                              **options))


@pytest.mark.parametrize("add_special_tokens", [True, False, None])
def test_tokenize_prompt_equals_the_tokenizer_and_a_completions_prompt_ids(
        served, tokenizer, add_special_tokens):
    url, engine = served
    prompt = "The quick brown fox jumps over the lazy dog."
    body = {"model": MODEL, "prompt": prompt}
    if add_special_tokens is not None:
        body["add_special_tokens"] = add_special_tokens
    answer = tokenized(url, body)
    expected = tokenizer(prompt, add_special_tokens=add_special_tokens is not False).input_ids
    assert answer == {"count": len(expected), "max_model_len": engine.max_model_len,
                      "tokens": expected, "token_strs": None}
    if add_special_tokens is not False:  # the default is what a completion queues
        completion = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 1,
                                                   "return_token_ids": True})
        assert completion.json()["choices"][0]["prompt_token_ids"] == expected


@pytest.mark.parametrize("add_generation_prompt,continue_final_message,add_special_tokens", [
    (True, False, False), (False, False, False), (False, True, False), (True, False, True),
    (False, True, True)])
def test_tokenize_chat_equals_apply_chat_template_and_the_chat_completions_prompt_ids(
        served, tokenizer, add_generation_prompt, continue_final_message, add_special_tokens):
    url, _ = served
    messages = PREFILL if continue_final_message else QUESTION
    options = {"add_generation_prompt": add_generation_prompt,
               "continue_final_message": continue_final_message}
    body = {"messages": messages, "add_special_tokens": add_special_tokens, **options}
    expected = reference_chat_ids(tokenizer, messages, add_special_tokens, **options)
    assert (expected[0] == tokenizer.bos_token_id) == add_special_tokens
    answer = tokenized(url, body | {"return_token_strs": True})
    assert answer["tokens"] == expected and answer["count"] == len(expected)
    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(expected)
    assert chat_prompt_ids(url, body) == expected


def test_tokenize_chat_renders_tools_as_the_chat_completion_does(served, tokenizer):
    url, _ = served
    expected = reference_chat_ids(tokenizer, QUESTION, tools=TOOLS, add_generation_prompt=True)
    assert tokenized(url, {"messages": QUESTION, "tools": TOOLS})["tokens"] == expected
    assert chat_prompt_ids(url, {"messages": QUESTION, "tools": TOOLS}) == expected


@pytest.mark.parametrize("enable_thinking", [False, True])
def test_chat_template_kwargs_reach_the_template(served, tokenizer, enable_thinking):
    url, engine = served
    kwargs = {"enable_thinking": enable_thinking}
    expected = reference_chat_ids(tokenizer, QUESTION, add_generation_prompt=True, **kwargs)
    thinking_off = tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    assert (expected[-len(thinking_off):] == thinking_off) == (not enable_thinking)
    assert tokenized(url, {"messages": QUESTION, "chat_template_kwargs": kwargs})["tokens"] \
        == expected
    reply = openai_client(url).chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=1,
        extra_body={"chat_template_kwargs": kwargs, "return_token_ids": True})
    assert reply.model_extra["prompt_token_ids"] == expected
    assert engine.apply_chat_template(QUESTION, chat_template_kwargs=kwargs) == expected


def test_continue_final_message_continues_the_last_assistant_message(served, tokenizer):
    url, engine = served
    reply = openai_client(url).chat.completions.create(
        model=MODEL, messages=PREFILL, max_tokens=1,
        extra_body={"continue_final_message": True, "add_generation_prompt": False,
                    "return_token_ids": True})
    prompt_ids = reply.model_extra["prompt_token_ids"]
    prefill = tokenizer.encode("The answer is", add_special_tokens=False)
    assert prompt_ids[-len(prefill):] == prefill
    closed = reference_chat_ids(tokenizer, PREFILL)
    assert closed[:len(prompt_ids)] == prompt_ids and len(closed) > len(prompt_ids)
    assert prompt_ids == engine.apply_chat_template(PREFILL, False, continue_final_message=True)


def test_detokenize_equals_tokenizer_decode(served, tokenizer):
    url, _ = served
    rng = random.Random(0)
    for length in (0, 1, 17):
        ids = [rng.randrange(len(tokenizer)) for _ in range(length)]
        answer = post(url, "/detokenize", {"model": MODEL, "tokens": ids})
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"prompt": tokenizer.decode(ids)}
    text = "Seven plus one is eight."
    ids = tokenized(url, {"prompt": text, "add_special_tokens": False})["tokens"]
    assert post(url, "/detokenize", {"tokens": ids}).json()["prompt"] == text


def bad_requests(vocab_size: int) -> list[tuple[str, dict, int, list[str]]]:
    """(path, body, status, words the error message holds) for each refused input."""
    both = {"prompt": "Hi", "messages": QUESTION}
    return [
        ("/tokenize", both, 400, ["prompt", "messages", "not both"]),
        ("/tokenize", {"add_special_tokens": True}, 400, ["prompt", "messages"]),
        ("/tokenize", {"prompt": "Hi", "model": "other"}, 404, ["other"]),
        ("/detokenize", {"tokens": [5], "model": "other"}, 404, ["other"]),
        ("/detokenize", {"tokens": [5, vocab_size, 7]}, 400, [str(vocab_size), "position 1"]),
        ("/detokenize", {"tokens": [5, -1]}, 400, ["tokens"]),
        ("/detokenize", {"tokens": [5, True]}, 400, ["tokens"]),
        ("/tokenize", {"messages": PREFILL, "continue_final_message": True,
                       "add_generation_prompt": True}, 400,
         ["continue_final_message", "add_generation_prompt"]),
        ("/tokenize", {"messages": PREFILL, "continue_final_message": True}, 400,
         ["add_generation_prompt to false"]),
        ("/v1/chat/completions", {"messages": PREFILL, "continue_final_message": True,
                                  "add_generation_prompt": True}, 400,
         ["continue_final_message", "add_generation_prompt"]),
        ("/v1/chat/completions", {"messages": QUESTION, "chat_template_kwargs": {
            "tokenize": False, "chat_template": "x"}}, 400, ["chat_template, tokenize"]),
        ("/tokenize", {"messages": QUESTION, "chat_template_kwargs": {"padding": True}}, 400,
         ["padding"]),
    ]


def test_bad_inputs_are_refused_naming_the_fix(served):
    url, engine = served
    for path, body, status, words in bad_requests(engine.input_processor.vocab_size):
        answer = post(url, path, body)
        assert answer.status_code == status, (path, body, answer.text)
        message = answer.json()["error"]["message"]
        assert all(word in message for word in words), (body, message)
    assert tokenized(url, {"prompt": "Hi"})["count"] > 0


def test_tokenize_routes_are_documented_with_their_bodies(served):
    url, _ = served
    schema = httpx.get(f"{url}/openapi.json", headers=AUTH).json()
    for path in ("/tokenize", "/detokenize"):
        responses = schema["paths"][path]["post"]["responses"]
        assert {"200", "400", "404"} <= set(responses) and "422" not in responses
    properties = schema["components"]["schemas"]["TokenizeRequest"]["properties"]
    assert {"prompt", "messages", "add_special_tokens", "chat_template_kwargs",
            "continue_final_message", "return_token_strs"} <= set(properties)
    chat = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert {"chat_template_kwargs", "continue_final_message", "add_special_tokens"} <= set(chat)


def test_tokenize_and_detokenize_want_no_key_as_vllms_while_completions_do(served, tokenizer):
    """vLLM's server guards its /v1 routes only, and its benchmark client calls /tokenize
    without a key: on a keyed server the two answer without one, generation does not."""
    url, _ = served
    tokens = httpx.post(f"{url}/tokenize", json={"prompt": "2+3"}, timeout=60)
    assert tokens.status_code == 200
    assert tokens.json()["tokens"] == tokenizer("2+3")["input_ids"]
    text = httpx.post(f"{url}/detokenize", json={"tokens": tokens.json()["tokens"]},
                      timeout=60)
    assert text.status_code == 200
    unkeyed = httpx.post(f"{url}/v1/completions", json={"prompt": "2+3", "max_tokens": 1},
                         timeout=60)
    assert unkeyed.status_code == 401
