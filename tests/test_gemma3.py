"""Gemma 3 (``Gemma3ForCausalLM``, text) and Gemma 2 (``Gemma2ForCausalLM``) against
transformers on tiny random models of grouped-query attention (4 query heads of 16 over a
hidden size of 48, 2 KV heads), their norms' weights drawn at random (transformers starts
them at zero, where ``1 + weight`` would hide them): layers mixing sliding windows of 8
tokens (crossed by the longer prompts) and full attention, Gemma 3 rotating each layer type
its own way (theta 1e4, and 1e6 scaled linearly by 8), Gemma 2 soft-capping its attention
scores and logits (caps low enough to bend them). Greedy tokens and prompt log-probs, the
rotary tables, chunked prefill, exact log-probs (float32, bfloat16, Triton's interpreter)
and their gradients, weight updates by transformers' names, run-time LoRA, TP=2, and bad
configs refused naming the fix. The family's kernels (Gemma's RMSNorm, the GELU-tanh-gated
product) are tests/test_layers.py's and tests/test_cpu_layers.py's."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

from tandem.rollout import LLM, SamplingParams
from tandem.rollout.worker.models import model_class
from tandem.rollout.worker.models.gemma3 import Gemma2ForCausalLM, Gemma3ForCausalLM
from tandem.rollout.worker.models.rotary import RotaryEmbedding
from tandem.trainers.policy import token_batch

from .conftest import build_tokenizer
from .test_exact_logprobs import (
    assert_exact,
    assert_gradients_match,
    sampled,
    trainer_logprobs,
)
from .test_model_contract import assert_runtime_lora_equals_its_merge
from .test_models import check_prompt_logprobs, hf_greedy

GEOMETRY = dict(hidden_size=48, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                max_position_embeddings=512, initializer_range=0.2, bos_token_id=0,
                eos_token_id=1, pad_token_id=1)
ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}
CONFIGS = {
    "gemma3": (Gemma3TextConfig, dict(rope_parameters=ROPE, layer_types=[
        "sliding_attention", "full_attention", "sliding_attention", "sliding_attention"])),
    # layer_types by default: sliding and full in turn
    "gemma2": (Gemma2Config, dict(final_logit_softcapping=8.0, attn_logit_softcapping=5.0)),
}
FAMILIES = {"gemma3": Gemma3ForCausalLM, "gemma2": Gemma2ForCausalLM}
PROMPTS = [[1, 5, 9, 2, 7], [(7 * i) % 300 + 2 for i in range(30)], [1, 12]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
LAYER = "model.layers.1"
# A KV pool the size of 24 blocks of 4 tokens of every layer's K and V (4 layers, 2 KV heads
# of 16), in bytes (its pages hold fewer layers under KV groups): it preempts the exact test.
POOL_BYTES = {dtype: 24 * 4 * 4 * 2 * 2 * 16 * size for dtype, size in
              (("float32", 4), ("bfloat16", 2))}


def gemma_config(kind: str, **overrides) -> Gemma3TextConfig | Gemma2Config:
    """A tiny config of ``kind`` (its own copy: transformers keeps the rope dicts)."""
    config_class, extra = CONFIGS[kind]
    return config_class(vocab_size=len(build_tokenizer()),
                        **copy.deepcopy({**GEOMETRY, **extra, **overrides}))


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    """A factory: ``gemma_dir("gemma2", seed)`` is that tiny model's folder (built once)."""
    built = {}

    def get(kind: str, seed: int = 0):
        if (kind, seed) not in built:
            path = tmp_path_factory.mktemp(f"{kind}_{seed}")
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(gemma_config(kind), dtype=torch.float32)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if "norm" in name:
                        param.normal_(0.0, 0.5)
            model.save_pretrained(path)
            build_tokenizer().save_pretrained(path)
            built[kind, seed] = path
        return built[kind, seed]

    return get


def reference(folder, dtype: torch.dtype = torch.float32):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)


def greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("kind", CONFIGS)
def test_greedy_and_prompt_logprobs_match_transformers(gemma_dir, kind):
    llm = LLM(str(gemma_dir(kind)))
    assert type(llm.engine.runner.model) is FAMILIES[kind]
    hf_model = reference(gemma_dir(kind))
    assert greedy(llm) == [hf_greedy(hf_model, prompt, 12) for prompt in PROMPTS]
    check_prompt_logprobs(llm, hf_model, PROMPTS, k=3)


@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_each_layer_types_rotary_tables_are_transformers(layer_type):
    config = gemma_config("gemma3")
    positions = torch.arange(100)[None]
    cos, sin = Gemma3RotaryEmbedding(config)(torch.zeros(1), positions, layer_type)
    tables = RotaryEmbedding(config, 16, 100, torch.device("cpu"))
    assert torch.equal(tables.tables(layer_type)[0], cos[0])
    assert torch.equal(tables.tables(layer_type)[1], sin[0])
    assert tables.cos.shape == (100, 2 * 16)  # both types' tables, side by side


def test_a_soft_capped_row_has_the_same_bits_in_any_batch(gemma_dir):
    # The cap's tanh is per element: a row's capped logits do not depend on its neighbours
    # (the sampler's rows against the trainer's [B, keep, V]).
    model = LLM(str(gemma_dir("gemma2"))).engine.runner.model
    logits = torch.randn(37, 321, generator=torch.Generator().manual_seed(0)) * 20
    rows = torch.cat([model.soft_cap(row[None]) for row in logits])
    assert torch.equal(model.soft_cap(logits), rows)
    assert torch.equal(model.soft_cap(logits.t().contiguous()).t(), rows)
    assert rows.abs().max() <= 8.0  # the cap


def test_chunked_prefill_equals_whole_prefill_bit_for_bit(gemma_dir):
    prompts = [[(3 * i) % 300 + 2 for i in range(length)] for length in (5, 17, 40)]
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=5, logprobs=0,
                            prompt_logprobs=2, ignore_eos=True)
    runs = [[(o.prompt_logprobs, o.outputs[0].token_ids, o.outputs[0].logprobs) for o in
             LLM(str(gemma_dir("gemma3")), max_num_batched_tokens=budget).generate(
                 prompts, params, use_tqdm=False)]
            for budget in (7, 256)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("kind", CONFIGS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trainer_logprobs_are_the_engines_bit_for_bit(gemma_dir, kind, dtype):
    # Chunked prefill, a shared prompt's blocks and preemption on the engine's side.
    path = gemma_dir(kind)
    llm = LLM(str(path), dtype=dtype, max_model_len=64, max_num_batched_tokens=16,
              kv_cache_memory_bytes=POOL_BYTES[dtype], block_size=4)
    params = SamplingParams(temperature=0.9, max_tokens=20, ignore_eos=True, seed=3,
                            logprobs=0, n=4)
    prompts, completions, sampler_logprobs, _ = sampled(llm, params)
    assert llm.stats()["preemptions"] > 0
    logprobs, mask = trainer_logprobs(reference(path, getattr(torch, dtype)), llm, prompts,
                                      completions, 0.9)
    assert_exact(logprobs, mask, sampler_logprobs)


@pytest.mark.parametrize("kind", CONFIGS)
def test_the_triton_kernels_are_exact_in_the_interpreter(gemma_dir, kind):
    # The CUDA path run by the interpreter, past the sliding window, with chunked prefill
    # and a copy-on-write group.
    path = gemma_dir(kind)
    llm = LLM(str(path), max_model_len=32, attention_backend="triton", exact_logprobs=True,
              max_num_batched_tokens=16, block_size=4, num_kv_blocks=64)
    assert llm.engine.runner.model.linear_layout == "triton (batch-invariant)"
    params = SamplingParams(temperature=1.0, max_tokens=4, seed=1, logprobs=0, n=2,
                            ignore_eos=True)
    prompts, completions, sampler_logprobs, _ = sampled(llm, params, [PROMPTS[1][:10]])
    logprobs, mask = trainer_logprobs(reference(path), llm, prompts, completions, 1.0)
    assert_exact(logprobs, mask, sampler_logprobs)


@pytest.mark.parametrize("kind", CONFIGS)
def test_gradients_match_autograd_through_transformers(gemma_dir, kind):
    # Through Gemma's norms (their 1 + weight), the GELU, the tied embedding's scale, the
    # per-type rotation and both soft caps, backwards.
    path = gemma_dir(kind)
    llm = LLM(str(path))
    prompts, completions, _, _ = sampled(llm, SamplingParams(max_tokens=12, seed=1, n=2))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager")
    assert_gradients_match(llm, model, token_batch(prompts, completions, 0), 1e-4)


def test_a_full_update_by_transformers_names_serves_the_new_weights(gemma_dir):
    llm = LLM(str(gemma_dir("gemma3")))
    new = reference(gemma_dir("gemma3", seed=1))
    llm.update_weights(new.named_parameters())
    assert greedy(llm) == [hf_greedy(new, prompt, 12) for prompt in PROMPTS]


def test_a_partial_update_equals_transformers_with_those_tensors(gemma_dir):
    llm = LLM(str(gemma_dir("gemma3")))
    new = dict(reference(gemma_dir("gemma3", seed=1)).named_parameters())
    names = [f"{LAYER}.self_attn.q_norm.weight", f"{LAYER}.pre_feedforward_layernorm.weight",
             f"{LAYER}.mlp.gate_proj.weight", "model.embed_tokens.weight"]
    llm.update_weights([(name, new[name]) for name in names], full=False)
    hf_model = reference(gemma_dir("gemma3"))
    hf_model.load_state_dict({name: new[name] for name in names}, strict=False)
    assert greedy(llm) == [hf_greedy(hf_model, prompt, 12) for prompt in PROMPTS]


def test_a_run_time_adapter_equals_its_merge(gemma_dir):
    generator = torch.Generator().manual_seed(2)
    shapes = {"self_attn.q_proj": (64, 48), "self_attn.v_proj": (32, 48),
              "mlp.up_proj": (96, 48), "mlp.down_proj": (48, 96)}
    factors = {f"{LAYER}.{module}.weight": (
        torch.randn(3, cols, generator=generator) * 0.1,
        torch.randn(rows, 3, generator=generator) * 0.1, 0.5)
        for module, (rows, cols) in shapes.items()}
    assert_runtime_lora_equals_its_merge(gemma_dir("gemma3"), factors, PROMPTS)


@pytest.mark.parametrize("kind", CONFIGS)
def test_tp2_equals_tp1(gemma_dir, kind):
    path = str(gemma_dir(kind))
    llm = LLM(path, tensor_parallel_size=2)
    assert greedy(llm) == greedy(LLM(path))
    check_prompt_logprobs(llm, reference(path), PROMPTS, k=3)


@pytest.mark.parametrize("config,message", [
    (gemma_config("gemma3", use_bidirectional_attention=True),
     "use_bidirectional_attention=True .* set it to False"),
    (gemma_config("gemma3", hidden_activation="gelu"),
     "hidden_activation 'gelu' is not supported .*'gelu_pytorch_tanh'"),
    (gemma_config("gemma2", hidden_activation="silu"), "hidden_activation 'silu'"),
    (gemma_config("gemma3", layer_types=["sliding_attention", "chunked_attention",
                                         "full_attention", "full_attention"]),
     r"layer_types\[1\] is 'chunked_attention'"),
    (gemma_config("gemma3", rope_parameters={**ROPE, "full_attention": {
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}}),
     r"rope_type 'dynamic' \(rope_parameters\['full_attention'\]\) is not supported"),
    (gemma_config("gemma3", rope_parameters={**ROPE, "sliding_attention": {
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}),
     r"partial_rotary_factor \(rope_parameters\['sliding_attention'\]\) is not supported"),
], ids=["bidirectional", "gelu", "gemma2 silu", "layer type", "dynamic rope", "partial rope"])
def test_a_config_the_family_cannot_run_is_refused_naming_the_fix(config, message):
    with pytest.raises(ValueError, match=message):
        model_class(config)
