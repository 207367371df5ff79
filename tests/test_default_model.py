"""The embedded SmolLM2-135M-Instruct: built from its PyPI wheel, equal to transformers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.rollout import LLM, SamplingParams
from tandem.rollout.default_model import DEFAULT_MODEL, embedded_model_dir

from .test_models import check_prompt_logprobs, hf_greedy

pytestmark = pytest.mark.slow
QUESTIONS = ["What is 2+3?", "If I have 7 apples and eat 2, how many are left?",
             "Write one sentence about the sea."]


def test_embedded_model_greedy_and_logits_match_transformers():
    llm = LLM(DEFAULT_MODEL)
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                             add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
               for q in QUESTIONS]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, min_tokens=32),
                           use_tqdm=False)
    hf_model = AutoModelForCausalLM.from_pretrained(embedded_model_dir(), dtype=torch.float32)
    for prompt, output in zip(prompts, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf_model, prompt, 32)
    check_prompt_logprobs(llm, hf_model, prompts, k=20)
