"""Processed log-probs, truncation and seeds, checked against a transformers forward pass."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.rollout import LLM, SamplingParams
from tandem.rollout.core.sequence import Sequence
from tandem.rollout.worker.sampler import Sampler, seeded_uniforms


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), seed=1)


@pytest.fixture(scope="module")
def hf_model(llama_dir):
    return AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)


def hf_logits(hf_model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Logits predicting each completion token, from one forward over prompt + completion."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = hf_model(ids).logits[0]
    return logits[len(prompt) - 1: len(prompt) - 1 + len(completion)]


def test_logprobs_are_log_softmax_at_temperature(llm, hf_model):
    prompts = [llm.get_tokenizer().encode(p) for p in ["What is 2+3?", "The quick brown"]]
    params = SamplingParams(n=3, temperature=0.7, max_tokens=24, logprobs=0, seed=5)
    for prompt, output in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        for completion in output.outputs:
            reference = torch.log_softmax(
                hf_logits(hf_model, prompt, completion.token_ids) / 0.7, dim=-1)
            expected = reference.gather(1, torch.tensor(completion.token_ids)[:, None])
            assert len(completion.logprobs) == len(completion.token_ids)
            got = torch.tensor(completion.logprobs)
            assert (got - expected.squeeze(1)).abs().max().item() < 1e-4
            assert completion.cumulative_logprob == pytest.approx(sum(completion.logprobs))


@pytest.mark.parametrize("truncation", [dict(top_k=5), dict(top_p=0.6), dict(min_p=0.2)])
def test_truncated_logprobs_renormalise_over_kept_tokens(llm, hf_model, truncation):
    prompt = llm.get_tokenizer().encode("Seventeen times four")
    params = SamplingParams(temperature=0.9, max_tokens=12, logprobs=3, seed=3, **truncation)
    completion = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    logits = hf_logits(hf_model, prompt, completion.token_ids) / 0.9
    for position, token in enumerate(completion.token_ids):
        kept = kept_tokens(logits[position], **truncation)
        assert token in kept
        expected = torch.log_softmax(logits[position][kept], dim=-1)
        assert completion.logprobs[position] == pytest.approx(
            expected[kept.index(token)].item(), abs=1e-4)
        top = completion.top_logprobs[position]
        assert len(top) == 3 and max(top.values()) <= 0.0
        assert math.isclose(sum(math.exp(v) for v in expected.tolist()), 1.0, rel_tol=1e-4)
        threshold = completion.sampling_thresholds[position]  # rebuilds the same set
        assert sorted(torch.nonzero(logits[position] >= threshold).flatten().tolist()) == \
            sorted(kept)


def test_untruncated_sampling_returns_no_thresholds(llm):
    completion = llm.generate([[5, 6]], SamplingParams(max_tokens=3, seed=0),
                              use_tqdm=False)[0].outputs[0]
    assert completion.sampling_thresholds is None


def kept_tokens(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0,
                min_p: float = 0.0) -> list[int]:
    """The tokens a truncation keeps, computed the plain way (sorted, cumulative)."""
    probs = logits.softmax(-1)
    order = probs.argsort(descending=True).tolist()
    if top_k:
        return order[:top_k]
    if min_p:
        return [t for t in order if probs[t] >= min_p * probs[order[0]]]
    kept, total = [], 0.0
    for t in order:
        kept.append(t)
        total += probs[t].item()
        if total >= top_p:
            return kept
    return kept


def test_seeded_request_is_reproducible_alone_and_in_busy_batch(llm):
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode("What is 2+3?")
    params = SamplingParams(temperature=1.0, max_tokens=20, seed=1234)
    alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [tokenizer.encode(t) for t in ["The quick brown fox", "def add(a, b):", "Seven"]]
    busy_params = [SamplingParams(temperature=1.0, max_tokens=30)] * 3 + [params]
    busy = llm.generate(others + [prompt], busy_params, use_tqdm=False)[3].outputs[0].token_ids
    assert alone == busy


def test_greedy_ignores_truncation_and_reports_untruncated_logprobs(llm, hf_model):
    prompt = llm.get_tokenizer().encode("The quick brown")
    params = SamplingParams(temperature=0, top_k=2, max_tokens=8, logprobs=0, ignore_eos=True)
    completion = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    logits = hf_logits(hf_model, prompt, completion.token_ids)
    assert completion.token_ids == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).max(-1).values
    assert torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-4)


def test_repetition_penalty_changes_greedy_choice_like_transformers(llm, hf_model):
    prompt = llm.get_tokenizer().encode("The quick brown fox jumps")
    params = SamplingParams(temperature=0, repetition_penalty=1.5, max_tokens=16,
                            ignore_eos=True)
    ours = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    reference = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=16,
                                  min_new_tokens=16, repetition_penalty=1.5,
                                  attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert ours == reference[0, len(prompt):].tolist()


def test_min_tokens_suppresses_eos(llm):
    prompt = llm.get_tokenizer().encode("What")
    eos = sorted(llm.engine.eos_token_ids)[0]
    params = SamplingParams(temperature=1.0, max_tokens=6, min_tokens=6, seed=0,
                            stop_token_ids=[5])
    for output in llm.generate([prompt] * 4, params, use_tqdm=False):
        tokens = output.outputs[0].token_ids
        assert len(tokens) == 6 and eos not in tokens and 5 not in tokens


def test_sampled_frequencies_follow_processed_distribution():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    logits = (probs + 1e-30).log().repeat(4000, 1)
    seqs = [Sequence(seq_id=i, request_id="r", index=0, token_ids=[1], num_prompt_tokens=1,
                     sampling_params=SamplingParams(temperature=1.0)) for i in range(4000)]
    output = Sampler(set(), seed=0, device=torch.device("cpu"))(logits, seqs)
    counts = torch.bincount(torch.tensor(output.token_ids), minlength=5).float() / 4000
    assert counts[4] == 0
    assert (counts - probs).abs().max() < 0.03
    expected = torch.log_softmax(logits[0], -1)[torch.tensor(output.token_ids)]
    assert torch.allclose(torch.tensor(output.logprobs), expected)


def seeded_seqs(seeds: list[int], num_outputs: list[int]) -> list[Sequence]:
    """Sampling sequences with ``seeds``, each ``num_outputs[i]`` tokens into its output."""
    return [Sequence(seq_id=i, request_id="r", index=0, token_ids=[1] * (1 + k),
                     num_prompt_tokens=1, seed=seed,
                     sampling_params=SamplingParams(temperature=1.0, seed=seed))
            for i, (seed, k) in enumerate(zip(seeds, num_outputs))]


def test_seeded_uniforms_are_uniform_and_keyed_by_seed_and_counter():
    draws = seeded_uniforms([7] * 20000, list(range(20000)))
    across = seeded_uniforms(list(range(20000)), [0] * 20000)  # every seed's first draw
    for values in (draws, across):
        assert values.dtype == torch.float32 and 0 <= values.min() and values.max() < 1
        counts = torch.histc(values, bins=20, min=0, max=1)
        chi2 = ((counts - 1000) ** 2 / 1000).sum()
        assert chi2 < 45  # 19 degrees of freedom: p < 0.001 past 43.8
        assert abs(torch.corrcoef(torch.stack([values[:-1], values[1:]]))[0, 1]) < 0.03
    assert torch.equal(seeded_uniforms([7, 7, 8], [3, 4, 3]),
                       torch.cat([draws[3:5], seeded_uniforms([8], [3])]))
    assert seeded_uniforms([2**64 + 5], [1]) == seeded_uniforms([5], [1])


def test_a_seeded_row_samples_from_its_seed_and_position_alone():
    """The same (seed, output index) picks the same token whatever rows sit beside it, and
    seeded rows follow the distribution as unseeded ones do."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    logits = (probs + 1e-30).log().repeat(4000, 1)
    sampler = Sampler(set(), seed=0, device=torch.device("cpu"))
    output = sampler(logits, seeded_seqs(list(range(4000)), [3] * 4000))
    counts = torch.bincount(torch.tensor(output.token_ids), minlength=5).float() / 4000
    assert counts[4] == 0 and (counts - probs).abs().max() < 0.03
    alone = [sampler(logits[:1], seeded_seqs([seed], [3])).token_ids[0] for seed in range(40)]
    assert alone == output.token_ids[:40]
    later = sampler(logits[:40], seeded_seqs(list(range(40)), [4] * 40)).token_ids
    assert later != alone  # the next output index draws anew
