"""Exact log-probs: the trainer's forward through the engine's kernels gives every sampled
token bit for bit the log-prob the engine returned, whatever the engine's batch, chunks,
cache, preemptions, adapter or KV pool (an FP8 one too: the trainer's K and V rounded
through it); its gradients are transformers' within float tolerance."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from tandem.rollout import LLM, SamplingParams
from tandem.trainers.config import TrainConfig
from tandem.trainers.exact_conflicts import exact_conflicts
from tandem.trainers.policy import completion_logprobs, sampling_replay, token_batch

from .test_fp8_kv import FP8_KV_SDPA
from .test_trainer import ENGINE, make_config, target_token  # noqa: F401 - a fixture

DTYPES = ["float32", "bfloat16"]
KV_CACHE_DTYPES = ["auto", "fp8"]
PROMPTS = [[(5 * i + j) % 200 + 3 for j in range(3 + 7 * i)] for i in range(6)]


def sampled(llm: LLM, params: SamplingParams, prompts=PROMPTS):
    """Every completion's prompt, tokens, log-probs and kept-set thresholds."""
    rows = [(prompt, c.token_ids, c.logprobs, c.sampling_thresholds)
            for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False))
            for c in out.outputs]
    return [list(column) for column in zip(*rows)]


def trainer_logprobs(model, llm: LLM, prompts, completions, temperature: float):
    """The trainer's log-probs of the completions through ``LLM.exact_forward``."""
    batch = token_batch(prompts, completions, 0)
    logprobs, _, _ = completion_logprobs(llm.exact_forward(model), batch, temperature)
    return logprobs, batch.completion_mask


def assert_exact(logprobs, mask, sampler_logprobs) -> None:
    width = logprobs.shape[1]
    expected = torch.tensor([row + [0.0] * (width - len(row)) for row in sampler_logprobs])
    assert torch.equal(logprobs * mask, expected), (logprobs * mask - expected).abs().max()


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_trainer_logprobs_are_the_engines_bit_for_bit(model_dir, kind, dtype, kv_cache_dtype):
    # Chunked prefill (16-token budget), a group of 4 sharing its prompt's blocks
    # (copy-on-write, prefix-cache hits), a pool small enough to preempt and recompute,
    # truncated sampling replayed.
    path = model_dir(kind)
    llm = LLM(str(path), dtype=dtype, max_model_len=64, max_num_batched_tokens=16,
              num_kv_blocks=24, block_size=4, kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0.9, top_k=20, max_tokens=24, ignore_eos=True, seed=3,
                            logprobs=0, n=4)
    prompts, completions, sampler_logprobs, thresholds = sampled(llm, params)
    assert llm.stats()["preemptions"] > 0 and llm.stats()["prefix_cache_hit_tokens"] > 0
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    batch = token_batch(prompts, completions, 0)
    batch.replay = sampling_replay(thresholds, completions, None, batch.num_completion_slots,
                                   20, 1.0, torch.device("cpu"))
    logprobs, _, differs = completion_logprobs(llm.exact_forward(model), batch, 0.9)
    assert_exact(logprobs, batch.completion_mask, sampler_logprobs)
    assert not differs.any()  # the trainer's own top-k set is the engine's


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
def test_gradients_match_autograd_through_transformers(llama_dir, kv_cache_dtype):
    # With an FP8 pool, against transformers attending over K and V rounded straight
    # through. Its K and V, of another summation order, round to another e4m3 value where
    # they fall within float32's error of a midpoint: 2.7e-4 of a gradient measured, where
    # the rounding ignored (plain SDPA) moves them by 0.25.
    llm = LLM(str(llama_dir), max_model_len=128, kv_cache_dtype=kv_cache_dtype)
    prompts, completions, _, _ = sampled(llm, SamplingParams(max_tokens=12, seed=1, n=2))
    attention, tolerance = ("sdpa", 1e-4) if kv_cache_dtype == "auto" else (FP8_KV_SDPA, 2e-3)
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32,
                                                 attn_implementation=attention)
    assert_gradients_match(llm, model, token_batch(prompts, completions, 0), tolerance)


def assert_gradients_match(llm: LLM, model, batch, tolerance: float) -> None:
    """The completions' log-probs of ``batch`` at temperature 0.8, summed, give every
    parameter of ``model`` the same gradient through ``llm``'s exact forward as through
    ``model``'s own (within ``tolerance`` of its norm)."""
    grads = []
    for forward in (llm.exact_forward(model), model):
        model.zero_grad()
        logprobs, _, _ = completion_logprobs(forward, batch, 0.8)
        (logprobs * batch.completion_mask).sum().backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    for name, exact in grads[0].items():
        reference = grads[1][name]
        assert (exact - reference).norm() <= tolerance * reference.norm() + 1e-7, name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["merge", "runtime"])
def test_a_lora_adapter_is_exact_and_disabled_is_the_base(llama_dir, mode, dtype):
    from peft import LoraConfig, get_peft_model

    from tandem.sync import LoraSync, peft_adapter_state

    llm = LLM(str(llama_dir), max_model_len=128, dtype=dtype)
    base = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=getattr(torch, dtype))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8,
                                            target_modules=["q_proj", "v_proj", "down_proj"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    LoraSync(llm, mode=mode).update(*peft_adapter_state(model))
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=2, logprobs=0, n=2)
    prompts, completions, sampler_logprobs, _ = sampled(llm, params)
    exact = llm.exact_forward(model, lora_runtime=mode == "runtime")
    batch = token_batch(prompts, completions, 0)
    logprobs, _, _ = completion_logprobs(exact, batch, 1.0)
    assert_exact(logprobs, batch.completion_mask, sampler_logprobs)
    with model.disable_adapter():
        off, _, _ = completion_logprobs(exact, batch, 1.0)
    base_engine = LLM(str(llama_dir), max_model_len=128, dtype=dtype)
    fresh = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=getattr(torch, dtype))
    plain, _ = trainer_logprobs(fresh, base_engine, prompts, completions, 1.0)
    assert torch.equal(off, plain) and not torch.equal(off, logprobs)


@pytest.fixture(scope="module")
def engines(llama_dir):
    """Engines of two chunk budgets over one tiny model."""
    return {budget: LLM(str(llama_dir), max_model_len=128, max_num_batched_tokens=budget,
                        num_kv_blocks=48, block_size=4) for budget in (8, 64)}


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(budget=st.sampled_from([8, 64]), others=st.lists(st.integers(1, 40), max_size=6),
       warm=st.booleans(), n=st.integers(1, 3))
def test_a_rows_bits_never_depend_on_batch_chunks_or_cache(engines, budget, others, warm, n):
    llm = engines[budget]
    prompt = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=11, logprobs=0,
                            ignore_eos=True)
    llm.reset_prefix_cache()
    alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    if not warm:
        llm.reset_prefix_cache()
    batch = [[(3 * length + j) % 150 + 2 for j in range(length)] for length in others]
    outputs = llm.generate([*batch, prompt], [SamplingParams(max_tokens=6, n=n)] * len(batch)
                           + [params], use_tqdm=False)
    row = outputs[-1].outputs[0]
    assert row.token_ids == alone.token_ids and row.logprobs == alone.logprobs


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grpo_is_exactly_on_policy_at_every_step(llama_dir, tmp_path, target_token,  # noqa: F811
                                                 dtype, kv_cache_dtype):
    from tandem.trainers.config import RolloutConfig
    from tandem.trainers.trainer import Trainer

    # the recipe's rollout.engine.kv_cache_dtype
    rollout = RolloutConfig(prompts_per_step=4, num_generations=8, max_tokens=8,
                            engine={**ENGINE, "kv_cache_dtype": kv_cache_dtype})
    trainer = Trainer(make_config(llama_dir, tmp_path, target_token, dtype=dtype, steps=3,
                                  rollout=rollout))
    assert trainer.policy.exact_forward is not None
    for _ in range(3):
        metrics = trainer.train_step()
        assert metrics["sampler_logprob_diff_max"] == 0.0
        assert metrics["sampler_logprob_exact_fraction"] == 1.0


@pytest.mark.parametrize("override,named", [
    ({"autocast": "bfloat16"}, "autocast"), ({"sync_alias": True}, "sync_alias"),
    ({"distributed": "fsdp2"}, "fsdp2"),
    ({"rollout": {"engine": {"dtype": "bfloat16"}}}, "engine dtype")])
def test_exact_where_it_cannot_hold_is_refused_at_start(override, named):
    from tandem.trainers.config import RolloutConfig

    if "rollout" in override:
        override = {"rollout": RolloutConfig(engine=override["rollout"]["engine"])}
    with pytest.raises(ValueError, match=f"exact_logprobs: true cannot hold with .*{named}"):
        TrainConfig(model="x", exact_logprobs=True, **override)
    conflicts = exact_conflicts(TrainConfig(model="x", **override))
    assert named.split(":")[0].split()[0] in " ".join(conflicts)


def test_an_explicit_request_where_the_kernels_cannot_run_names_the_fix(llama_dir):
    with pytest.raises(ValueError, match="exact_logprobs=True .*set exact_logprobs=False"):
        LLM(str(llama_dir), exact_logprobs=True, attention_backend="torch")
    assert LLM(str(llama_dir), attention_backend="torch").exact_forward(None) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_triton_matmul_gives_a_row_the_same_bits_in_any_batch(dtype):
    # In Triton's interpreter (the kernel a GPU runs, on numpy): K and N not multiples of
    # the tiles, M across tile boundaries; accurate against float64 too.
    from tandem.kernels import triton_linear
    from tandem.kernels.testing import TOLERANCE, relative_error

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 80, generator=generator).to(dtype)
    bias = torch.randn(40, generator=generator).to(dtype)
    rows = torch.randn(70, 80, generator=generator).to(dtype)
    alone = triton_linear.linear(rows[:1], weight, bias)
    for count in (2, 33, 65, 70):
        assert torch.equal(triton_linear.linear(rows[:count], weight, bias)[:1], alone)
    reference = rows.double() @ weight.double().t() + bias.double()
    assert relative_error(triton_linear.linear(rows, weight, bias), reference) < TOLERANCE[dtype]


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_triton_kernels_are_exact_in_the_interpreter(llama_dir, dtype, kv_cache_dtype):
    # The CUDA path (Triton: every linear through the fixed-tile matmul, every query through
    # the prefill kernel) run by the interpreter, chunked prefill and a copy-on-write group.
    llm = LLM(str(llama_dir), dtype=dtype, max_model_len=64, attention_backend="triton",
              exact_logprobs=True, max_num_batched_tokens=16, block_size=4, num_kv_blocks=64,
              kv_cache_dtype=kv_cache_dtype)
    assert llm.engine.runner.model.linear_layout == "triton (batch-invariant)"
    prompts = [[3 + i, 5, 7 + i, 9, 11][: 2 + i] for i in range(3)]
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=1, logprobs=0, n=2,
                            ignore_eos=True)
    prompts, completions, sampler_logprobs, _ = sampled(llm, params, prompts)
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=getattr(torch, dtype))
    logprobs, mask = trainer_logprobs(model, llm, prompts, completions, 1.0)
    assert_exact(logprobs, mask, sampler_logprobs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grpo_on_the_embedded_model_is_exactly_on_policy(tmp_path, dtype):
    # The main job's model and task, two short steps: every sampled token's log-prob in the
    # trainer equals the engine's, in float32 and bfloat16.
    from tandem.rollout.default_model import DEFAULT_MODEL
    from tandem.trainers.config import LoggingConfig, OptimConfig, RolloutConfig
    from tandem.trainers.trainer import Trainer

    config = TrainConfig(
        model=DEFAULT_MODEL, dtype=dtype, task="arith", steps=2, output_dir=str(tmp_path),
        rollout=RolloutConfig(prompts_per_step=2, num_generations=4, max_tokens=12,
                              engine={"kv_cache_memory_bytes": 64 << 20,
                                      "max_model_len": 256}),
        optim=OptimConfig(lr=2e-5, micro_batch_size=8),
        logging=LoggingConfig(wandb=False, progress_bar=False, console_every=0))
    trainer = Trainer(config)
    for _ in range(2):
        metrics = trainer.train_step()
        assert metrics["sampler_logprob_diff_max"] == 0.0
        assert metrics["sampler_logprob_exact_fraction"] == 1.0
