"""LoRA adapters merged into a running engine: equal to peft's merge, no drift, atomic faults;
on packed modules (Phi-3's qkv_proj, gate_up_proj) split into the engine's parts."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.rollout import LLM, SamplingParams, WeightUpdateError
from tandem.sync import LoraSpec, LoraSync, peft_adapter_state
from tandem.trainers.policy import completion_logprobs, token_batch
from tandem.trainers.trainer import Trainer

from .test_exact_logprobs import assert_exact, sampled
from .test_models import check_prompt_logprobs, hf_greedy
from .test_phi3 import GEOMETRY, HEAD_DIM, greedy, phi3_dir  # noqa: F401 - a fixture
from .test_phi3 import PROMPTS as PHI3_PROMPTS
from .test_trainer import make_config, target_token  # noqa: F401 - a fixture

peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
SAMPLED = SamplingParams(temperature=0.7, seed=11, max_tokens=12, ignore_eos=True, logprobs=0)
PROMPTS = [[5, 9, 33, 70, 2, 81, 100, 4, 17, 3, 44, 12, 200, 7, 8, 9, 10, 11, 12, 13, 14, 15],
           [40, 41, 42]]
UP_A = "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"
UP_B = "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"


def hf_model(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def lora_model(base, seed: int = 0, **options):
    """``base`` wrapped by peft with a random (non-zero) adapter on every linear layer."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False,
                             **options)
    return peft.get_peft_model(base, config)


def perturb_adapter(model, generator: torch.Generator) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(0.02 * torch.randn(param.shape, generator=generator))


def generations(llm: LLM) -> list[tuple[list[int], list[float]]]:
    outputs = llm.generate(PROMPTS * 2, [GREEDY] * 2 + [SAMPLED] * 2, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def assert_same_generations(actual, expected) -> None:
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(actual, expected, strict=True):
        assert tokens == ref_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs),
                                   rtol=0, atol=1e-5)


def merged_weights(model) -> dict[str, torch.Tensor]:
    """peft's own merge of ``model`` (which it unwraps in place)."""
    return model.merge_and_unload().state_dict()


def merged_engine(weights: dict[str, torch.Tensor], folder, path) -> LLM:
    """A fresh engine loaded from ``weights`` saved with ``folder``'s config and tokenizer."""
    model = hf_model(folder)
    model.load_state_dict(weights)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((folder / name).read_bytes())
    return LLM(str(path))


def assert_engine_weights(llm: LLM, expected: dict[str, torch.Tensor]) -> None:
    for name, weight in llm.engine.weight_parameters().items():
        torch.testing.assert_close(weight, expected[name], rtol=0, atol=1e-6, msg=name)


def test_adapter_update_equals_fresh_engine_from_peft_merge(llama_dir, tmp_path):
    llm = LLM(str(llama_dir))
    before = generations(llm)
    model = lora_model(hf_model(llama_dir))
    version = LoraSync(llm).update(*peft_adapter_state(model))
    assert version == 1 and llm.stats()["weight_version"] == 1
    after = generations(llm)
    assert [tokens for tokens, _ in after] != [tokens for tokens, _ in before]
    assert_same_generations(after, generations(merged_engine(merged_weights(model), llama_dir,
                                                             tmp_path)))


def test_twenty_updates_do_not_drift(llama_dir, tmp_path):
    llm = LLM(str(llama_dir))
    sync = LoraSync(llm)
    model = lora_model(hf_model(llama_dir), seed=1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(20):
        perturb_adapter(model, generator)
        adapter = [(n, p) for n, p in model.named_parameters() if "lora_" in n]
        assert ".lora_A.default.weight" in adapter[0][0]
        sync.update(adapter, model.peft_config["default"])
    assert llm.stats()["weight_version"] == 20
    expected = merged_weights(model)
    assert_engine_weights(llm, expected)
    assert_same_generations(generations(llm),
                            generations(merged_engine(expected, llama_dir, tmp_path)))


def test_rslora_scale_is_honoured(llama_dir):
    llm = LLM(str(llama_dir))
    model = lora_model(hf_model(llama_dir), seed=2, use_rslora=True)
    tensors, spec = peft_adapter_state(model)
    assert spec.use_rslora and spec.scale == 4.0
    LoraSync(llm).update(tensors, {"r": 4, "lora_alpha": 8, "use_rslora": True})
    assert_engine_weights(llm, merged_weights(model))


def test_modules_left_out_return_exactly_to_their_base(llama_dir):
    llm = LLM(str(llama_dir))
    sync = LoraSync(llm, base_device="cpu")
    tensors, spec = peft_adapter_state(lora_model(hf_model(llama_dir), seed=3))
    sync.update(tensors, spec)
    sync.update({k: v for k, v in tensors.items() if ".q_proj." in k}, spec)
    base = hf_model(llama_dir).state_dict()
    weights = llm.engine.weight_parameters()
    assert {name for name in weights if not torch.equal(weights[name], base[name])} == {
        f"model.layers.{i}.self_attn.q_proj.weight" for i in range(2)}
    sync.update({}, spec)
    assert all(torch.equal(weight, base[name]) for name, weight in weights.items())


def faulty_adapters(tensors: dict[str, torch.Tensor]):
    up = {k: v for k, v in tensors.items() if k not in (UP_A, UP_B)}
    yield "NaN", {**tensors, UP_B: torch.full_like(tensors[UP_B], float("nan"))}
    yield "unknown module", {**up, UP_A.replace("layers.0", "layers.9"): tensors[UP_A],
                             UP_B.replace("layers.0", "layers.9"): tensors[UP_B]}
    yield "not among target_modules", {**up, UP_A.replace("up_proj", "bogus_proj"): tensors[UP_A],
                                       UP_B.replace("up_proj", "bogus_proj"): tensors[UP_B]}
    yield "rank r=4", {**tensors, UP_A: tensors[UP_A][:3], UP_B: tensors[UP_B][:, :3]}
    yield "makes a", {**tensors, UP_A: tensors[UP_A][:, :-1]}
    yield "lacks its lora_B", {k: v for k, v in tensors.items() if k != UP_B}
    yield "not a LoRA", {**tensors, "base_model.model.lm_head.modules_to_save.weight":
                         tensors[UP_A]}
    yield "several adapters", {UP_A.replace(".weight", ".default.weight"): tensors[UP_A],
                               UP_B.replace(".weight", ".other.weight"): tensors[UP_B]}


def test_bad_adapter_keeps_previous_weights_serving(llama_dir):
    llm = LLM(str(llama_dir))
    sync = LoraSync(llm)
    model = lora_model(hf_model(llama_dir), seed=4)
    tensors, spec = peft_adapter_state(model)
    sync.update(tensors, spec)
    before = generations(llm)
    for message, adapter in faulty_adapters(tensors):
        with pytest.raises(WeightUpdateError, match=message):
            sync.update(adapter, spec)
        assert llm.stats()["weight_version"] == 1
    assert_same_generations(generations(llm), before)
    perturb_adapter(model, torch.Generator().manual_seed(4))
    assert sync.update(*peft_adapter_state(model)) == 2
    assert_engine_weights(llm, merged_weights(model))


def shifted_base(folder) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return {name: weight + 0.05 * torch.randn(weight.shape, generator=generator)
            for name, weight in hf_model(folder).state_dict().items()}


def peft_merge_on(base: dict[str, torch.Tensor], folder, adapter, seed: int):
    """peft's merge of ``adapter`` over the base weights ``base``."""
    model = hf_model(folder)
    model.load_state_dict(base)
    wrapped = lora_model(model, seed)
    peft.set_peft_model_state_dict(wrapped, adapter)
    return merged_weights(wrapped)


def test_base_changes_go_through_set_base_or_rebase(llama_dir):
    llm = LLM(str(llama_dir))
    sync = LoraSync(llm)
    tensors, spec = peft_adapter_state(lora_model(hf_model(llama_dir), seed=6))
    sync.update(tensors, spec)
    base = shifted_base(llama_dir)
    expected = peft_merge_on(base, llama_dir, tensors, seed=6)
    assert sync.set_base(base) == 2
    assert_engine_weights(llm, expected)
    llm.update_weights(base.items())
    with pytest.raises(WeightUpdateError, match="outside LoraSync"):
        sync.update(tensors, spec)
    assert llm.stats()["weight_version"] == 3
    sync.rebase()
    assert sync.update(tensors, spec) == 4
    assert_engine_weights(llm, expected)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="r=0"):
        LoraSpec(r=0, lora_alpha=8)
    with pytest.raises(ValueError, match="use_dora"):
        LoraSpec.from_peft(peft.LoraConfig(r=4, target_modules=TARGETS, use_dora=True))


def test_lora_sync_refuses_what_is_not_an_engine_naming_what_it_lacks():
    class NotAnEngine:
        weight_version = 0

    with pytest.raises(TypeError, match=r"weight_parameters, commit_weights, commit_lora.*"
                                        r"NotAnEngine lacks them"):
        LoraSync(NotAnEngine())


def test_engine_and_sync_import_without_peft():
    code = ("import sys, tandem.rollout, tandem.sync, tandem.sync.lora; "
            "assert 'peft' not in sys.modules, 'peft was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_runtime_adapter_equals_merged_model_and_can_be_removed(llama_dir, tmp_path):
    llm = LLM(str(llama_dir))
    before = generations(llm)
    sync = LoraSync(llm, mode="runtime")
    model = lora_model(hf_model(llama_dir), seed=3)
    tensors, spec = peft_adapter_state(model)
    sync.update(tensors, spec)
    weights_before = {n: w.clone() for n, w in llm.engine.weight_parameters().items()}
    # Greedy rows only: a seeded sample can flip where its uniform draw falls within float
    # tolerance of a boundary between two tokens' cumulative probabilities.
    runtime = generations(llm)[:2]
    expected = generations(merged_engine(merged_weights(model), llama_dir, tmp_path))[:2]
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(runtime, expected, strict=True):
        assert tokens == ref_tokens
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs),
                                   rtol=0, atol=1e-4)
    for name, weight in llm.engine.weight_parameters().items():
        assert torch.equal(weight, weights_before[name])  # the weights themselves untouched
    assert sync.update({}, spec) == 2
    assert generations(llm) == before
    bad = {k: (v.clone().fill_(float("nan")) if "lora_B" in k else v) for k, v in tensors.items()}
    with pytest.raises(WeightUpdateError, match="NaN"):
        sync.update(bad, spec)
    assert llm.stats()["weight_version"] == 2


# Phi-3: PEFT adapters on the packed qkv_proj (q, k, v of unequal rows: 6 query heads, 2 KV
# heads) and gate_up_proj, split by the engine into its parts.
PHI3_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
QKV = "model.layers.1.self_attn.qkv_proj"


def phi3_lora_model(folder, dtype: torch.dtype = torch.float32, seed: int = 0):
    """The tiny Phi-3 wrapped by peft with a random (non-zero) adapter on its packed and
    plain projections."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=PHI3_TARGETS,
                             init_lora_weights=False)
    return peft.get_peft_model(base, config)


@pytest.mark.parametrize("mode", ["merge", "runtime"])
def test_a_peft_adapter_on_packed_modules_equals_peft_merged_model(phi3_dir, mode):  # noqa: F811
    llm = LLM(str(phi3_dir("phi3")))
    before = greedy(llm)
    model = phi3_lora_model(phi3_dir("phi3"))
    tensors, spec = peft_adapter_state(model)
    assert f"base_model.model.{QKV}.lora_B.weight" in tensors
    assert LoraSync(llm, mode=mode).update(tensors, spec) == 1
    merged = model.merge_and_unload()
    assert greedy(llm) == [hf_greedy(merged, prompt, 12) for prompt in PHI3_PROMPTS] != before
    check_prompt_logprobs(llm, merged, PHI3_PROMPTS, k=3)
    if mode == "merge":  # peft's packed merge in float32, each part's rows bit for bit
        weights = llm.engine.weight_parameters()
        for name, tensor in merged.state_dict().items():
            for part, expected in llm.engine.unalias(name, tensor) or [(name, tensor)]:
                assert torch.equal(weights[part], expected), part


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_merged_adapter_on_packed_modules_is_exact(phi3_dir, dtype):  # noqa: F811
    # The trainer's exact forward merges the packed matrix whole; the engine each part from
    # its rows of the same product.
    llm = LLM(str(phi3_dir("phi3")), max_model_len=128, dtype=dtype)
    model = phi3_lora_model(phi3_dir("phi3"), getattr(torch, dtype), seed=1)
    LoraSync(llm).update(*peft_adapter_state(model))
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=2, logprobs=0, n=2)
    prompts, completions, sampler_logprobs, _ = sampled(llm, params)
    batch = token_batch(prompts, completions, 0)
    logprobs, _, _ = completion_logprobs(llm.exact_forward(model), batch, 1.0)
    assert_exact(logprobs, batch.completion_mask, sampler_logprobs)


@pytest.mark.parametrize("mode", ["merge", "runtime"])
@pytest.mark.parametrize("rows", [-1, 1], ids=["a row short", "a row over"])
def test_a_packed_adapter_of_the_wrong_rows_is_refused_naming_the_module(phi3_dir,  # noqa: F811
                                                                         mode, rows):
    llm = LLM(str(phi3_dir("phi3")))
    sync = LoraSync(llm, mode=mode)
    tensors, spec = peft_adapter_state(phi3_lora_model(phi3_dir("phi3"), seed=2))
    sync.update(tensors, spec)
    before = greedy(llm)
    name = f"base_model.model.{QKV}.lora_B.weight"
    packed_rows = (6 + 2 + 2) * HEAD_DIM
    wrong = torch.randn(packed_rows + rows, spec.r)
    message = (rf"{QKV}.weight' makes a \[{packed_rows + rows}, {GEOMETRY['hidden_size']}\] "
               rf"change, the engine's weight is \[{packed_rows}, {GEOMETRY['hidden_size']}\]")
    with pytest.raises(WeightUpdateError, match=message):
        sync.update({**tensors, name: wrong}, spec)
    assert llm.stats()["weight_version"] == 1
    assert greedy(llm) == before


def test_lora_training_of_phi3_packed_modules_stays_exact(phi3_dir, tmp_path,  # noqa: F811
                                                          target_token):  # noqa: F811
    config = make_config(phi3_dir("phi3"), tmp_path, target_token, steps=2)
    config.lora.enabled = True
    config.lora.r = 4
    trainer = Trainer(config)
    assert set(trainer.policy.model.peft_config["default"].target_modules) == set(PHI3_TARGETS)
    history = [trainer.train_step() for _ in range(2)]
    assert max(m["sampler_logprob_diff_max"] for m in history) == 0.0
    assert trainer.llm.weight_version == 2
