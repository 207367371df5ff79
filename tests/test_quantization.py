"""8-bit weights (``quantization="int8"`` / ``"fp8"``): the quantization itself, and an
engine that serves them, against references: float64 dequantized products, the unquantized
engine, a fresh quantized engine on saved weights, and the trainer's exact forward."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.kernels import (
    TORCH_OPS,
    KernelOps,
    cpu_build,
    quantization,
    select_kernels,
    triton_linear,
)
from tandem.kernels.dispatch import check_quantized
from tandem.rollout import LLM, SamplingParams, WeightUpdateError
from tandem.trainers.policy import completion_logprobs, token_batch

from .test_exact_logprobs import assert_exact, sampled
from .test_trainer import make_config, target_token  # noqa: F401 - a fixture
from .test_weight_update import completions, trainer_model

METHODS = ["int8", "fp8"]
PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(4 + 9 * i)] for i in range(6)]
pytestmark = pytest.mark.skipif(not cpu_build.available(), reason="no C compiler")


def quantized_llm(folder, method: str, **options) -> LLM:
    return LLM(str(folder), quantization=method, max_model_len=128, **options)


def projection(llm: LLM, name: str = "q_proj") -> torch.nn.Module:
    layer = llm.engine.runner.model.model.layers[0]
    return getattr(layer.self_attn, name, None) or getattr(layer.mlp, name)


# --- the quantization -------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_each_channel_is_rounded_to_its_nearest_code_within_its_own_scale(method, dtype):
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(48, 200, generator=generator)
              * torch.logspace(-3, 1, 48)[:, None]).to(dtype)
    weight[5] = 0.0  # a channel of zeros
    codes, scale = quantization.quantize(weight, method)
    assert codes.dtype == quantization.FORMATS[method].dtype and scale.dtype == torch.float32
    exact = weight.double()
    top = quantization.FORMATS[method].max_code
    amax = exact.abs().amax(dim=1)
    torch.testing.assert_close(scale.double(), (amax / top).clamp(min=quantization.MIN_SCALE),
                               rtol=1e-6, atol=0)
    served = codes.double() * scale.double()[:, None]
    assert torch.equal(codes[5].double(), torch.zeros(200))
    if method == "int8":  # round to nearest: within half a step
        assert ((served - exact).abs() <= scale.double()[:, None] * (0.5 + 1e-5)).all()
        assert codes.abs().amax(dim=1)[amax > 0].eq(127).all()
    else:  # e4m3: 3 mantissa bits, to nearest; the smallest codes are 2^-9 apart
        bound = (exact.abs() * 2 ** -4).clamp(min=2 ** -10 * scale.double()[:, None])
        assert ((served - exact).abs() <= bound * (1 + 1e-5)).all()


@pytest.mark.parametrize("method", METHODS)
def test_packed_parts_quantize_as_each_part_alone(method):
    # q/k/v or gate/up stacked: per-channel scales make a slot's codes its own tensor's.
    generator = torch.Generator().manual_seed(1)
    parts = [torch.randn(size, 64, generator=generator) * (i + 1)
             for i, size in enumerate((32, 16, 16))]
    codes, scale = quantization.quantize(torch.cat(parts), method)
    alone = [quantization.quantize(part, method) for part in parts]
    assert torch.equal(codes.view(torch.uint8), torch.cat([c for c, _ in alone]).view(torch.uint8))
    assert torch.equal(scale, torch.cat([s for _, s in alone]))


def test_an_unknown_quantization_names_the_valid_ones(llama_dir):
    with pytest.raises(ValueError, match="quantization='int4' is invalid: use one of 'int8', "
                                         "'fp8'"):
        LLM(str(llama_dir), quantization="int4")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_triton_8_bit_matmul_equals_the_float64_dequantized_one_in_any_batch(method,
                                                                                 dtype):
    # In Triton's interpreter (the kernel a GPU runs): codes converted as loaded, one scale
    # per output after the sum; K and N not multiples of the tiles, M across tile edges.
    from tandem.kernels.testing import TOLERANCE, relative_error

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 80, generator=generator) * torch.logspace(-2, 2, 40)[:, None]
    codes, scale = quantization.quantize(weight, method)
    bias = torch.randn(40, generator=generator).to(dtype)
    rows = torch.randn(70, 80, generator=generator).to(dtype)
    out = triton_linear.linear(rows, codes, bias, scale)
    served = codes.double() * scale.double()[:, None]
    reference = rows.double() @ served.t() + bias.double()
    assert out.dtype == dtype and relative_error(out, reference) < TOLERANCE[dtype]
    alone = triton_linear.linear(rows[:1], codes, bias, scale)
    for count in (2, 33, 65):
        assert torch.equal(triton_linear.linear(rows[:count], codes, bias, scale)[:1], alone)


# --- the engine -------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_the_projections_hold_8_bit_weights_and_the_rest_the_models_dtype(llama_dir, method):
    llm = quantized_llm(llama_dir, method, dtype="bfloat16")
    runner, plain = llm.engine.runner, LLM(str(llama_dir), dtype="bfloat16", max_model_len=128)
    model = runner.model
    codes = quantization.FORMATS[method].dtype
    for layer in model.quantized_layers():
        assert layer.weight.dtype == codes and layer.weight_scale.dtype == torch.float32
    assert {name.rsplit(".", 2)[-2] for name, p in model.named_parameters()
            if p.dtype == codes} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                     "up_proj", "down_proj"}
    assert model.lm_head.weight.dtype == model.input_embedding().weight.dtype == torch.bfloat16
    assert model.model.norm.weight.dtype == torch.bfloat16
    projections = sum(layer.weight.numel() for layer in model.quantized_layers())
    channels = sum(layer.out_features for layer in model.quantized_layers())
    float_bytes = plain.engine.runner.weight_bytes()
    # a byte per projection weight instead of two, plus a float32 scale per channel
    assert runner.weight_bytes() == float_bytes - projections + 4 * channels
    assert llm.stats()["weight_bytes"] == runner.weight_bytes()
    assert runner.staging_bytes() == float_bytes  # an update sends bfloat16
    assert all(packed.panels.dtype == codes for packed in model.packed_weights()
               if packed.scales is not None)


def teacher_forced(llm: LLM, prompts, completions_) -> list[list[tuple[int, float]]]:
    """Per completion token, ``llm``'s most likely token there and its log-prob of the
    completion's token, the completion given (prompt log-probs)."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    outputs = llm.generate([p + c for p, c in zip(prompts, completions_)], params,
                           use_tqdm=False)
    return [[(max(scores, key=scores.get), scores[token])
             for token, scores in zip(c, out.prompt_logprobs[len(p):])]
            for p, c, out in zip(prompts, completions_, outputs)]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_greedy_agreement_and_logprob_gap_against_the_unquantized_engine(model_dir, kind,
                                                                          method):
    # The unquantized engine's greedy completions, teacher-forced through the quantized one:
    # how often its greedy choice is the same, and how far its log-prob of the token is.
    folder = model_dir(kind)
    plain = LLM(str(folder), max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    reference = [o.outputs[0] for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    forced = teacher_forced(quantized_llm(folder, method), PROMPTS,
                            [r.token_ids for r in reference])
    pairs = [(token, logprob, choice, served) for ref, row in zip(reference, forced)
             for token, logprob, (choice, served) in zip(ref.token_ids, ref.logprobs, row)]
    agreement = sum(token == choice for token, _, choice, _ in pairs) / len(pairs)
    gap = sum(abs(logprob - served) for _, logprob, _, served in pairs) / len(pairs)
    # Random tiny models (weights of std 0.2, 64 wide; measured 0.92-0.96 and 0.03-0.05 in
    # int8, 0.75-0.82 and 0.14-0.19 in fp8): loose floors. SmolLM2's figures are in
    # BENCHMARKS.md (benchmarks/quantized.py).
    assert agreement >= (0.85 if method == "int8" else 0.7)
    assert 0 < gap < (0.08 if method == "int8" else 0.3)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_full_update_equals_a_fresh_quantized_engine_on_saved_weights(model_dir, tmp_path,
                                                                        kind, method):
    folder = model_dir(kind)
    llm = quantized_llm(folder, method)
    before = completions(llm)
    trainer = trainer_model(folder, seed=1)
    assert llm.update_weights(trainer.state_dict().items()) == 1
    trainer.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((folder / name).read_bytes())
    fresh = quantized_llm(tmp_path, method)
    after = llm.generate(PROMPTS, SamplingParams(max_tokens=10, seed=4, logprobs=0),
                         use_tqdm=False)
    expected = fresh.generate(PROMPTS, SamplingParams(max_tokens=10, seed=4, logprobs=0),
                              use_tqdm=False)
    assert completions(llm) != before
    for out, ref in zip(after, expected):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.outputs[0].logprobs == ref.outputs[0].logprobs


def test_a_partial_update_of_one_packed_part_rewrites_its_codes_and_scales_only(llama_dir):
    llm = quantized_llm(llama_dir, "int8")
    q, k = projection(llm, "q_proj"), projection(llm, "k_proj")
    k_before = (k.weight.clone(), k.weight_scale.clone())
    new = torch.randn(q.weight.shape, generator=torch.Generator().manual_seed(2))
    llm.update_weights([("model.layers.0.self_attn.q_proj.weight", new)], full=False)
    codes, scale = quantization.quantize(new, "int8")
    assert torch.equal(q.weight, codes) and torch.equal(q.weight_scale, scale)
    assert torch.equal(k.weight, k_before[0]) and torch.equal(k.weight_scale, k_before[1])
    served = llm.engine.full_weight("model.layers.0.self_attn.q_proj.weight")
    reference = codes.double() * scale.double()[:, None]  # what the panels multiply by now
    assert torch.equal(served.double(), reference.float().double())
    packed = next(p for p in llm.engine.runner.model.packed_weights() if q in p.layers)
    x = torch.randn(3, q.in_features)
    torch.testing.assert_close(packed(x)[:, :q.out_features].double(),
                               x.double() @ reference.t(), rtol=1e-5, atol=1e-5)


def test_a_non_finite_update_is_refused_before_quantizing_and_old_weights_serve(llama_dir):
    llm = quantized_llm(llama_dir, "fp8")
    before = completions(llm)
    served = {name: llm.engine.full_weight(name).clone()
              for name in llm.engine.weight_parameters()}
    state = trainer_model(llama_dir, seed=3).state_dict()
    state["model.layers.1.mlp.down_proj.weight"][3, 7] = float("inf")
    with pytest.raises(WeightUpdateError, match="down_proj.weight' holds NaN or infinite"):
        llm.update_weights(state.items())
    assert llm.weight_version == 0 and completions(llm) == before
    assert all(torch.equal(llm.engine.full_weight(name), weight)
               for name, weight in served.items())


def test_alias_updates_are_refused_naming_copy_mode(llama_dir):
    llm = quantized_llm(llama_dir, "int8", exact_logprobs=False)
    before = completions(llm)
    state = trainer_model(llama_dir, seed=5).state_dict()
    with pytest.raises(ValueError, match="update by copy \\(alias=False"):
        llm.update_weights(state.items(), alias=True)
    assert llm.weight_version == 0 and completions(llm) == before


def test_a_mixture_of_experts_is_refused_naming_the_fix(tmp_path):
    from .test_moe import CONFIGS, save_moe

    folder = save_moe(next(iter(CONFIGS)), tmp_path)
    with pytest.raises(ValueError, match="stacked experts yet: start the engine with "
                                         "quantization=None"):
        LLM(str(folder), quantization="int8", max_model_len=64)


def test_a_cpu_without_the_compiled_kernels_is_refused_naming_the_fallback(llama_dir,
                                                                          monkeypatch):
    monkeypatch.setattr(cpu_build, "available", lambda: False)
    with pytest.raises(ValueError, match="need a C compiler .* or use quantization=None"):
        LLM(str(llama_dir), quantization="int8", attention_backend="torch")


@pytest.mark.parametrize(("capability", "method", "refused"), [
    ((8, 0), "fp8", True), ((8, 6), "fp8", True), ((8, 9), "fp8", False),
    ((9, 0), "fp8", False), ((8, 0), "int8", False)])
def test_fp8_below_compute_capability_8_9_is_refused_naming_int8(monkeypatch, capability,
                                                                 method, refused):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    triton = select_kernels("triton", torch.device("cpu"))  # the interpreter's, as on CUDA
    if refused:
        with pytest.raises(ValueError, match="use quantization='int8', or None"):
            check_quantized(triton, torch.device("cuda"), method)
    else:
        check_quantized(triton, torch.device("cuda"), method)


def test_the_torch_references_on_cuda_are_refused_naming_the_triton_kernels():
    torch_on_cuda = KernelOps(TORCH_OPS.attention, replace(TORCH_OPS.layers,
                                                           cpu_linear_layouts=False))
    with pytest.raises(ValueError, match="needs the Triton kernels on CUDA, not 'torch': use "
                                         "attention_backend='auto'"):
        check_quantized(torch_on_cuda, torch.device("cuda"), "int8")


# --- exact log-probs and LoRA -------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("method", METHODS)
def test_the_trainers_exact_forward_quantizes_alike_bit_for_bit(llama_dir, method, dtype):
    # chunked prefill, a copy-on-write group, preemptions: as test_exact_logprobs, quantized
    llm = LLM(str(llama_dir), dtype=dtype, max_model_len=64, max_num_batched_tokens=16,
              num_kv_blocks=24, block_size=4, quantization=method)
    params = SamplingParams(temperature=0.9, max_tokens=20, ignore_eos=True, seed=3,
                            logprobs=0, n=4)
    prompts, completions_, sampler_logprobs, _ = sampled(llm, params)
    assert llm.stats()["preemptions"] > 0
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=getattr(torch, dtype))
    batch = token_batch(prompts, completions_, 0)
    logprobs, _, _ = completion_logprobs(llm.exact_forward(model), batch, 0.9)
    assert_exact(logprobs, batch.completion_mask, sampler_logprobs)


@pytest.mark.parametrize("exact", [True, False])
def test_the_triton_path_serves_8_bit_weights_and_is_exact_where_asked(llama_dir, exact):
    # The CUDA path in the interpreter: the projections through the Triton 8-bit matmul
    # (with exact log-probs every layer through the fixed-tile one), the trainer's exact
    # forward bit for bit; without, the LM head stays on F.linear.
    llm = LLM(str(llama_dir), max_model_len=64, attention_backend="triton", block_size=4,
              exact_logprobs=exact, quantization="int8", num_kv_blocks=64)
    model = llm.engine.runner.model
    assert all(layer.packed.linear is triton_linear.linear for layer in model.quantized_layers())
    assert (model.lm_head.packed is None) != exact
    prompts = [[3 + i, 5, 7 + i, 9, 11][: 2 + i] for i in range(3)]
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=1, logprobs=0, n=2,
                            ignore_eos=True)
    prompts, completions_, sampler_logprobs, _ = sampled(llm, params, prompts)
    cpu = quantized_llm(llama_dir, "int8")  # the panels: the same weights, other sums
    forced = teacher_forced(cpu, prompts, completions_)
    gaps = [abs(a - b) for row, logprobs in zip(forced, sampler_logprobs)
            for (_, a), b in zip(row, logprobs)]
    assert max(gaps) < 1e-4
    if exact:
        trainer = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
        batch = token_batch(prompts, completions_, 0)
        logprobs, _, _ = completion_logprobs(llm.exact_forward(trainer), batch, 1.0)
        assert_exact(logprobs, batch.completion_mask, sampler_logprobs)


def test_the_straight_through_gradient_is_autograds_through_the_served_weights(llama_dir):
    # The rounding's gradient taken as the identity: every parameter's gradient is the one
    # autograd through transformers gives with the projections' weights replaced by the
    # weights the engine serves (dequantized), within float tolerance.
    llm = quantized_llm(llama_dir, "int8")
    prompts, completions_, _, _ = sampled(llm, SamplingParams(max_tokens=10, seed=1, n=2))
    batch = token_batch(prompts, completions_, 0)
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    served = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    with torch.no_grad():
        for name, param in served.named_parameters():
            if name.endswith("proj.weight"):
                param.copy_(llm.engine.full_weight(name))
    grads = []
    for forward, owner in ((llm.exact_forward(model), model), (served, served)):
        logprobs, _, _ = completion_logprobs(forward, batch, 1.0)
        (logprobs * batch.completion_mask).sum().backward()
        grads.append({name: p.grad for name, p in owner.named_parameters()})
    for name, exact in grads[0].items():
        reference = grads[1][name]
        assert (exact - reference).norm() <= 1e-4 * reference.norm() + 1e-7, name


@pytest.mark.parametrize("mode", ["merge", "runtime"])
def test_a_lora_adapter_on_quantized_weights_is_exact(llama_dir, mode):
    from peft import LoraConfig, get_peft_model

    from tandem.sync import LoraSync, peft_adapter_state

    llm = quantized_llm(llama_dir, "int8")
    base = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8,
                                            target_modules=["q_proj", "v_proj", "down_proj"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    LoraSync(llm, mode=mode).update(*peft_adapter_state(model))
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=2, logprobs=0, n=2)
    prompts, completions_, sampler_logprobs, _ = sampled(llm, params)
    exact = llm.exact_forward(model, lora_runtime=mode == "runtime")
    logprobs, _, _ = completion_logprobs(exact, token_batch(prompts, completions_, 0), 1.0)
    assert_exact(logprobs, token_batch(prompts, completions_, 0).completion_mask,
                 sampler_logprobs)


def test_a_merged_adapter_is_the_served_base_plus_the_adapter_quantized(llama_dir, tmp_path):
    # LoraSync merges onto the base the engine serves (its codes, dequantized) and the commit
    # quantizes the sum: a fresh quantized engine loaded from those float weights serves the
    # same bits.
    from tandem.sync import LoraSpec, LoraSync

    llm = quantized_llm(llama_dir, "fp8")
    name = "model.layers.1.mlp.up_proj.weight"
    served = llm.engine.full_weight(name).clone()
    generator = torch.Generator().manual_seed(6)
    lora_a = torch.randn(4, served.shape[1], generator=generator)
    lora_b = 0.05 * torch.randn(served.shape[0], 4, generator=generator)
    LoraSync(llm).update({"model.layers.1.mlp.up_proj.lora_A.weight": lora_a,
                          "model.layers.1.mlp.up_proj.lora_B.weight": lora_b},
                         LoraSpec(r=4, lora_alpha=8))
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    with torch.no_grad():
        model.get_parameter(name).copy_(served + (lora_b @ lora_a) * 2.0)
    model.save_pretrained(tmp_path)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / file).write_bytes((llama_dir / file).read_bytes())
    assert completions(llm) == completions(quantized_llm(tmp_path, "fp8"))


def test_grpo_on_quantized_rollouts_is_exactly_on_policy(llama_dir, tmp_path,
                                                         target_token):  # noqa: F811
    from tandem.trainers.trainer import Trainer

    rollout = replace(make_config(llama_dir, tmp_path, target_token).rollout,
                      quantization="int8")
    trainer = Trainer(make_config(llama_dir, tmp_path, target_token, steps=2, rollout=rollout))
    assert trainer.llm.engine.runner.model.quantization == "int8"
    for _ in range(2):
        metrics = trainer.train_step()
        assert metrics["sampler_logprob_diff_max"] == 0.0
        assert metrics["is_ratio_min"] == metrics["is_ratio_max"] == 1.0


@pytest.mark.parametrize(("rollout", "message"), [
    ({"quantization": "int4"}, "rollout.quantization='int4' is invalid"),
    ({"engine": {"quantization": "int8"}}, "set rollout.quantization instead"),
    ({"quantization": "int8", "sync_alias": True}, "sync_alias with rollout.quantization")])
def test_the_recipe_key_is_checked_naming_the_fix(rollout, message):
    from tandem.trainers.config import RolloutConfig, TrainConfig

    sync_alias = rollout.pop("sync_alias", False)
    with pytest.raises(ValueError, match=message):
        TrainConfig(model="x", sync_alias=sync_alias, rollout=RolloutConfig(**rollout))
