"""vLLM's serving extras on /v1/completions and /v1/chat/completions, against references:
``echo`` (the prompt's log-probs equal transformers' log-softmax of the model's logits and
the offline engine's ``prompt_logprobs``; lm-evaluation-harness's log-likelihood request as
it sends it), ``prompt_logprobs`` in vLLM's shape, ``return_tokens_as_token_ids``, chat's
``echo``, the sampling extras that change the text, and every field the server refuses."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.rollout import LLM, LLMEngine, SamplingParams
from tandem.rollout.serving.unhonoured import UNHONOURED

from .test_server import (
    AUTH,
    ENGINE_OPTIONS,
    LIMITS,
    MODEL,
    PROMPTS,
    openai_client,
    running_server,
    stream_while,
    wait_until_idle,
)

# A block (16) plus one, and a prompt shorter than a block: lm-eval's batch of token ids.
TOKEN_PROMPTS = [[5, 9, 33, 70, 2, 81, 100, 4, 17, 3, 44, 12, 200, 7, 8, 9, 10], [40, 41, 42]]
TOLERANCE = 1e-4
MAX_NUM_WAITING = 8


@pytest.fixture(scope="module")
def served(llama_dir) -> Iterator[tuple[str, LLMEngine]]:
    with running_server(llama_dir, **LIMITS, max_num_waiting=MAX_NUM_WAITING) as served:
        yield served


@pytest.fixture(scope="module")
def offline(llama_dir) -> LLM:
    return LLM(str(llama_dir), **ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def hf_model(llama_dir) -> AutoModelForCausalLM:
    return AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


def reference_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax of the model's logits: row i predicts prompt token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), -1)


def completions(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", headers=AUTH, json=body, timeout=120)


def chat(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", headers=AUTH, json=body, timeout=120)


def parse_logprobs(answer: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-evaluation-harness's ``LocalCompletionsAPI.parse_logprobs``: per choice, the
    continuation's log-likelihood and whether every continuation token was the argmax."""
    results = []
    for choice, ctxlen in zip(sorted(answer["choices"], key=lambda c: c["index"]), ctxlens):
        logprobs = choice["logprobs"]
        tokens = logprobs["token_logprobs"][ctxlen:-1]
        tops = logprobs["top_logprobs"][ctxlen:-1]
        results.append((sum(tokens), all(t == max(top.values()) for t, top in zip(tokens, tops))))
    return results


def test_lm_eval_loglikelihood_request_gets_transformers_prompt_logprobs(served, offline,
                                                                         hf_model, tokenizer):
    """lm-evaluation-harness's ``local-completions`` log-likelihood body, as it sends it."""
    answer = completions(served[0], model=MODEL, prompt=TOKEN_PROMPTS, temperature=0,
                         max_tokens=1, logprobs=1, seed=1234, echo=True)
    assert answer.status_code == 200, answer.text
    answer = answer.json()
    greedy = offline.generate(TOKEN_PROMPTS, SamplingParams(temperature=0, max_tokens=1,
                                                            logprobs=1), use_tqdm=False)
    for prompt, choice, expected in zip(TOKEN_PROMPTS, answer["choices"], greedy):
        reference = reference_logprobs(hf_model, prompt)
        generated = expected.outputs[0]
        assert choice["text"] == tokenizer.decode(prompt) + generated.text
        logprobs = choice["logprobs"]
        assert logprobs["tokens"] == [tokenizer.decode([t]) for t in prompt + generated.token_ids]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        expected_prompt = reference[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        assert logprobs["token_logprobs"][1:len(prompt)] == pytest.approx(
            expected_prompt.tolist(), abs=TOLERANCE)
        assert logprobs["token_logprobs"][-1] == pytest.approx(generated.logprobs[0], abs=1e-5)
        for position, top in enumerate(logprobs["top_logprobs"][1:len(prompt)], start=1):
            argmax = reference[position - 1].argmax().item()
            assert set(top) == {tokenizer.decode([prompt[position]]), tokenizer.decode([argmax])}
            assert max(top.values()) == pytest.approx(reference[position - 1].max().item(),
                                                      abs=TOLERANCE)
    ctxlens = [4, 1]  # a context, then the continuation whose likelihood lm-eval wants
    for (loglikelihood, is_greedy), prompt, ctxlen in zip(
            parse_logprobs(answer, ctxlens), TOKEN_PROMPTS, ctxlens):
        reference = reference_logprobs(hf_model, prompt)
        continuation = range(ctxlen, len(prompt))
        assert loglikelihood == pytest.approx(
            sum(reference[p - 1, prompt[p]].item() for p in continuation), abs=1e-3)
        assert is_greedy == all(reference[p - 1].argmax().item() == prompt[p]
                                for p in continuation)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_echo_with_max_tokens_0_scores_the_prompt_alone(served, hf_model, tokenizer, stream):
    body = dict(prompt=TOKEN_PROMPTS, max_tokens=0, logprobs=0, echo=True, stream=stream,
                stream_options={"include_usage": True} if stream else None)
    answer = completions(served[0], **body)
    assert answer.status_code == 200, answer.text
    if stream:
        chunks = [json.loads(line.removeprefix("data: ")) for line in answer.text.split("\n\n")
                  if line.startswith("data: {")]
        choices, usage = [c["choices"][0] for c in chunks[:-1]], chunks[-1]["usage"]
    else:
        choices, usage = answer.json()["choices"], answer.json()["usage"]
    assert len(choices) == len(TOKEN_PROMPTS)  # one chunk per choice in a stream
    for choice in choices:
        prompt = TOKEN_PROMPTS[choice["index"]]
        assert choice["text"] == tokenizer.decode(prompt)
        assert choice["finish_reason"] == "length"
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(prompt)
        expected = reference_logprobs(hf_model, prompt)[:-1].gather(
            1, torch.tensor(prompt[1:])[:, None])[:, 0]
        assert logprobs["token_logprobs"][1:] == pytest.approx(expected.tolist(), abs=TOLERANCE)
        assert [len(top) for top in logprobs["top_logprobs"][1:]] == [1] * (len(prompt) - 1)
    assert usage["completion_tokens"] == 0
    assert usage["prompt_tokens"] == sum(map(len, TOKEN_PROMPTS))


def test_max_tokens_0_without_echo_is_still_refused(served):
    answer = completions(served[0], prompt="x", max_tokens=0)
    assert answer.status_code == 400 and "max_tokens" in answer.json()["error"]["message"]


def test_echo_and_prompt_logprobs_equal_the_offline_engine_through_the_openai_sdk(
        served, offline, tokenizer):
    k = 3
    expected = offline.generate(PROMPTS, SamplingParams(max_tokens=4, seed=7, logprobs=2,
                                                        prompt_logprobs=k), use_tqdm=False)
    response = openai_client(served[0]).completions.create(
        model=MODEL, prompt=PROMPTS, max_tokens=4, seed=7, logprobs=2, echo=True,
        extra_body={"prompt_logprobs": k, "return_token_ids": True})
    for choice, output in zip(response.choices, expected):
        prompt, completion = output.prompt_token_ids, output.outputs[0]
        assert choice.text == output.prompt + completion.text
        assert choice.model_extra["token_ids"] == completion.token_ids
        logprobs = choice.logprobs
        assert logprobs.token_logprobs == pytest.approx(
            [None, *(entry[t] for t, entry in zip(prompt[1:], output.prompt_logprobs[1:])),
             *completion.logprobs], abs=1e-5)
        names = [tokenizer.decode([t]) for t in prompt + completion.token_ids]
        assert logprobs.tokens == names
        assert logprobs.text_offset == [sum(map(len, names[:i])) for i in range(len(names))]
        # the chosen token and up to logprobs (2) more: the prompt's top k cut to 2
        for top, token_id, entry in zip(logprobs.top_logprobs[1:len(prompt)], prompt[1:],
                                        output.prompt_logprobs[1:]):
            kept = dict(list(entry.items())[:3])
            assert top == pytest.approx({tokenizer.decode([t]): v for t, v in kept.items()})
            assert token_id in kept
        check_vllm_prompt_logprobs(choice.model_extra["prompt_logprobs"], output, k, tokenizer)


def check_vllm_prompt_logprobs(ours: list, output, k: int, tokenizer) -> None:
    """vLLM's shape: null first, then ``{id: {"logprob", "rank", "decoded_token"}}`` with the
    engine's values; ranks 1..k by log-prob for the top k, the prompt token's when among
    them (else null)."""
    assert ours[0] is None and len(ours) == len(output.prompt_token_ids)
    for entry, expected, token_id in zip(ours[1:], output.prompt_logprobs[1:],
                                         output.prompt_token_ids[1:]):
        assert {int(t): v["logprob"] for t, v in entry.items()} == pytest.approx(expected,
                                                                                 abs=1e-5)
        assert all(v["decoded_token"] == tokenizer.decode([int(t)]) for t, v in entry.items())
        top = sorted(expected.items(), key=lambda item: -item[1])[:k]
        ranked = {t: rank for rank, (t, _) in enumerate(top, 1)}
        assert {int(t): v["rank"] for t, v in entry.items()} == {
            t: ranked.get(t) for t in expected}
        assert (entry[str(token_id)]["rank"] is None) == (token_id not in ranked)


@pytest.mark.parametrize("finished_first", [False, True], ids=["running", "finished"])
def test_echo_streams_the_prompt_in_each_choices_first_chunk(served, monkeypatch,
                                                             finished_first):
    """The prompt's log-probs are asked of the engine at a stream's first chunk; a request
    that finished meanwhile (``finished_first``) echoes them from its final output."""
    url, engine = served
    body = dict(prompt=PROMPTS, n=2, max_tokens=6, seed=5, logprobs=1, echo=True,
                ignore_eos=True)
    whole = completions(url, **body).json()["choices"]
    asked = []
    request_output = engine.request_output

    def answering(request_id: str):
        asked.append(request_id)
        if finished_first:
            raise KeyError(request_id)
        return request_output(request_id)

    monkeypatch.setattr(engine, "request_output", answering)
    streamed = list(openai_client(url).completions.create(
        model=MODEL, stream=True, **{k: v for k, v in body.items() if k != "ignore_eos"},
        extra_body={"ignore_eos": True}))
    assert asked
    if finished_first:  # its final output: one chunk per choice (a running stream has one
        assert len(streamed) == len(whole)  # or more, as fast as the engine goes)
    for expected in whole:
        chunks = [c.choices[0] for c in streamed if c.choices[0].index == expected["index"]]
        prompt = PROMPTS[expected["index"] // 2]
        assert chunks[0].text.startswith(prompt)
        assert not any(c.text.startswith(prompt) for c in chunks[1:])
        assert "".join(c.text for c in chunks) == expected["text"]
        for field in ("tokens", "token_logprobs"):
            assert [x for c in chunks for x in getattr(c.logprobs, field)] == pytest.approx(
                expected["logprobs"][field]), field
        sent = 0  # as vLLM's: a chunk's offsets start at the text sent before it
        for chunk in chunks:
            names = chunk.logprobs.tokens
            assert chunk.logprobs.text_offset == [sent + sum(map(len, names[:i]))
                                                  for i in range(len(names))]
            sent += len(chunk.text)
        tops = [top for c in chunks for top in c.logprobs.top_logprobs]
        assert len(tops) == len(expected["logprobs"]["top_logprobs"])
        for top, expected_top in zip(tops, expected["logprobs"]["top_logprobs"]):
            assert top == (None if expected_top is None else pytest.approx(expected_top))


def test_return_tokens_as_token_ids_names_every_log_prob_token_by_id(served):
    client = openai_client(served[0])
    completion = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=5, logprobs=2, echo=True,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True}).choices[0]
    ids = completion.model_extra["prompt_token_ids"] + completion.model_extra["token_ids"]
    assert completion.logprobs.tokens == [f"token_id:{t}" for t in ids]
    names = [name for top in completion.logprobs.top_logprobs if top for name in top]
    assert names and all(re.fullmatch(r"token_id:\d+", name) for name in names)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
        logprobs=True, top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True}).choices[0]
    content = reply.logprobs.content
    assert [entry.token for entry in content] == [
        f"token_id:{t}" for t in reply.model_extra["token_ids"]]
    assert all(re.fullmatch(r"token_id:\d+", top.token) and top.bytes == list(top.token.encode())
               for entry in content for top in entry.top_logprobs)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_echo_starts_the_reply_with_the_last_message_of_its_role(served, stream):
    client = openai_client(served[0])

    def reply(messages, echo: bool, **extra) -> list[str]:
        response = client.chat.completions.create(
            model=MODEL, messages=messages, n=2, max_tokens=6, seed=9, stream=stream,
            extra_body={"echo": echo, **extra})
        if not stream:
            return [choice.message.content for choice in response.choices]
        texts = ["", ""]
        for chunk in response:
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
        return texts

    prefill = [{"role": "user", "content": "What is 2+3?"},
               {"role": "assistant", "content": "The answer is"}]
    assert reply(prefill, True) == ["The answer is" + t for t in reply(prefill, False)]
    question = prefill[:1]
    assert reply(question, True) == reply(question, False)  # the user's turn is not echoed
    raw = {"add_generation_prompt": False}
    assert reply(question, True, **raw) == ["What is 2+3?" + t
                                            for t in reply(question, False, **raw)]


def test_chat_prompt_logprobs_sit_beside_the_choices_as_vllm_puts_them(served, offline,
                                                                       tokenizer):
    messages = [{"role": "user", "content": "What is 17*4?"}]
    expected = offline.chat(messages, SamplingParams(max_tokens=2, prompt_logprobs=2),
                            use_tqdm=False)[0]
    answer = chat(served[0], messages=messages, max_tokens=2, prompt_logprobs=2).json()
    check_vllm_prompt_logprobs(answer["prompt_logprobs"], expected, 2, tokenizer)
    assert "prompt_logprobs" not in answer["choices"][0]


def stop_string_in(text: str) -> tuple[str, int]:
    """Three printable ASCII characters of ``text`` after its start, and where they first
    appear."""
    for start in range(3, len(text) - 3):
        stop = text[start:start + 3]
        if stop.isascii() and stop.isprintable() and text.find(stop) == start:
            return stop, start
    raise AssertionError(f"no stop string to pick in {text!r}")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_include_stop_str_in_output_keeps_what_stopped_the_completion(served, offline,
                                                                      tokenizer, stream):
    greedy = offline.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=24,
                                                          ignore_eos=True), use_tqdm=False)
    token_ids = greedy[0].outputs[0].token_ids
    text = tokenizer.decode(token_ids)
    stop, start = stop_string_in(text)
    client = openai_client(served[0])

    def completed(**body) -> str:
        response = client.completions.create(model=MODEL, prompt=PROMPTS[0], temperature=0,
                                             max_tokens=24, stream=stream, **body)
        return "".join(c.choices[0].text for c in response) if stream \
            else response.choices[0].text

    assert completed(stop=[stop]) == text[:start]
    assert completed(stop=[stop], extra_body={"include_stop_str_in_output": True}) == \
        text[:start + len(stop)]
    stop_token = token_ids[5]  # a stop token's text is kept too
    kept = {"stop_token_ids": [stop_token], "include_stop_str_in_output": True}
    assert completed(extra_body=kept) == tokenizer.decode(
        token_ids[:token_ids.index(stop_token) + 1])


def test_skip_special_tokens_false_keeps_them_and_min_p_1_keeps_only_the_argmax(
        served, tokenizer):
    body = dict(prompt=PROMPTS[1], n=4, max_tokens=40, seed=3, ignore_eos=True,
                return_token_ids=True)
    kept = completions(served[0], **body, skip_special_tokens=False).json()["choices"]
    assert any(t in tokenizer.all_special_ids for c in kept for t in c["token_ids"])
    for choice in kept:
        assert choice["text"] == tokenizer.decode(choice["token_ids"],
                                                  skip_special_tokens=False)
    dropped = completions(served[0], **body).json()["choices"]
    assert [c["text"] for c in dropped] == [
        tokenizer.decode(c["token_ids"], skip_special_tokens=True) for c in kept]
    greedy = completions(served[0], prompt=PROMPTS[0], temperature=0, max_tokens=12,
                         ignore_eos=True).json()["choices"][0]["text"]
    assert completions(served[0], prompt=PROMPTS[0], min_p=1.0, seed=4, max_tokens=12,
                       ignore_eos=True).json()["choices"][0]["text"] == greedy


# A value of each field of UNHONOURED that would change the answer (with the fields it
# needs beside it).
REFUSED_VALUES = {
    "suffix": "!", "best_of": 2, "use_beam_search": True, "length_penalty": 0.5,
    "logit_bias": {"5": 3.0}, "allowed_token_ids": [5, 6], "bad_words": ["fox"],
    "logprob_token_ids": [5], "truncate_prompt_tokens": 4, "truncation_side": "left",
    "add_special_tokens": False, "spaces_between_special_tokens": True,
    "prompt_embeds": "AAAA", "priority": 1, "cache_salt": "salt", "kv_transfer_params": {},
    "ec_transfer_params": {}, "vllm_xargs": {"a": 1}, "repetition_detection": {},
    "thinking_token_budget": 10, "reasoning_effort": "low", "include_reasoning": False,
    "stream_interval": 2, "watermarking": True, "routed_experts_prompt_start": 1,
    "request_id": "mine", "parallel_tool_calls": False,
    "functions": [{"name": "f", "parameters": {}}], "function_call": "auto",
    "chat_template": "{{ messages }}", "documents": [{"text": "x"}],
    "mm_processor_kwargs": {}, "media_io_kwargs": {}, "audio": {"voice": "alloy"},
    "modalities": ["text", "audio"], "prediction": {"type": "content", "content": "x"},
    "web_search_options": {}, "store": True, "service_tier": "flex",
}
NEEDED_BESIDE = {"spaces_between_special_tokens": {"skip_special_tokens": False}}


def test_every_refusal_has_a_test_value():
    assert set(REFUSED_VALUES) == set(UNHONOURED)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_every_unhonoured_field_is_refused_naming_it_and_harmless_values_pass(served, route):
    url, engine = served
    ok = {"completions": {"prompt": "x", "max_tokens": 2},
          "chat": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}}[route]
    send = completions if route == "completions" else chat
    for name, value in REFUSED_VALUES.items():
        if route == "chat" and name == "add_special_tokens":
            continue  # the chat route's own option
        answer = send(url, **ok, **NEEDED_BESIDE.get(name, {}), **{name: value})
        assert answer.status_code == 400, (name, answer.text)
        error = answer.json()["error"]
        assert error["param"] == name and "not supported" in error["message"], error
    harmless = {"logit_bias": {}, "best_of": 1, "suffix": None, "user": "someone",
                "spaces_between_special_tokens": True, "store": False,
                "service_tier": "auto", "length_penalty": 1.0, "bad_words": []}
    answer = send(url, **ok, **harmless)
    assert answer.status_code == 200, answer.text
    wait_until_idle(engine)
    assert engine.stats()["kv_blocks_used"] == 0


def test_the_openai_sdk_sees_refusals_as_bad_requests_naming_the_field(served):
    client = openai_client(served[0])
    for kwargs, param in (({"logit_bias": {"5": 3}}, "logit_bias"), ({"suffix": "!"}, "suffix"),
                          ({"best_of": 2}, "best_of")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=MODEL, prompt="x", max_tokens=2, **kwargs)
        assert refused.value.body["param"] == param


def test_prompt_logprobs_past_max_logprobs_or_in_a_stream_are_refused(served):
    url, _ = served
    for route, body in (("completions", {"prompt": "x"}),
                        ("chat", {"messages": [{"role": "user", "content": "x"}]})):
        send = completions if route == "completions" else chat
        over = send(url, **body, max_tokens=2, prompt_logprobs=21).json()["error"]
        assert over["param"] == "prompt_logprobs" and "--max-logprobs" in over["message"]
        streamed = send(url, **body, max_tokens=2, prompt_logprobs=1, stream=True)
        assert streamed.status_code == 400
        assert streamed.json()["error"]["param"] == "prompt_logprobs"
    echoed = completions(url, prompt="x", max_tokens=2, logprobs=21, echo=True)
    assert echoed.status_code == 400 and echoed.json()["error"]["param"] == "logprobs"


def test_echo_past_the_server_limits_is_refused_and_accepted_requests_go_on(served, offline):
    url, engine = served
    expected = offline.generate(PROMPTS[:1], SamplingParams(max_tokens=40, seed=3,
                                                            ignore_eos=True), use_tqdm=False)
    long_prompt = list(range(5, 5 + LIMITS["max_prompt_tokens"] + 1))

    bodies = [{"prompt": long_prompt, "max_tokens": 0, "echo": True, "logprobs": 1},
              {"prompt": [TOKEN_PROMPTS[0], long_prompt], "max_tokens": 1, "echo": True,
               "logprobs": 1},
              {"prompt": [TOKEN_PROMPTS[1]] * (MAX_NUM_WAITING + 1), "max_tokens": 0,
               "echo": True, "logprobs": 1},
              {"prompt": TOKEN_PROMPTS, "max_tokens": 0, "echo": True, "logprobs": 1}]
    requests = [dict(method="POST", url=f"{url}/v1/completions", headers=AUTH, json=body)
                for body in bodies]
    text, (alone, batched, too_many, fine) = asyncio.run(stream_while(url, requests))
    assert text == expected[0].outputs[0].text
    for refused in (alone, batched):
        error = refused.json()["error"]
        assert refused.status_code == 400 and error["param"] == "prompt"
        assert "--max-prompt-tokens" in error["message"] and "shorten" in error["message"]
    assert too_many.status_code == 400
    assert "--max-num-waiting" in too_many.json()["error"]["message"]
    assert fine.status_code == 200 and len(fine.json()["choices"]) == len(TOKEN_PROMPTS)
    wait_until_idle(engine)
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == stats["num_waiting"] == 0
