"""Phi-3 (``Phi3ForCausalLM``: packed ``qkv_proj`` and ``gate_up_proj``, LongRoPE, partial
rotary) against transformers on tiny random models of grouped-query attention (6 query
heads, 2 KV heads: q, k and v of unequal rows): greedy tokens and prompt log-probs, LongRoPE's
tables on both sides of the original length, chunked prefill, exact log-probs and their
gradients, weight updates by transformers' packed names, run-time LoRA on the packed parts,
TP=2, and bad configs refused naming the fix."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Phi3Config
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from tandem.rollout import LLM, SamplingParams, WeightUpdateError
from tandem.rollout.parallel.tensor_parallel import COLUMN, KV_HEADS
from tandem.rollout.worker.models import model_class
from tandem.rollout.worker.models.phi3 import Phi3ForCausalLM
from tandem.rollout.worker.models.rotary import RotaryEmbedding
from tandem.trainers.policy import completion_logprobs, token_batch

from .conftest import build_tokenizer
from .test_exact_logprobs import (
    assert_exact,
    assert_gradients_match,
    sampled,
    trainer_logprobs,
)
from .test_model_contract import assert_runtime_lora_equals_its_merge
from .test_models import check_prompt_logprobs, hf_greedy

ORIGINAL = 64  # LongRoPE's original_max_position_embeddings
GEOMETRY = dict(hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                initializer_range=0.2, bos_token_id=0, eos_token_id=1, pad_token_id=1,
                tie_word_embeddings=False)
HEAD_DIM, ROTARY_DIM = 16, 12  # Phi-4-mini's partial rotary: 0.75 of each head
LONGROPE = dict(original_max_position_embeddings=ORIGINAL, partial_rotary_factor=0.75,
                rope_scaling={"type": "longrope",
                              "short_factor": [1.0 + 0.1 * i for i in range(ROTARY_DIM // 2)],
                              "long_factor": [2.0 + 0.7 * i for i in range(ROTARY_DIM // 2)]})
CONFIGS = {"phi3": {}, "longrope": LONGROPE}
PROMPTS = [[1, 5, 9, 2, 7], [(7 * i) % 300 + 2 for i in range(30)], [1, 12]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
LAYER = "model.layers.1"


def phi3_config(kind: str, **overrides) -> Phi3Config:
    """A tiny Phi-3 config of ``kind`` (its own copy: transformers keeps the rope dict)."""
    return Phi3Config(vocab_size=len(build_tokenizer()),
                      **copy.deepcopy({**GEOMETRY, **CONFIGS[kind], **overrides}))


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory):
    """A factory: ``phi3_dir("longrope", seed)`` is that tiny Phi-3's folder (built once)."""
    built = {}

    def get(kind: str, seed: int = 0):
        if (kind, seed) not in built:
            path = tmp_path_factory.mktemp(f"phi3_{kind}_{seed}")
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(phi3_config(kind), dtype=torch.float32)
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
def test_greedy_and_prompt_logprobs_match_transformers(phi3_dir, kind):
    llm = LLM(str(phi3_dir(kind)), max_model_len=ORIGINAL)  # LongRoPE's short factors
    assert type(llm.engine.runner.model) is Phi3ForCausalLM
    hf_model = reference(phi3_dir(kind))
    assert greedy(llm) == [hf_greedy(hf_model, prompt, 12) for prompt in PROMPTS]
    check_prompt_logprobs(llm, hf_model, PROMPTS, k=3)


def test_an_engine_longer_than_the_original_length_rotates_with_the_long_factors(phi3_dir):
    # transformers rotates a sequence longer than ORIGINAL with the long factors; such an
    # engine rotates every sequence so, a short one as transformers does inside a long one.
    llm = LLM(str(phi3_dir("longrope")), max_model_len=2 * ORIGINAL)
    hf_model = reference(phi3_dir("longrope"))
    long_prompt = [(5 * i) % 300 + 2 for i in range(ORIGINAL + 20)]
    check_prompt_logprobs(llm, hf_model, [long_prompt], k=3)
    short = long_prompt[:20]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    ours = llm.generate([short], params, use_tqdm=False)[0].prompt_logprobs
    with torch.no_grad():
        theirs = torch.log_softmax(hf_model(torch.tensor([long_prompt])).logits[0], -1)
    for position in range(1, len(short)):
        assert abs(ours[position][short[position]] - theirs[position - 1, short[position]]) < 1e-4


@pytest.mark.parametrize("max_position", [ORIGINAL, ORIGINAL + 1, 2 * ORIGINAL], ids=str)
def test_longrope_tables_are_transformers_for_the_longest_sequence(max_position):
    # transformers picks the factors per forward by the sequence's length: here the
    # engine's longest (short up to ORIGINAL, long beyond).
    config = phi3_config("longrope")
    positions = torch.arange(max_position)[None]
    cos, sin = Phi3RotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
    tables = RotaryEmbedding(config, HEAD_DIM, max_position, torch.device("cpu"))
    assert tables.cos.shape == (max_position, ROTARY_DIM)
    assert torch.equal(tables.cos, cos[0]) and torch.equal(tables.sin, sin[0])


def test_the_weight_spec_names_the_parts_in_slots_of_the_packed_parameters(phi3_dir):
    model = LLM(str(phi3_dir("phi3"))).engine.runner.model
    spec = model.weight_spec()
    q_rows, kv_rows = 6 * HEAD_DIM, 2 * HEAD_DIM
    attention = [spec[f"{LAYER}.self_attn.{part}.weight"] for part in ("q_proj", "k_proj",
                                                                        "v_proj")]
    assert {target.parameter for target in attention} == {f"{LAYER}.self_attn.qkv_proj.weight"}
    assert [(target.split, target.slot) for target in attention] == [
        (split, ((index, (q_rows, kv_rows, kv_rows)),))
        for index, split in enumerate((COLUMN, KV_HEADS, KV_HEADS))]
    assert [spec[f"{LAYER}.mlp.{part}.weight"].slot for part in ("gate_proj", "up_proj")] == [
        ((0, 2),), ((1, 2),)]
    hf_state = reference(phi3_dir("phi3")).state_dict()
    assert set(spec) == {part for name, tensor in hf_state.items()
                         for part, _ in model.unalias(name, tensor) or [(name, tensor)]}
    packed = {f"{LAYER}.self_attn.qkv_proj.weight": ("q_proj", "k_proj", "v_proj"),
              f"{LAYER}.mlp.gate_up_proj.weight": ("gate_proj", "up_proj")}
    for name, parts in packed.items():
        assert name not in spec
        assert torch.equal(dict(model.named_parameters())[name], hf_state[name])
        assert [model.unalias(name, hf_state[name])[i][0] for i in range(len(parts))] == [
            name.replace(name.split(".")[-2], part) for part in parts]


def test_chunked_prefill_equals_whole_prefill_bit_for_bit(phi3_dir):
    prompts = [[(3 * i) % 300 + 2 for i in range(length)] for length in (5, 17, 40)]
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=5, logprobs=0,
                            prompt_logprobs=2, ignore_eos=True)
    runs = [[(o.prompt_logprobs, o.outputs[0].token_ids, o.outputs[0].logprobs) for o in
             LLM(str(phi3_dir("longrope")), max_model_len=ORIGINAL,
                 max_num_batched_tokens=budget).generate(prompts, params, use_tqdm=False)]
            for budget in (7, 256)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trainer_logprobs_are_the_engines_bit_for_bit(phi3_dir, dtype):
    # The trainer's packed tensors bind to the engine's packed parameters by name; chunked
    # prefill, a shared prompt's blocks and preemption on the engine's side.
    path = phi3_dir("longrope")
    llm = LLM(str(path), dtype=dtype, max_model_len=ORIGINAL, max_num_batched_tokens=16,
              num_kv_blocks=24, block_size=4)
    params = SamplingParams(temperature=0.9, max_tokens=20, ignore_eos=True, seed=3,
                            logprobs=0, n=4)
    prompts, completions, sampler_logprobs, _ = sampled(llm, params)
    assert llm.stats()["preemptions"] > 0
    model = reference(path, getattr(torch, dtype))
    logprobs, mask = trainer_logprobs(model, llm, prompts, completions, 0.9)
    assert_exact(logprobs, mask, sampler_logprobs)


def test_the_triton_kernels_are_exact_in_the_interpreter(phi3_dir):
    # The CUDA path (q, k and v as views of the packed output; a part of each head
    # rotated) run by the interpreter, with chunked prefill and a copy-on-write group.
    path = phi3_dir("longrope")
    llm = LLM(str(path), max_model_len=ORIGINAL, attention_backend="triton",
              exact_logprobs=True, max_num_batched_tokens=16, block_size=4, num_kv_blocks=64)
    assert llm.engine.runner.model.linear_layout == "triton (batch-invariant)"
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=1, logprobs=0, n=2,
                            ignore_eos=True)
    prompts, completions, sampler_logprobs, _ = sampled(llm, params, [PROMPTS[0], PROMPTS[2]])
    logprobs, mask = trainer_logprobs(reference(path), llm, prompts, completions, 1.0)
    assert_exact(logprobs, mask, sampler_logprobs)


def test_gradients_match_autograd_through_transformers(phi3_dir):
    # The partial rotary's in-place rotation of a part of each head, backwards.
    path = phi3_dir("longrope")
    llm = LLM(str(path), max_model_len=ORIGINAL)
    prompts, completions, _, _ = sampled(llm, SamplingParams(max_tokens=12, seed=1, n=2))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    assert_gradients_match(llm, model, token_batch(prompts, completions, 0), 1e-4)


def test_a_full_update_by_transformers_names_serves_the_new_weights(phi3_dir):
    llm = LLM(str(phi3_dir("longrope")), max_model_len=ORIGINAL)
    new = reference(phi3_dir("longrope", seed=1))
    llm.update_weights(new.named_parameters())  # the packed qkv_proj and gate_up_proj
    assert greedy(llm) == [hf_greedy(new, prompt, 12) for prompt in PROMPTS]


def test_a_partial_update_of_packed_tensors_equals_transformers_with_them(phi3_dir):
    llm = LLM(str(phi3_dir("longrope")), max_model_len=ORIGINAL)
    new = dict(reference(phi3_dir("longrope", seed=1)).named_parameters())
    names = [f"{LAYER}.self_attn.qkv_proj.weight", f"{LAYER}.mlp.gate_up_proj.weight"]
    llm.update_weights([(name, new[name]) for name in names], full=False)
    hf_model = reference(phi3_dir("longrope"))
    hf_model.load_state_dict({name: new[name] for name in names}, strict=False)
    assert greedy(llm) == [hf_greedy(hf_model, prompt, 12) for prompt in PROMPTS]


def test_a_packed_tensor_of_the_wrong_size_is_refused_naming_the_part(phi3_dir):
    llm = LLM(str(phi3_dir("phi3")))
    before = greedy(llm)
    wrong = torch.randn(6 * HEAD_DIM + 3 * HEAD_DIM, GEOMETRY["hidden_size"])
    with pytest.raises(WeightUpdateError, match=r"v_proj.weight' has shape \(16, 96\), the "
                       r"engine expects \(32, 96\)"):
        llm.update_weights([(f"{LAYER}.self_attn.qkv_proj.weight", wrong)], full=False)
    assert greedy(llm) == before


def test_a_run_time_adapter_on_the_unequal_qkv_parts_equals_its_merge(phi3_dir):
    generator = torch.Generator().manual_seed(2)
    rows = {"q_proj": 6 * HEAD_DIM, "k_proj": 2 * HEAD_DIM, "v_proj": 2 * HEAD_DIM}
    factors = {f"{LAYER}.self_attn.{part}.weight": (
        torch.randn(3, GEOMETRY["hidden_size"], generator=generator) * 0.1,
        torch.randn(count, 3, generator=generator) * 0.1, 0.5) for part, count in rows.items()}
    assert_runtime_lora_equals_its_merge(phi3_dir("phi3"), factors, PROMPTS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_run_time_peft_adapter_on_the_packed_modules_is_exact(phi3_dir, dtype):
    # peft adapts the packed qkv_proj and gate_up_proj whole; the engine serves one adapter
    # per part, stacked; the trainer's twin stacks them alike.
    from peft import LoraConfig, get_peft_model

    from tandem.sync import LoraSync, peft_adapter_state

    path = phi3_dir("longrope")
    llm = LLM(str(path), dtype=dtype, max_model_len=ORIGINAL)
    model = get_peft_model(reference(path, getattr(torch, dtype)), LoraConfig(
        r=4, lora_alpha=8, target_modules=["qkv_proj", "gate_up_proj", "o_proj"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    LoraSync(llm, mode="runtime").update(*peft_adapter_state(model))
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=2, logprobs=0, n=2,
                            ignore_eos=True)
    prompts, completions, sampler_logprobs, _ = sampled(llm, params, PROMPTS)
    exact = llm.exact_forward(model, lora_runtime=True)
    batch = token_batch(prompts, completions, 0)
    logprobs, _, _ = completion_logprobs(exact, batch, 1.0)
    assert_exact(logprobs, batch.completion_mask, sampler_logprobs)


def test_tp2_equals_tp1_and_takes_a_full_update(phi3_dir):
    path = str(phi3_dir("longrope"))
    llm = LLM(path, tensor_parallel_size=2, max_model_len=ORIGINAL)
    assert greedy(llm) == greedy(LLM(path, max_model_len=ORIGINAL))
    check_prompt_logprobs(llm, reference(path), PROMPTS, k=3)
    new = reference(phi3_dir("longrope", seed=1))
    llm.update_weights(new.named_parameters())
    assert greedy(llm) == [hf_greedy(new, prompt, 12) for prompt in PROMPTS]


def without(config, key: str):
    config.rope_parameters.pop(key)
    return config


@pytest.mark.parametrize("config,message", [
    (without(phi3_config("longrope"), "short_factor"), "needs short_factor as a list of 6"),
    (LlamaConfig(**GEOMETRY, rope_parameters={  # transformers only warns of the length
        "rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 64,
        "short_factor": [1.0] * 8, "long_factor": [2.0] * 7}), "long_factor as a list of 8"),
    (without(phi3_config("longrope"), "original_max_position_embeddings"),
     "needs original_max_position_embeddings"),
    (phi3_config("phi3", hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
], ids=["no short factor", "long factor of wrong length", "no original length", "gelu"])
def test_a_config_the_family_cannot_run_is_refused_naming_the_fix(config, message):
    with pytest.raises(ValueError, match=message):
        model_class(config)
