"""Mixture-of-experts families (Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral)
against transformers: greedy tokens and log-probs, weights in both layouts (a checkpoint's
tensor per expert, transformers' stacked experts), bad expert tensors named, tensor
parallelism, exact log-probs through the experts, the memory plan and offload, and what is
refused for now."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from tandem.kernels import cpu_linear
from tandem.rollout import LLM, Continuation, RequestOutput, SamplingParams, WeightUpdateError
from tandem.rollout.worker.models import model_class
from tandem.rollout.worker.models.moe import FusedMoE, _expert_panels
from tandem.rollout.worker.weight_offload import OffloadableWeights

from .conftest import build_tokenizer
from .test_exact_logprobs import assert_exact, sampled, trainer_logprobs
from .test_models import check_prompt_logprobs, hf_greedy

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            num_experts_per_tok=2, max_position_embeddings=256)
CONFIGS = {
    # layer 1 dense (mlp_only_layers): both kinds of layer in one model
    "qwen3_moe": lambda v: Qwen3MoeConfig(
        vocab_size=v, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
        num_experts=4, norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False,
        **TINY),
    # a shared expert beside the routed ones; q/k/v biases; top-k weights not renormalised
    "qwen2_moe": lambda v: Qwen2MoeConfig(
        vocab_size=v, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, num_experts=4, norm_topk_prob=False,
        tie_word_embeddings=False, **TINY),
    "mixtral": lambda v: MixtralConfig(vocab_size=v, intermediate_size=32, num_local_experts=4,
                                       sliding_window=None, **TINY),
}
PROMPTS = [[1, 5, 9, 2, 7], [1, 30, 31, 32, 33, 34, 35, 36, 37], [1, 12]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)
EXACT_PROMPTS = [[(5 * i + j) % 200 + 3 for j in range(3 + 7 * i)] for i in range(4)]


def save_moe(kind: str, path, seed: int = 0):
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[kind](len(tokenizer)), dtype=torch.float32)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    return {(kind, seed): save_moe(kind, tmp_path_factory.mktemp(f"{kind}{seed}"), seed)
            for kind in CONFIGS for seed in (0, 1)}


def greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def reference(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_greedy_tokens_and_log_probs_match_transformers(moe_dirs, kind):
    llm, hf_model = LLM(str(moe_dirs[kind, 0])), reference(moe_dirs[kind, 0])
    assert greedy(llm) == [hf_greedy(hf_model, prompt, 12) for prompt in PROMPTS]
    check_prompt_logprobs(llm, hf_model, PROMPTS, k=2)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_updates_take_stacked_and_per_expert_layouts(moe_dirs, kind):
    fresh = greedy(LLM(str(moe_dirs[kind, 1])))
    stacked = LLM(str(moe_dirs[kind, 0]))  # a trainer's named_parameters(): experts stacked
    before = greedy(stacked)  # the experts' panels laid out, then written over by the update
    stacked.update_weights(reference(moe_dirs[kind, 1]).named_parameters())
    assert greedy(stacked) == fresh != before
    per_expert = LLM(str(moe_dirs[kind, 0]))  # a checkpoint's names: one tensor per expert
    per_expert.update_weights(load_file(moe_dirs[kind, 1] / "model.safetensors").items())
    assert greedy(per_expert) == fresh


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_panels_are_each_experts_layout_written_over_the_last_versions(dtype):
    weight = torch.randn(3, 40, 24).to(dtype)  # 40 rows: the last panel padded
    previous = torch.full((3, 3, 24, cpu_linear.PANEL), float("nan"), dtype=dtype)
    panels = _expert_panels(weight, previous)
    assert panels.data_ptr() == previous.data_ptr()
    assert torch.equal(panels, torch.stack([cpu_linear.panel_layout(w) for w in weight]))
    other = _expert_panels(weight[:, :32], previous)  # another shape: new panels
    assert other.data_ptr() != previous.data_ptr() and other.shape == (3, 2, 24, cpu_linear.PANEL)


def test_a_bad_expert_tensor_is_named_and_nothing_changes(moe_dirs):
    llm = LLM(str(moe_dirs["qwen3_moe", 0]))
    before = greedy(llm)
    tensors = load_file(moe_dirs["qwen3_moe", 1] / "model.safetensors")
    name = "model.layers.0.mlp.experts.2.up_proj.weight"
    with pytest.raises(WeightUpdateError, match=f"{name}.*shape"):
        llm.update_weights({**tensors, name: tensors[name][:-1]}.items())
    tensors[name][3, 4] = float("nan")
    with pytest.raises(WeightUpdateError, match=f"{name}.*NaN"):
        llm.update_weights(tensors.items())
    assert greedy(llm) == before


def test_a_checkpoint_missing_an_expert_names_it(moe_dirs, tmp_path):
    folder = moe_dirs["mixtral", 0]
    for file in folder.iterdir():
        if file.suffix != ".safetensors":
            (tmp_path / file.name).write_bytes(file.read_bytes())
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    from safetensors.torch import save_file
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="experts.3.w2.weight"):
        LLM(str(tmp_path))


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe"])
def test_tensor_parallel_shards_the_experts_and_equals_one_rank(moe_dirs, kind):
    folder = moe_dirs[kind, 0]  # Qwen2-MoE: its shared expert sharded like the experts
    assert greedy(LLM(str(folder), tensor_parallel_size=2)) == greedy(LLM(str(folder)))


def test_lora_adapts_attention_and_refuses_experts(moe_dirs):
    llm = LLM(str(moe_dirs["mixtral", 0]))
    assert model_class(llm.engine.runner.model.config).lora_targets == (
        "q_proj", "k_proj", "v_proj", "o_proj")
    expert = "model.layers.0.block_sparse_moe.experts.0.w1.weight"
    with pytest.raises(ValueError, match="w1"):
        llm.engine.commit_lora({expert: (torch.zeros(2, 64), torch.zeros(32, 2), 1.0)}, 1, 1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_the_trainers_log_probs_are_the_engines_bit_for_bit(moe_dirs, kind, dtype):
    # Chunked prefill, groups sharing prompt blocks, preemptions: a token's experts, and so
    # its log-prob, never depend on the batch it ran in, and the trainer routes alike.
    folder = moe_dirs[kind, 0]
    llm = LLM(str(folder), dtype=dtype, max_model_len=64, max_num_batched_tokens=16,
              num_kv_blocks=24, block_size=4)
    assert llm.engine.runner.exact_logprobs  # on by default on CPU, experts included
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=3,
                            logprobs=0, n=4)
    prompts, completions, sampler_logprobs, _ = sampled(llm, params, EXACT_PROMPTS)
    assert llm.stats()["preemptions"] > 0
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    logprobs, mask = trainer_logprobs(model, llm, prompts, completions, 1.0)
    assert_exact(logprobs, mask, sampler_logprobs)


def hf_routing(hf_model, token_ids: list[int]) -> torch.Tensor:
    """transformers' top-k experts of every position, ``[positions, moe layers, k]``."""
    chosen = []
    hooks = [module.register_forward_hook(lambda _, __, out: chosen.append(out[2]))
             for name, module in hf_model.named_modules() if name.endswith("mlp.gate")]
    with torch.no_grad():
        hf_model(torch.tensor([token_ids]))
    for hook in hooks:
        hook.remove()
    return torch.stack(chosen, dim=1)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_routed_experts_are_the_routers_choices_for_every_position(moe_dirs, kind):
    folder = moe_dirs[kind, 0]
    llm, hf_model = LLM(str(folder)), reference(folder)
    params = SamplingParams(n=2, max_tokens=10, ignore_eos=True, seed=5,
                            return_routed_experts=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    moe_layers = 1 if kind == "qwen3_moe" else 2  # Qwen3-MoE's layer 1 is dense here
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        for completion in output.outputs:
            tokens = prompt + completion.token_ids
            routed = completion.routed_experts
            assert routed.shape == (len(tokens) - 1, moe_layers, 2)
            assert routed.dtype == torch.uint8
            expected = hf_routing(hf_model, tokens)[:-1]
            assert torch.equal(routed.long().sort(-1).values, expected.sort(-1).values)
        again = RequestOutput.from_dict(json.loads(json.dumps(output.to_dict())))
        assert torch.equal(again.outputs[1].routed_experts, output.outputs[1].routed_experts)


def test_routing_is_the_same_decoded_as_prefilled(moe_dirs):
    # exact kernels: a position routes alike in a decode step and in a long prefill
    llm = LLM(str(moe_dirs["mixtral", 0]), max_num_batched_tokens=8)
    params = SamplingParams(max_tokens=12, ignore_eos=True, seed=2, return_routed_experts=True)
    decoded = llm.generate(PROMPTS, params, use_tqdm=False)
    full = [p + o.outputs[0].token_ids for p, o in zip(PROMPTS, decoded, strict=True)]
    prefilled = llm.generate(full, SamplingParams(max_tokens=1, return_routed_experts=True),
                             use_tqdm=False)
    for d, p in zip(decoded, prefilled, strict=True):
        assert torch.equal(d.outputs[0].routed_experts, p.outputs[0].routed_experts[:-1])


def test_routed_experts_are_refused_where_there_are_none(llama_dir):
    with pytest.raises(ValueError, match="return_routed_experts needs a mixture-of-experts"):
        LLM(str(llama_dir)).generate([[1, 2, 3]], SamplingParams(return_routed_experts=True))


@pytest.mark.parametrize("held_blocks", ["kept", "dropped"])
def test_a_continuations_routing_covers_every_turn_as_one_prompt_would(moe_dirs, held_blocks):
    # Three turns of a group of two, each continuing its completion with "tool" tokens; the
    # last turn's routing covers the whole conversation, as the conversation sent as one
    # prompt is routed (exact kernels: the same experts, decoded or prefilled). With its
    # blocks dropped under pressure, a turn recomputes its earlier positions instead.
    llm = LLM(str(moe_dirs["qwen2_moe", 0]))
    params = SamplingParams(n=2, max_tokens=5, ignore_eos=True, seed=7,
                            return_routed_experts=True)
    turn = llm.generate([PROMPTS[1]], params, hold_kv=True, use_tqdm=False)[0]
    llm.release(turn.request_id, 0)
    index = 1  # the group's second completion: its prompt's routing is its first's
    for tool in ([40, 41, 42], [50, 51]):
        if held_blocks == "dropped":
            llm.engine.scheduler.release_held_kv()
        one = SamplingParams(max_tokens=5, ignore_eos=True, seed=7, return_routed_experts=True)
        turn = llm.generate([Continuation(turn.request_id, index, tool)], one, hold_kv=True,
                            use_tqdm=False)[0]
        index = 0
    completion = turn.outputs[0]
    conversation = turn.prompt_token_ids + completion.token_ids
    whole = LLM(str(moe_dirs["qwen2_moe", 0])).generate(
        [conversation], SamplingParams(max_tokens=1, return_routed_experts=True),
        use_tqdm=False)[0].outputs[0].routed_experts
    assert completion.routed_experts.shape[0] == len(conversation) - 1
    assert torch.equal(completion.routed_experts, whole[:-1])
    llm.release(turn.request_id)


def test_routed_experts_come_over_the_rollouts_route(moe_dirs):
    from tandem.rollout.serving.client import TandemClient

    from .test_server import API_KEY, running_server

    folder = moe_dirs["qwen3_moe", 0]
    params = SamplingParams(n=2, max_tokens=6, ignore_eos=True, seed=4,
                            return_routed_experts=True)
    offline = LLM(str(folder), num_kv_blocks=256, max_model_len=256).generate(
        PROMPTS[:2], params, use_tqdm=False)
    with running_server(folder) as (url, _):
        served = TandemClient(url, API_KEY).generate(PROMPTS[:2], params)
    for ours, theirs in zip(served, offline, strict=True):
        for a, b in zip(ours.outputs, theirs.outputs, strict=True):
            assert a.token_ids == b.token_ids
            assert torch.equal(a.routed_experts, b.routed_experts)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_the_plan_counts_the_experts_and_sleep_1_offloads_them(moe_dirs, kind):
    folder = moe_dirs[kind, 0]
    llm, hf_model = LLM(str(folder)), reference(folder)
    runner = llm.engine.runner
    hf_bytes = sum(p.numel() * p.element_size() for p in hf_model.parameters())
    assert runner.weight_bytes() == hf_bytes  # every expert's weights, counted once
    before = greedy(llm)
    # sleep(1) on CUDA offloads the weights' region, made at load; here made on CPU
    model = runner.model
    weights = OffloadableWeights(model, torch.device("cpu"))
    weights.offload(model)
    host = range(weights.host.data_ptr(), weights.host.data_ptr() + weights.host.nbytes)
    experts = [m for m in model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(m.gate_up_proj.data_ptr() in host and m.down_proj.data_ptr() in host
                           for m in experts)
    weights.reload(model)
    assert greedy(llm) == before
