"""The model contract, from outside the package: a toy family defined and registered here
(a Llama variant whose MLP is tanh-GELU-gated, its gate and up projections stored as one
packed ``gate_up_proj`` as vLLM stores them) runs in the engine, takes weight updates and
run-time LoRA by Hugging Face names, and runs tensor-parallel on CPU, each against
transformers' Llama with the same activation."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from tandem.rollout import LLM, CausalLM, SamplingParams, WeightUpdateError, register_model
from tandem.rollout.parallel.tensor_parallel import COLUMN, ROW
from tandem.rollout.worker.models import model_class
from tandem.rollout.worker.models.layers import FusedProjections, LoraLinear
from tandem.rollout.worker.models.llama import ArchitectureSpec, LlamaForCausalLM

from .conftest import SMALL, build_tokenizer
from .test_models import check_prompt_logprobs, hf_greedy

ARCHITECTURE = "GeluLlamaForCausalLM"
PROMPTS = [[1, 5, 9, 2, 7], [1, 30, 31, 32, 33, 34, 35, 36, 37], [1, 12]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, min_tokens=12)


class PackedGeluMLP(nn.Module):
    """``down(gelu_tanh(gate(x)) * up(x))``, gate and up in one packed column-parallel layer."""

    def __init__(self, config, ops, tp) -> None:
        super().__init__()
        hidden, intermediate = config.hidden_size, config.intermediate_size // tp.size
        self.gate_up_proj = LoraLinear(hidden, 2 * intermediate, False, COLUMN,
                                       parts=("gate_proj", "up_proj"))
        self.down_proj = LoraLinear(intermediate, hidden, False, ROW)
        self.gate_up = FusedProjections(self.gate_up_proj)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)[0].chunk(2, dim=-1)
        return self.tp.all_reduce(self.down_proj(F.gelu(gate, approximate="tanh") * up))


class GeluLlamaForCausalLM(LlamaForCausalLM):
    arch = ArchitectureSpec(bias_from_config=True, mlp=PackedGeluMLP)

    @classmethod
    def check_config(cls, config) -> None:
        if config.hidden_act != "gelu_pytorch_tanh":
            raise ValueError("the toy family runs hidden_act 'gelu_pytorch_tanh' only")


register_model(ARCHITECTURE, GeluLlamaForCausalLM)


def save_toy(path, seed: int = 0):
    """A tiny transformers Llama with the toy's activation, saved under the toy's name."""
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_act="gelu_pytorch_tanh",
                         tie_word_embeddings=False, **SMALL)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    config_file = path / "config.json"  # save_pretrained names the class it saved
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()),
                                       "architectures": [ARCHITECTURE]}))
    return path


@pytest.fixture(scope="module")
def toy_dirs(tmp_path_factory):
    return [save_toy(tmp_path_factory.mktemp(f"toy{seed}"), seed) for seed in (0, 1)]


def reference(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_the_registered_family_serves_its_architecture_with_transformers_parity(toy_dirs):
    llm = LLM(str(toy_dirs[0]))
    assert type(llm.engine.runner.model) is GeluLlamaForCausalLM
    hf_model = reference(toy_dirs[0])
    assert greedy(llm) == [hf_greedy(hf_model, prompt, 12) for prompt in PROMPTS]
    check_prompt_logprobs(llm, hf_model, PROMPTS, k=2)


def test_the_weight_spec_maps_hugging_face_names_into_the_packed_parameter(toy_dirs):
    model = LLM(str(toy_dirs[0])).engine.runner.model
    spec = model.weight_spec()
    gate, up = (spec[f"model.layers.0.mlp.{name}.weight"] for name in ("gate_proj", "up_proj"))
    assert gate.parameter == up.parameter == "model.layers.0.mlp.gate_up_proj.weight"
    assert (gate.slot, up.slot) == (((0, 2),), ((1, 2),))
    assert "model.layers.0.mlp.gate_up_proj.weight" not in spec
    hf_state = reference(toy_dirs[0]).state_dict()
    assert set(spec) == set(hf_state)
    packed = dict(model.named_parameters())["model.layers.0.mlp.gate_up_proj.weight"]
    assert torch.equal(packed, torch.cat([hf_state["model.layers.0.mlp.gate_proj.weight"],
                                          hf_state["model.layers.0.mlp.up_proj.weight"]]))


def test_a_full_update_by_hugging_face_names_equals_a_fresh_engine(toy_dirs):
    llm = LLM(str(toy_dirs[0]))
    llm.update_weights(reference(toy_dirs[1]).named_parameters())
    assert greedy(llm) == greedy(LLM(str(toy_dirs[1])))


def test_a_partial_update_of_one_part_leaves_the_other_part(toy_dirs):
    llm = LLM(str(toy_dirs[0]))
    packed = dict(llm.engine.runner.model.named_parameters())[
        "model.layers.1.mlp.gate_up_proj.weight"]
    before = packed.detach().clone()
    new_up = torch.randn(SMALL["intermediate_size"], SMALL["hidden_size"])
    llm.update_weights([("model.layers.1.mlp.up_proj.weight", new_up)], full=False)
    assert torch.equal(packed[:SMALL["intermediate_size"]], before[:SMALL["intermediate_size"]])
    assert torch.equal(packed[SMALL["intermediate_size"]:], new_up)


def test_an_alias_of_a_packed_part_is_refused_and_the_engine_keeps_serving(toy_dirs):
    llm = LLM(str(toy_dirs[0]), exact_logprobs=False)  # exact ones refuse any alias
    before = greedy(llm)
    tensors = dict(reference(toy_dirs[1]).named_parameters())
    with pytest.raises(WeightUpdateError, match="stacks it in .*gate_up_proj.*by copy"):
        with torch.no_grad():
            llm.update_weights(tensors.items(), alias=True)
    assert greedy(llm) == before


def test_a_run_time_adapter_on_the_packed_layer_equals_its_merge(toy_dirs):
    generator = torch.Generator().manual_seed(2)
    shape = {"gate_proj": (SMALL["intermediate_size"], SMALL["hidden_size"]),
             "up_proj": (SMALL["intermediate_size"], SMALL["hidden_size"])}
    factors = {f"model.layers.0.mlp.{name}.weight": (
        torch.randn(3, cols, generator=generator) * 0.1,
        torch.randn(rows, 3, generator=generator) * 0.1, 0.5) for name, (rows, cols) in
        shape.items()}
    assert_runtime_lora_equals_its_merge(toy_dirs[0], factors)


def assert_runtime_lora_equals_its_merge(folder, factors: dict, prompts=PROMPTS) -> None:
    """Run-time adapter ``factors`` (A, B, scale by weight name) score ``prompts`` as an
    engine whose weights had ``W + scale B A`` copied in (within 1e-4)."""
    runtime = LLM(str(folder))
    runtime.engine.commit_lora(factors, 1, 1)
    merged = LLM(str(folder))
    weights = merged.engine.weight_parameters()
    merged.update_weights([(name, weights[name] + scale * b @ a)
                           for name, (a, b, scale) in factors.items()], full=False)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    ours, theirs = (llm.generate(prompts, params, use_tqdm=False) for llm in (runtime, merged))
    for a, b in zip(ours, theirs, strict=True):
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert abs(next(iter(x.values())) - next(iter(y.values()))) < 1e-4


def test_tensor_parallel_workers_run_the_family_registered_here(toy_dirs):
    llm = LLM(str(toy_dirs[0]), tensor_parallel_size=2)
    hf_model = reference(toy_dirs[0])
    assert greedy(llm) == [hf_greedy(hf_model, prompt, 12) for prompt in PROMPTS]
    llm.update_weights(reference(toy_dirs[1]).named_parameters())
    assert greedy(llm) == greedy(LLM(str(toy_dirs[1])))


class VariantLlama(GeluLlamaForCausalLM):
    batch_invariant = False  # a family whose layers do not keep a row's bits yet


def test_exact_log_probs_resolve_off_for_a_family_not_batch_invariant(toy_dirs, tmp_path):
    for file in toy_dirs[0].iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["Variant"]}))
    register_model("Variant", VariantLlama)
    assert LLM(str(toy_dirs[0])).engine.runner.exact_logprobs
    assert not LLM(str(tmp_path)).engine.runner.exact_logprobs
    with pytest.raises(ValueError, match="exact_logprobs=True is not built yet"):
        LLM(str(tmp_path), exact_logprobs=True)


def test_registration_takes_a_causal_lm_and_an_unknown_architecture_names_them():
    with pytest.raises(TypeError, match="CausalLM subclass"):
        register_model("Nope", nn.Linear)
    config = LlamaConfig(architectures=["UnknownForCausalLM"])
    with pytest.raises(ValueError, match=f"unsupported architecture.*{ARCHITECTURE}"):
        model_class(config)
    assert issubclass(model_class(LlamaConfig(architectures=[ARCHITECTURE],
                                              hidden_act="gelu_pytorch_tanh")), CausalLM)
