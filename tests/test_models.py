"""Greedy output and prompt logits against Hugging Face transformers, per architecture."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.rollout import LLM, SamplingParams
from tandem.rollout.scheduler import ScheduledBatch

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


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_greedy_batch_matches_transformers_per_prompt(model_dir, kind):
    folder = model_dir(kind)
    llm = LLM(str(folder))
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, min_tokens=32),
                           use_tqdm=False)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for prompt, output in zip(prompts, outputs):
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, 32)
        assert output.outputs[0].finish_reason == "length"


def engine_prompt_logits(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Logits of every prompt position, all prompts prefilled in one step.

    The engine must run without prefix caching, or shared prefixes would be skipped.
    """
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"logits-{i}", prompt, SamplingParams(max_tokens=1))
    batch: ScheduledBatch = engine.scheduler.schedule()
    assert len(batch.seqs) == len(prompts) and batch.num_decodes == 0
    logits = engine.runner.prompt_logits(batch)
    for i in range(len(prompts)):
        engine.abort_request(f"logits-{i}")
    return list(logits.split([len(p) for p in prompts]))


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_prompt_logits_match_transformers_forward(model_dir, kind):
    folder = model_dir(kind)
    llm = LLM(str(folder), enable_prefix_caching=False)
    prompts = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    logits = engine_prompt_logits(llm, prompts)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for prompt, ours in zip(prompts, logits):
        with torch.no_grad():
            reference = hf_model(torch.tensor([prompt])).logits[0]
        assert (ours - reference).abs().max().item() < 1e-4
    assert llm.stats()["kv_blocks_used"] == 0


def test_tied_embeddings_share_one_tensor(model_dir):
    llm = LLM(str(model_dir("qwen3")))
    model = llm.engine.runner.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
