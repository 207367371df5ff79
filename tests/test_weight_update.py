"""Weight updates in-process: equal to a fresh engine, atomic on faults, cache-safe, sleep."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.rollout import LLM, EngineAsleepError, LLMEngine, SamplingParams, WeightUpdateError
from tandem.rollout.config import EngineConfig
from tandem.sync.protocol import check_finite

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
PROMPTS = [[5, 9, 33, 70, 2, 81, 100, 4, 17, 3, 44, 12, 200, 7, 8, 9, 10, 11, 12, 13, 14, 15],
           [40, 41, 42]]


def trainer_model(folder, seed: int):
    """The trainer's copy of the model, moved away from the checkpoint by seeded noise."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return model


def completions(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def fresh_completions(model, folder, path) -> list[list[int]]:
    """Greedy completions of a fresh engine loaded from ``model`` saved with folder's tokenizer."""
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((folder / name).read_bytes())
    return completions(LLM(str(path)))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_full_update_equals_fresh_engine_from_saved_weights(model_dir, tmp_path, kind):
    folder = model_dir(kind)
    llm = LLM(str(folder))
    before = completions(llm)
    trainer = trainer_model(folder, seed=1)
    version = llm.update_weights(trainer.state_dict().items())
    assert version == 1 and llm.stats()["weight_version"] == 1
    after = completions(llm)
    assert after != before
    assert after == fresh_completions(trainer, folder, tmp_path)


def test_ten_updates_without_restart_with_wrapped_names(llama_dir, tmp_path):
    llm = LLM(str(llama_dir))
    trainer = trainer_model(llama_dir, seed=2)
    for step in range(10):
        with torch.no_grad():
            for param in trainer.parameters():
                param.mul_(1.0 + 0.01 * step)
        named = [(f"module.base_model.model.{n}", t) for n, t in trainer.state_dict().items()]
        with llm.weight_update() as update:
            update.load(named[:5])
            update.load(named[5:])
        completions(llm)
    assert llm.stats()["weight_version"] == 10
    assert completions(llm) == fresh_completions(trainer, llama_dir, tmp_path)


def faulty_updates(state: dict[str, torch.Tensor]):
    name = "model.layers.0.mlp.up_proj.weight"
    yield "unknown weight", {**state, "model.layers.0.extra.weight": state[name]}
    yield "has shape", {**state, name: state[name][:, :-1]}
    yield "NaN", {**state, name: state[name].clone().fill_(float("nan"))}
    yield "lacks 1 parameters", {k: v for k, v in state.items() if k != name}
    yield "dtype", {**state, name: state[name].long()}


def test_each_fault_leaves_previous_weights_serving(llama_dir):
    llm = LLM(str(llama_dir))
    before = completions(llm)
    state = trainer_model(llama_dir, seed=3).state_dict()
    for message, tensors in faulty_updates(state):
        with pytest.raises(WeightUpdateError, match=message):
            llm.update_weights(tensors.items())
        assert llm.stats()["weight_version"] == 0
    with pytest.raises(RuntimeError, match="trainer died"):
        with llm.weight_update() as update:
            update.load(list(state.items())[:3])
            raise RuntimeError("trainer died")
    assert completions(llm) == before
    with pytest.raises(ValueError, match="not above"):
        llm.update_weights(state.items(), version=0)


def test_prefix_cache_never_serves_kv_of_older_weights(llama_dir, tmp_path):
    llm = LLM(str(llama_dir))
    completions(llm)
    hits = llm.stats()["prefix_cache_hit_tokens"]
    completions(llm)
    assert llm.stats()["prefix_cache_hit_tokens"] > hits
    trainer = trainer_model(llama_dir, seed=4)
    llm.update_weights(trainer.state_dict().items())
    hits = llm.stats()["prefix_cache_hit_tokens"]
    after = completions(llm)
    assert llm.stats()["prefix_cache_hit_tokens"] == hits
    assert after == fresh_completions(trainer, llama_dir, tmp_path)


def test_alias_serves_the_trainers_tensors_as_they_change(llama_dir):
    llm = LLM(str(llama_dir))
    trainer = trainer_model(llama_dir, seed=5)
    reference = LLM(str(llama_dir))
    llm.update_weights(trainer.state_dict().items(), alias=True)
    with torch.no_grad():
        for param in trainer.parameters():
            param.mul_(1.1)
    assert llm.update_weights(trainer.state_dict().items(), alias=True) == 2
    reference.update_weights(trainer.state_dict().items())
    assert completions(llm) == completions(reference)
    half = {k: v.half() for k, v in trainer.state_dict().items()}
    with pytest.raises(WeightUpdateError, match="cannot alias"):
        llm.update_weights(half.items(), alias=True)


def test_request_straddling_an_update_records_both_versions(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir)))
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True))
    engine.step()
    engine.step()
    engine.update_weights(trainer_model(llama_dir, seed=6).state_dict().items())
    finished = []
    while engine.has_unfinished_requests():
        finished += engine.step()
    assert finished[0].outputs[0].weight_versions == (0, 1)
    assert finished[0].outputs[0].token_weight_versions == [0, 0, 1, 1, 1, 1]
    assert finished[0].weight_version == 1


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_pool_and_wake_restores_same_output(llama_dir, level):
    llm = LLM(str(llama_dir))
    before = completions(llm)
    pool_bytes = llm.stats()["kv_cache_bytes"]
    assert pool_bytes > 0
    llm.sleep(level)
    assert llm.stats()["kv_cache_bytes"] == 0 and llm.stats()["sleep_level"] == level
    with pytest.raises(EngineAsleepError, match="wake_up"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up(["weights"])
    assert llm.stats()["sleep_level"] == level and llm.stats()["kv_cache_bytes"] == 0
    with pytest.raises(ValueError, match="unknown wake_up tags"):
        llm.wake_up(["optimizer"])
    llm.wake_up(["kv_cache"])
    assert llm.stats()["sleep_level"] == 0
    assert llm.stats()["kv_cache_bytes"] == pool_bytes and llm.stats()["kv_blocks_used"] == 0
    assert completions(llm) == before


def test_update_while_asleep_applies(llama_dir, tmp_path):
    llm = LLM(str(llama_dir))
    trainer = trainer_model(llama_dir, seed=7)
    llm.sleep(2)
    llm.update_weights(trainer.state_dict().items())
    llm.wake_up()
    assert completions(llm) == fresh_completions(trainer, llama_dir, tmp_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_finite_check_refuses_every_non_finite_value_and_no_finite_one(dtype):
    big = torch.finfo(dtype).max
    check_finite("w", torch.full((4, 3), big, dtype=dtype))  # its sum overflows: still finite
    check_finite("w", torch.tensor([big, -big, 1.0], dtype=dtype))
    for bad in (float("nan"), float("inf"), float("-inf")):
        tensor = torch.randn(64, dtype=torch.float32).to(dtype)
        tensor[37] = bad
        with pytest.raises(WeightUpdateError, match="NaN or infinite"):
            check_finite("w", tensor)
    with pytest.raises(WeightUpdateError):  # infinities of both signs sum to NaN, not 0
        check_finite("w", torch.tensor([float("inf"), float("-inf")], dtype=dtype))
