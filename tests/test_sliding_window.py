"""Sliding-window attention per layer, against transformers: greedy tokens and prompt
log-probs past the window, on every backend; chunked prefill and a prefix-cache hit longer
than the window against a whole prefill and no cache; exact log-probs bit for bit (an FP8
pool too) and gradients; a max_model_len beyond the window; configs refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config, Qwen3Config

from tandem.rollout import LLM, SamplingParams
from tandem.rollout.worker.models import model_class
from tandem.trainers.policy import token_batch

from .conftest import SMALL, build_tokenizer
from .test_exact_logprobs import assert_exact, assert_gradients_match, sampled, trainer_logprobs
from .test_models import check_prompt_logprobs, hf_greedy

WINDOW = 8
# Each kind's config, and the windows its two layers take: every layer (Mistral, no
# layer_types), the layers from max_window_layers on (Qwen2's layer_types, derived), and
# layer_types given (Qwen3).
CONFIGS = {
    "mistral": (lambda v: MistralConfig(vocab_size=v, sliding_window=WINDOW, **SMALL),
                [WINDOW, WINDOW]),
    "qwen2": (lambda v: Qwen2Config(vocab_size=v, use_sliding_window=True,
                                    sliding_window=WINDOW, max_window_layers=1,
                                    tie_word_embeddings=False, **SMALL), [None, WINDOW]),
    "qwen3": (lambda v: Qwen3Config(vocab_size=v, head_dim=32, use_sliding_window=True,
                                    sliding_window=WINDOW,
                                    layer_types=["sliding_attention", "full_attention"],
                                    tie_word_embeddings=True, **SMALL), [WINDOW, None]),
}
# Prompts of several windows, one shorter than a window, one of several blocks plus one.
PROMPTS = [[(11 * i + 3 * j) % 250 + 4 for j in range(length)]
           for i, length in enumerate((35, 5, 41))]


@pytest.fixture(scope="module")
def window_dir(tmp_path_factory: pytest.TempPathFactory):
    """A factory: ``window_dir("qwen3")`` is the folder of that tiny windowed model."""
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            path, tokenizer = tmp_path_factory.mktemp(f"{kind}-window"), build_tokenizer()
            torch.manual_seed(0)
            config = CONFIGS[kind][0](len(tokenizer))
            AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
            tokenizer.save_pretrained(path)
            built[kind] = path
        return built[kind]

    return get


def reference(path: Path, attention: str = "sdpa", dtype: torch.dtype = torch.float32):
    """transformers' model of ``path``."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                attn_implementation=attention)


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = 20):
    """Each prompt's greedy completion and its tokens' log-probs."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("kind", CONFIGS)
def test_greedy_and_prompt_logprobs_match_transformers_past_the_window(window_dir, kind,
                                                                        backend):
    path = window_dir(kind)
    llm = LLM(str(path), attention_backend=backend, block_size=4)
    windows = [layer.sliding_window for layer in llm.engine.runner.model.attention_layers()]
    assert windows == CONFIGS[kind][1]
    hf_model = reference(path, "eager" if kind == "mistral" else "sdpa")
    for prompt, (tokens, _) in zip(PROMPTS, greedy(llm, PROMPTS)):
        assert tokens == hf_greedy(hf_model, prompt, 20)
    check_prompt_logprobs(llm, hf_model, PROMPTS, k=3)


def test_the_window_changes_what_transformers_and_the_engine_compute(window_dir):
    # Not vacuous: past the window, the same weights attending in full score otherwise.
    path = window_dir("mistral")
    windowed, full = reference(path), AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, sliding_window=None)
    with torch.no_grad():
        ids = torch.tensor([PROMPTS[0]])
        assert not torch.allclose(windowed(ids).logits, full(ids).logits, atol=1e-3)


def test_a_group_decoded_as_a_cascade_keeps_the_window(window_dir):
    # The torch backend lays a group's decodes out as a cascade over its shared prompt
    # blocks; a window shorter than the prompt reads each decode's window instead.
    path = window_dir("mistral")
    llm = LLM(str(path), attention_backend="torch", block_size=4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=3)
    hf_model = reference(path)
    for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False)):
        expected = hf_greedy(hf_model, prompt, 12)
        assert [c.token_ids for c in output.outputs] == [expected] * 3


@pytest.mark.parametrize("kind", ["mistral", "qwen3"])
def test_chunked_prefill_and_a_cached_prefix_beyond_the_window_equal_a_whole_prefill(
        window_dir, kind):
    # Bit for bit (the CPU kernels are batch-invariant): chunks of 5 tokens cross block
    # and window edges; the cached prefix holds 40 tokens, five windows.
    path = window_dir(kind)
    whole = greedy(LLM(str(path), block_size=4, enable_prefix_caching=False), PROMPTS)
    assert greedy(LLM(str(path), block_size=4, max_num_batched_tokens=5), PROMPTS) == whole
    cached = LLM(str(path), block_size=4)
    cached.generate([PROMPTS[2]], SamplingParams(max_tokens=1), use_tqdm=False)
    assert greedy(cached, PROMPTS[2:]) == whole[2:]
    assert cached.stats()["prefix_cache_hit_tokens"] >= 5 * WINDOW


@pytest.mark.parametrize("kind,dtype,kv_cache_dtype", [
    *((kind, dtype, "auto") for kind in ("mistral", "qwen3") for dtype in ("float32", "bfloat16")),
    ("mistral", "float32", "fp8")])  # the kernels dequantize: nothing window-specific
def test_trainer_logprobs_are_the_engines_bit_for_bit_under_a_window(window_dir, kind, dtype,
                                                                     kv_cache_dtype):
    # Chunked prefill, groups sharing their prompt's blocks; Qwen3's sliding layer in a KV
    # group of its own (pages of one layer: twice as many for the same bytes).
    path = window_dir(kind)
    llm = LLM(str(path), dtype=dtype, max_model_len=96, max_num_batched_tokens=16,
              num_kv_blocks=80 if kind == "qwen3" else 40,
              block_size=4, kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=3,
                            logprobs=0, n=2)
    prompts, completions, sampler_logprobs, _ = sampled(llm, params, PROMPTS)
    model = reference(path, dtype=getattr(torch, dtype))
    logprobs, mask = trainer_logprobs(model, llm, prompts, completions, 1.0)
    assert_exact(logprobs, mask, sampler_logprobs)


def test_gradients_through_a_window_match_autograd_through_transformers(window_dir):
    path = window_dir("qwen3")
    llm = LLM(str(path), max_model_len=96)
    prompts, completions, _, _ = sampled(llm, SamplingParams(max_tokens=12, seed=1, n=2),
                                         PROMPTS)
    assert_gradients_match(llm, reference(path), token_batch(prompts, completions, 0), 1e-4)


def test_the_triton_kernels_keep_the_window_in_the_interpreter(window_dir):
    # The CUDA path run by the interpreter: its decode and prefill kernels against
    # transformers, then exact log-probs (every query through the prefill kernel).
    path = window_dir("mistral")
    hf_model = reference(path)
    llm = LLM(str(path), attention_backend="triton", block_size=4, max_model_len=96,
              max_num_batched_tokens=16)
    for prompt, (tokens, _) in zip(PROMPTS[:2], greedy(llm, PROMPTS[:2], 12)):
        assert tokens == hf_greedy(hf_model, prompt, 12)
    check_prompt_logprobs(llm, hf_model, PROMPTS[:1], k=0)
    exact = LLM(str(path), attention_backend="triton", exact_logprobs=True, block_size=4,
                max_model_len=96, max_num_batched_tokens=16)
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=1, logprobs=0,
                            ignore_eos=True)
    prompts, completions, sampler_logprobs, _ = sampled(exact, params, PROMPTS[:2])
    logprobs, mask = trainer_logprobs(hf_model, exact, prompts, completions, 1.0)
    assert_exact(logprobs, mask, sampler_logprobs)


def test_max_model_len_reaches_past_the_window(window_dir):
    path = window_dir("mistral")
    assert LLM(str(path), num_kv_blocks=40).engine.max_model_len == SMALL[
        "max_position_embeddings"]
    llm = LLM(str(path), max_model_len=64, num_kv_blocks=40)
    output = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=29, ignore_eos=True),
                          use_tqdm=False)[0]
    assert len(PROMPTS[0]) + len(output.outputs[0].token_ids) == 64


@pytest.mark.parametrize("config,message", [
    (Qwen3Config(layer_types=["chunked_attention", "full_attention"], **SMALL),
     r"layer_types\[0\] is 'chunked_attention'.*'full_attention', 'sliding_attention'"),
    (MistralConfig(sliding_window=0, **SMALL), "sliding_window=0 .*at least 1"),
    (Qwen3Config(use_sliding_window=True, sliding_window=-4, max_window_layers=1, **SMALL),
     r"sliding_window=-4 \(layer 1\)")])
def test_an_unknown_layer_type_or_a_window_under_one_is_refused(config, message):
    with pytest.raises(ValueError, match=message):
        model_class(config)
