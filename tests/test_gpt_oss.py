"""GPT-OSS (``GptOssForCausalLM``: attention sinks, alternating sliding and full attention,
YaRN, a biased top-k-then-softmax router, experts with biases and the clamped SwiGLU in
transformers' interleaved layout, MXFP4 checkpoints) against transformers on a tiny random
model of grouped-query attention (4 layers, window 8, prompts past it; 4 experts, top 2;
random sinks and biases): greedy tokens and prompt log-probs, YaRN's tables, chunked
prefill, exact log-probs (float32 and bfloat16, with preemption) and their gradients, the
Triton kernels in the interpreter, routing replay, updates by transformers' names, TP=2,
MXFP4 checkpoints (the decoder against transformers', a checkpoint of blocks and scales),
and bad configs and checkpoints refused naming the fix."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, GptOssConfig
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts, GptOssRotaryEmbedding

from tandem.kernels import triton_moe
from tandem.kernels.testing import TOLERANCE, relative_error
from tandem.rollout import LLM, SamplingParams
from tandem.rollout.parallel.tensor_parallel import COLUMN, EXPERT_OUT, ROW, ROW_BIAS
from tandem.rollout.worker.models import model_class
from tandem.rollout.worker.models.gpt_oss import GptOssForCausalLM
from tandem.rollout.worker.models.moe import ClampedSwiGLU
from tandem.rollout.worker.models.mxfp4 import E2M1_VALUES, dequantize
from tandem.rollout.worker.models.rotary import RotaryEmbedding
from tandem.trainers.policy import Policy, token_batch
from tandem.trainers.routing import RoutingCounts, routing_rows

from .conftest import build_tokenizer
from .test_exact_logprobs import (
    assert_exact,
    assert_gradients_match,
    sampled,
    trainer_logprobs,
)
from .test_models import check_prompt_logprobs, hf_greedy

NUM_EXPERTS, HEAD_DIM, WINDOW = 4, 16, 8
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}
GEOMETRY = dict(hidden_size=64, intermediate_size=32, head_dim=HEAD_DIM, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, num_local_experts=NUM_EXPERTS,
                num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=256,
                initializer_range=0.2, bos_token_id=0, eos_token_id=1, pad_token_id=1,
                rope_parameters=YARN)
PROMPTS = [[1, 5, 9, 2, 7], [(7 * i) % 300 + 2 for i in range(36)], [1, 12]]
EXACT_PROMPTS = [[(5 * i + j) % 200 + 3 for j in range(3 + 7 * i)] for i in range(5)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
LAYER = "model.layers.1"  # a full-attention layer (layer 0 slides)
EXPERTS = f"{LAYER}.mlp.experts"


def gpt_oss_config(**overrides) -> GptOssConfig:
    """A tiny GPT-OSS config (its own copy: transformers keeps the rope dict)."""
    return GptOssConfig(vocab_size=len(build_tokenizer()),
                        **copy.deepcopy({**GEOMETRY, **overrides}))


def build_gpt_oss(seed: int):
    """A tiny random GPT-OSS whose sinks and biases (zeros at transformers' init) are
    random too."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(gpt_oss_config(), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                param.normal_(0.0, 0.5)
    return model


def save_folder(path, state: dict[str, torch.Tensor], config: dict | None = None):
    """A model folder of ``state`` (a safetensors file), the tiny config (or ``config``)
    and the test tokenizer."""
    gpt_oss_config().save_pretrained(path)
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    build_tokenizer().save_pretrained(path)
    save_file({name: tensor.contiguous() for name, tensor in state.items()},
              path / "model.safetensors")
    return path


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    """A factory: ``gpt_oss_dir(seed)`` is that tiny GPT-OSS's folder (built once)."""
    built = {}

    def get(seed: int = 0):
        if seed not in built:
            path = tmp_path_factory.mktemp(f"gpt_oss_{seed}")
            build_gpt_oss(seed).save_pretrained(path)
            build_tokenizer().save_pretrained(path)
            built[seed] = path
        return built[seed]

    return get


def reference(folder, dtype: torch.dtype = torch.float32):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)


def greedy(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_greedy_and_prompt_logprobs_match_transformers(gpt_oss_dir):
    llm = LLM(str(gpt_oss_dir()))
    model = llm.engine.runner.model
    assert type(model) is GptOssForCausalLM
    assert [layer.sliding_window for layer in model.attention_layers()] == [WINDOW, None] * 2
    hf_model = reference(gpt_oss_dir())
    assert greedy(llm) == [hf_greedy(hf_model, prompt, 12) for prompt in PROMPTS]
    check_prompt_logprobs(llm, hf_model, PROMPTS, k=3)


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_tables_are_transformers_gpt_oss_rotary(truncate):
    config = gpt_oss_config(rope_parameters={**YARN, "truncate": truncate})
    positions = torch.arange(256)[None]
    cos, sin = GptOssRotaryEmbedding(config)(torch.zeros(1), positions)
    tables = RotaryEmbedding(config, HEAD_DIM, 256, torch.device("cpu"))
    half = HEAD_DIM // 2  # transformers' GPT-OSS tables hold each frequency once
    assert torch.equal(tables.cos[:, :half], cos[0]) and torch.equal(tables.sin[:, :half], sin[0])
    assert torch.equal(tables.cos[:, half:], cos[0]) and torch.equal(tables.sin[:, half:], sin[0])


def test_the_weight_spec_is_transformers_names_with_their_splits(gpt_oss_dir):
    model = LLM(str(gpt_oss_dir())).engine.runner.model
    spec = model.weight_spec()
    assert set(spec) == set(reference(gpt_oss_dir()).state_dict())
    assert all(target.parameter == name and not target.slot for name, target in spec.items())
    splits = {"self_attn.sinks": COLUMN, "mlp.experts.gate_up_proj": EXPERT_OUT,
              "mlp.experts.gate_up_proj_bias": EXPERT_OUT, "mlp.experts.down_proj": ROW,
              "mlp.experts.down_proj_bias": ROW_BIAS, "mlp.router.weight": None,
              "mlp.router.bias": None, "self_attn.o_proj.bias": ROW_BIAS}
    assert {name: spec[f"{LAYER}.{name}"].split for name in splits} == splits


def test_the_clamped_swiglu_is_transformers_and_keeps_an_elements_bits():
    # transformers' own gate (interleaved gate/up, clamps, sigmoid gain) against ours; rows
    # of 37 values, so a row alone ends mid-vector (torch's CPU sigmoid would round it
    # otherwise than inside the batch)
    config = gpt_oss_config()
    experts = GptOssExperts(config)
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        gate_up = (torch.randn(37, 74, generator=generator) * 6).to(dtype)  # past the limit
        ours = ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit)(gate_up[:, ::2],
                                                                        gate_up[:, 1::2])
        expected = experts._apply_gate(gate_up)
        assert (ours.float() - expected.float()).abs().max() <= 2 * TOLERANCE[dtype] * \
            expected.float().abs().max()
        for row in range(len(gate_up)):
            alone = ClampedSwiGLU(config.swiglu_alpha, config.swiglu_limit)(
                gate_up[row:row + 1, ::2], gate_up[row:row + 1, 1::2])
            assert torch.equal(alone, ours[row:row + 1])


def test_chunked_prefill_equals_whole_prefill_bit_for_bit(gpt_oss_dir):
    prompts = [[(3 * i) % 300 + 2 for i in range(length)] for length in (5, 17, 40)]
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=5, logprobs=0,
                            prompt_logprobs=2, ignore_eos=True)
    runs = [[(o.prompt_logprobs, o.outputs[0].token_ids, o.outputs[0].logprobs) for o in
             LLM(str(gpt_oss_dir()), max_num_batched_tokens=budget).generate(
                 prompts, params, use_tqdm=False)]
            for budget in (7, 256)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trainer_logprobs_are_the_engines_bit_for_bit(gpt_oss_dir, dtype):
    # Chunked prefill, a group sharing its prompt's blocks, preemption; the trainer's
    # interleaved experts, biases and sinks bound to the engine's parameters by name.
    path = gpt_oss_dir()
    llm = LLM(str(path), dtype=dtype, max_model_len=64, max_num_batched_tokens=16,
              num_kv_blocks=36, block_size=4)
    params = SamplingParams(temperature=0.9, max_tokens=16, ignore_eos=True, seed=3,
                            logprobs=0, n=4)
    prompts, completions, sampler_logprobs, _ = sampled(llm, params, EXACT_PROMPTS)
    assert llm.stats()["preemptions"] > 0
    logprobs, mask = trainer_logprobs(reference(path, getattr(torch, dtype)), llm, prompts,
                                      completions, 0.9)
    assert_exact(logprobs, mask, sampler_logprobs)


def test_gradients_match_autograd_through_transformers(gpt_oss_dir):
    # the sinks' gradient too (transformers' eager attention: GPT-OSS has no SDPA path)
    path = gpt_oss_dir()
    llm = LLM(str(path))
    prompts, completions, _, _ = sampled(llm, SamplingParams(max_tokens=10, seed=1, n=2),
                                         PROMPTS)
    assert_gradients_match(llm, reference(path), token_batch(prompts, completions, 0), 1e-4)


def test_the_triton_kernels_are_exact_in_the_interpreter(gpt_oss_dir):
    # Exact log-probs on CUDA's path (the per-expert loop through Triton's batch-invariant
    # matmul, the sinks in Triton's attention), run by the interpreter: a prompt past the
    # window, in chunks, and a group of two.
    path = gpt_oss_dir()
    llm = LLM(str(path), attention_backend="triton", exact_logprobs=True, max_model_len=64,
              max_num_batched_tokens=8, block_size=4, num_kv_blocks=64)
    params = SamplingParams(temperature=1.0, max_tokens=4, seed=1, logprobs=0, n=2,
                            ignore_eos=True)
    prompts, completions, sampler_logprobs, _ = sampled(llm, params, [PROMPTS[1][:20]])
    logprobs, mask = trainer_logprobs(reference(path), llm, prompts, completions, 1.0)
    assert_exact(logprobs, mask, sampler_logprobs)


def reference_experts(x, gate_up, gate_up_bias, down, down_bias, experts, weights, swiglu):
    """GPT-OSS's experts in float64, token by token (weights ``[E, in, out]``)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for e, w in zip(experts[t].tolist(), weights[t].tolist(), strict=True):
            projected = x[t].double() @ gate_up[e].double() + gate_up_bias[e].double()
            hidden = swiglu(projected[::2], projected[1::2])
            out[t] += w * (hidden @ down[e].double() + down_bias[e].double())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_fused_triton_experts_take_biases_and_the_interleaved_swiglu(dtype):
    generator = torch.Generator().manual_seed(0)
    hidden, intermediate, tokens = 32, 16, 9

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(dtype)

    x = rand(tokens, hidden)
    gate_up, down = rand(NUM_EXPERTS, hidden, 2 * intermediate), rand(NUM_EXPERTS,
                                                                     intermediate, hidden)
    biases = rand(NUM_EXPERTS, 2 * intermediate), rand(NUM_EXPERTS, hidden)
    experts = torch.stack([torch.randperm(NUM_EXPERTS, generator=generator)[:2]
                           for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=generator)
    swiglu = ClampedSwiGLU(1.702, 3.0)

    def fused(rows):
        return triton_moe.fused_moe(x[rows], gate_up.transpose(1, 2), down.transpose(1, 2),
                                    experts[rows], weights[rows], swiglu,
                                    gate_up_bias=biases[0], down_bias=biases[1],
                                    interleaved=True)

    out = fused(slice(None))
    expected = reference_experts(x, gate_up, biases[0], down, biases[1], experts, weights,
                                 swiglu)
    assert relative_error(out, expected) < 4 * TOLERANCE[dtype]
    assert torch.equal(fused(slice(0, 1)), out[:1])


def test_the_engine_on_the_fused_triton_experts_matches_transformers(gpt_oss_dir):
    llm = LLM(str(gpt_oss_dir()), attention_backend="triton", exact_logprobs=False,
              max_model_len=64, num_kv_blocks=64)
    assert all(m.capturable for m in llm.engine.runner.model.modules()
               if hasattr(m, "capturable"))
    params = SamplingParams(temperature=0, max_tokens=4, min_tokens=4)
    outputs = llm.generate(PROMPTS[1:2], params, use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == hf_greedy(reference(gpt_oss_dir()), PROMPTS[1], 4)


def hf_routing(hf_model, token_ids: list[int]) -> torch.Tensor:
    """transformers' top-k experts of every position, ``[positions, layers, k]``."""
    chosen = []
    hooks = [module.register_forward_hook(lambda _, __, out: chosen.append(out[2]))
             for name, module in hf_model.named_modules() if name.endswith("mlp.router")]
    with torch.no_grad():
        hf_model(torch.tensor([token_ids]))
    for hook in hooks:
        hook.remove()
    return torch.stack(chosen, dim=1)


def test_routed_experts_are_transformers_routers_choices(gpt_oss_dir):
    llm, hf_model = LLM(str(gpt_oss_dir())), reference(gpt_oss_dir())
    params = SamplingParams(max_tokens=8, ignore_eos=True, seed=5, return_routed_experts=True)
    for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False),
                              strict=True):
        for completion in output.outputs:
            tokens = prompt + completion.token_ids
            assert completion.routed_experts.shape == (len(tokens) - 1, 4, 2)
            expected = hf_routing(hf_model, tokens)[:-1]
            assert torch.equal(completion.routed_experts.long().sort(-1).values,
                               expected.sort(-1).values)


@pytest.mark.parametrize("exact", [False, True], ids=["transformers", "exact forward"])
def test_the_trainer_replays_the_samplers_routing(gpt_oss_dir, exact):
    # replaying the router's own choice changes no bit (its top-k softmax, not a
    # renormalised softmax over every expert), so the exact forward replaying gives the
    # sampler's log-probs; a shifted routing is taken
    llm = LLM(str(gpt_oss_dir()))
    outputs = llm.generate(PROMPTS, SamplingParams(n=2, max_tokens=6, ignore_eos=True,
                                                   seed=1, logprobs=0,
                                                   return_routed_experts=True),
                           use_tqdm=False)
    prompts = [p for p, o in zip(PROMPTS, outputs, strict=True) for _ in o.outputs]
    completions = [c for o in outputs for c in o.outputs]
    batch = token_batch(prompts, [c.token_ids for c in completions], 0)
    width = batch.input_ids.shape[1]
    batch.routing = routing_rows([c.routed_experts for c in completions],
                                 [len(p) for p in prompts], width - batch.num_completion_slots,
                                 width)
    policy = Policy(reference(gpt_oss_dir()))
    if exact:
        policy.use_exact_forward(llm.exact_forward(policy.model))
    with torch.no_grad():
        own, _, _ = policy(batch, 1.0)
        assert 0 < policy.routing_counts.agreed == policy.routing_counts.total
        policy.routing_replay = True
        replayed, _, _ = policy(batch, 1.0)
        assert torch.equal(replayed, own)
        if exact:
            assert_exact(replayed, batch.completion_mask, [c.logprobs for c in completions])
        shifted = torch.where(batch.routing >= 0, (batch.routing + 1) % NUM_EXPERTS, -1)
        policy.routing_counts = RoutingCounts()
        moved, _, _ = policy(dataclasses.replace(batch, routing=shifted), 1.0)
    assert policy.routing_counts.agreed < policy.routing_counts.total / 4
    assert (moved - own).abs().max() > 1e-3


def test_a_full_update_by_transformers_names_serves_the_new_weights(gpt_oss_dir):
    llm = LLM(str(gpt_oss_dir()))
    before = greedy(llm)
    new = reference(gpt_oss_dir(seed=1))
    llm.update_weights(new.named_parameters())
    assert greedy(llm) == [hf_greedy(new, prompt, 12) for prompt in PROMPTS] != before


def test_a_partial_update_of_experts_sinks_and_router_equals_transformers_with_them(
        gpt_oss_dir):
    llm = LLM(str(gpt_oss_dir()))
    new = dict(reference(gpt_oss_dir(seed=1)).named_parameters())
    names = [f"{EXPERTS}.gate_up_proj", f"{EXPERTS}.gate_up_proj_bias", f"{EXPERTS}.down_proj",
             f"{EXPERTS}.down_proj_bias", f"{LAYER}.mlp.router.weight",
             f"{LAYER}.mlp.router.bias", f"{LAYER}.self_attn.sinks"]
    llm.update_weights([(name, new[name]) for name in names], full=False)
    hf_model = reference(gpt_oss_dir())
    hf_model.load_state_dict({name: new[name] for name in names}, strict=False)
    assert greedy(llm) == [hf_greedy(hf_model, prompt, 12) for prompt in PROMPTS]


def test_tp2_equals_tp1_and_takes_a_full_update(gpt_oss_dir):
    # each rank its query heads' sinks, whole gate/up pairs of every expert, down's inputs,
    # and the down bias on rank 0 only
    path = str(gpt_oss_dir())
    llm = LLM(path, tensor_parallel_size=2)
    assert greedy(llm) == greedy(LLM(path))
    check_prompt_logprobs(llm, reference(path), PROMPTS, k=3)
    new = reference(gpt_oss_dir(seed=1))
    llm.update_weights(new.named_parameters())
    assert greedy(llm) == [hf_greedy(new, prompt, 12) for prompt in PROMPTS]


def mxfp4_encode(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[E, out, in]`` as MXFP4 blocks ``[E, out, in / 32, 16]`` and scales
    ``[E, out, in / 32]`` (uint8): each block of 32 scaled by a power of two to fit e2m1's
    largest value, 6, and rounded to the nearest e2m1 value (the low nibble first)."""
    groups = weight.float().unflatten(-1, (-1, 32))
    amax = groups.abs().amax(-1).clamp(min=2.0 ** -100)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    magnitudes = torch.tensor(E2M1_VALUES[:8])
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1) + 8 * (scaled < 0)
    blocks = codes[..., ::2] | (codes[..., 1::2] << 4)
    return blocks.to(torch.uint8), (exponent + 127).to(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_mxfp4_decoder_gives_transformers_tensors(dtype):
    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 2, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(100, 150, (3, 40, 2), dtype=torch.uint8, generator=generator)
    ours = dequantize("experts.gate_up_proj", blocks, scales, dtype)
    assert ours.dtype == dtype and ours.shape == (3, 64, 40)
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=dtype))


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory):
    """The tiny GPT-OSS with its experts as MXFP4 blocks and scales (a released checkpoint's
    layout and quantization_config), and transformers' model of the dequantized weights."""
    model = build_gpt_oss(0)
    state, dequantized = dict(model.state_dict()), {}
    for name in [name for name in state if name.endswith(("gate_up_proj", "down_proj"))]:
        blocks, scales = mxfp4_encode(state.pop(name).transpose(1, 2))
        state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
        dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    model.load_state_dict(dequantized, strict=False)
    config = {**gpt_oss_config().to_dict(), "quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                            "model.layers.*.mlp.router"]}}
    return save_folder(tmp_path_factory.mktemp("mxfp4"), state, config), state, model


def test_an_mxfp4_checkpoint_serves_transformers_on_its_dequantized_weights(mxfp4_dir):
    folder, _, hf_model = mxfp4_dir
    llm = LLM(str(folder))
    assert greedy(llm) == [hf_greedy(hf_model, prompt, 12) for prompt in PROMPTS]
    engine_experts = dict(llm.engine.runner.model.named_parameters())[f"{EXPERTS}.down_proj"]
    assert torch.equal(engine_experts, hf_model.state_dict()[f"{EXPERTS}.down_proj"])


@pytest.mark.parametrize("change,message", [
    (lambda s: s.pop(f"{EXPERTS}.down_proj_scales"),
     r"down_proj_blocks without model.layers.1.mlp.experts.down_proj_scales"),
    (lambda s: s.pop(f"{EXPERTS}.gate_up_proj_blocks"),
     r"gate_up_proj_scales without model.layers.1.mlp.experts.gate_up_proj_blocks"),
    (lambda s: s.update({f"{EXPERTS}.down_proj_scales": s[f"{EXPERTS}.down_proj_scales"][:, :-1]}),
     r"down_proj_blocks \(4, 64, 1, 16\) and .*down_proj_scales \(4, 63, 1\) do not pair"),
    (lambda s: s.update({f"{EXPERTS}.down_proj_blocks":
                         s[f"{EXPERTS}.down_proj_blocks"].to(torch.int8)}),
     r"down_proj_blocks' has dtype I8; Tandem loads U8"),
], ids=["blocks without scales", "scales without blocks", "unpaired shapes", "signed"])
def test_a_bad_mxfp4_checkpoint_is_refused_naming_the_fix(mxfp4_dir, tmp_path, change,
                                                          message):
    _, state, _ = mxfp4_dir
    state = dict(state)
    change(state)
    with pytest.raises(ValueError, match=message):
        LLM(str(save_folder(tmp_path, state)))


def with_attributes(**attributes) -> GptOssConfig:
    config = gpt_oss_config()
    for name, value in attributes.items():  # past the config's own validation
        setattr(config, name, value)
    return config


@pytest.mark.parametrize("config,message", [
    (with_attributes(layer_types=["sliding_attention", "chunked_attention"] * 2),
     "layer_types\\[1\\] is 'chunked_attention'"),
    (with_attributes(layer_types=["sliding_attention", "full_attention"]),
     "layer_types lists 2 layers, the model has num_hidden_layers=4"),
    (with_attributes(sliding_window=0), "sliding_window=0 .* must be at least 1"),
    (with_attributes(num_experts_per_tok=5), "num_experts_per_tok=5 must be between 1 and "
     "num_local_experts=4"),
    (with_attributes(swiglu_limit=0.0), "swiglu_limit=0.0 must be positive"),
    (with_attributes(quantization_config={"quant_method": "fp8"}),
     "quant_method 'fp8' is not supported for GPT-OSS"),
    (with_attributes(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4,
                                      "factor": 2.0}), "rope_type 'dynamic' is not supported"),
], ids=["layer type", "layer count", "window", "top k", "limit", "quantization", "rope"])
def test_a_config_the_family_cannot_run_is_refused_naming_the_fix(config, message):
    with pytest.raises(ValueError, match=message):
        model_class(config)


def test_lora_adapts_attention_and_refuses_experts(gpt_oss_dir):
    llm = LLM(str(gpt_oss_dir()))
    assert GptOssForCausalLM.lora_targets == ("q_proj", "k_proj", "v_proj", "o_proj")
    with pytest.raises(ValueError, match="gate_up_proj"):
        llm.engine.commit_lora({f"{EXPERTS}.gate_up_proj": (
            torch.zeros(2, 64), torch.zeros(64, 2), 1.0)}, 1, 1)
