"""Greedy output and prompt log-probs against Hugging Face transformers, per architecture."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.rollout import LLM, SamplingParams

ARCHITECTURES = ["llama", "qwen2", "qwen3", "mistral", "llama3-rope", "linear-rope",
                 "yarn-rope"]
PROMPTS = ["What is 2+3?", "The quick brown fox jumps over the lazy dog and then",
           "def", "Tandem shares a GPU with the trainer and samples groups of completions."]


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy completion of one prompt, alone and unpadded."""
    input_ids = torch.tensor([prompt_ids])
    out = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                            do_sample=False, max_new_tokens=max_new_tokens,
                            min_new_tokens=max_new_tokens)
    return out[0, len(prompt_ids):].tolist()


def engine_and_reference(folder) -> tuple[LLM, AutoModelForCausalLM, list[list[int]]]:
    """An engine and transformers' model of one folder, and PROMPTS as token ids."""
    llm = LLM(str(folder))
    prompts = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    return llm, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), prompts


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_greedy_batch_matches_transformers_per_prompt(model_dir, kind):
    llm, hf_model, prompts = engine_and_reference(model_dir(kind))
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, min_tokens=32),
                           use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, 32)
        assert output.outputs[0].finish_reason == "length"


def check_prompt_logprobs(llm: LLM, hf_model, prompts: list[list[int]], k: int,
                          max_tokens: int = 1, tolerance: float = 1e-4) -> None:
    """The public ``prompt_logprobs`` (every prompt in one call) against transformers'
    log-softmax: each prompt token's log-prob given the tokens before it (within
    ``tolerance``), and the top k."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=k)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            reference = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0], -1)
        assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
        for position, entry in enumerate(output.prompt_logprobs[1:], start=1):
            expected = reference[position - 1]
            top = set(expected.topk(k).indices.tolist()) if k else set()
            assert set(entry) == top | {prompt[position]}
            ours = torch.tensor(list(entry.values()))
            assert (ours - expected[list(entry)]).abs().max().item() < tolerance


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_prompt_logprobs_match_transformers_forward(model_dir, kind):
    llm, hf_model, prompts = engine_and_reference(model_dir(kind))
    check_prompt_logprobs(llm, hf_model, prompts, k=hf_model.config.vocab_size)  # all of it
    assert llm.stats()["kv_blocks_used"] == 0


def test_prompt_logprobs_survive_chunking_preemption_and_the_prefix_cache(llama_dir):
    """Prompt log-probs are scored in full whatever the schedule: chunked prefill, a prompt
    whose prefix is cached (never served from the cache), and a pool so small it preempts."""
    hf_model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    prompts = [tokenizer.encode(PROMPTS[3]), tokenizer.encode(PROMPTS[3] + " and again")]
    for llm in (LLM(str(llama_dir), max_num_batched_tokens=7),
                LLM(str(llama_dir), num_kv_blocks=12, block_size=8, max_model_len=96)):
        llm.generate(prompts[:1], SamplingParams(max_tokens=1), use_tqdm=False)  # cache it
        check_prompt_logprobs(llm, hf_model, prompts, k=3, max_tokens=24)
        assert llm.stats()["kv_blocks_used"] == 0
    assert llm.stats()["preemptions"] > 0
    assert llm.generate(prompts[:1], SamplingParams(max_tokens=1),
                        use_tqdm=False)[0].prompt_logprobs is None


def test_tied_embeddings_share_one_tensor(model_dir):
    llm = LLM(str(model_dir("qwen3")))
    model = llm.engine.runner.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
