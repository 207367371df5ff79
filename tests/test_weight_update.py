"""Weight updates in-process: equal to a fresh engine, atomic on faults, cache-safe, sleep."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.rollout import LLM, EngineAsleepError, LLMEngine, SamplingParams, WeightUpdateError
from tandem.rollout.config import EngineConfig
from tandem.rollout.worker.weight_offload import OffloadableWeights
from tandem.sync.protocol import check_all_finite, check_finite

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
    llm = LLM(str(llama_dir), exact_logprobs=False)
    trainer = trainer_model(llama_dir, seed=5)
    reference = LLM(str(llama_dir), exact_logprobs=False)
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


def test_an_exact_engine_refuses_alias_updates_and_keeps_serving(llama_dir):
    llm = LLM(str(llama_dir))
    before = completions(llm)
    trainer = trainer_model(llama_dir, seed=5)
    with pytest.raises(ValueError, match="exact_logprobs=False to alias"):
        llm.update_weights(trainer.state_dict().items(), alias=True)
    assert llm.weight_version == 0 and completions(llm) == before


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


SEEDED = SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)


def outputs(llm: LLM) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy and seeded-sampling completions of ``PROMPTS``."""
    return completions(llm), [o.outputs[0].token_ids
                              for o in llm.generate(PROMPTS, SEEDED, use_tqdm=False)]


def with_weight_region(llm: LLM) -> LLM:
    """Move the engine's weights into one releasable region, as a CUDA engine's are at load,
    and record the addresses the decode graphs are captured over (on CPU, all a capture
    does)."""
    runner = llm.engine.runner
    runner.offloadable_weights = OffloadableWeights(runner.model, runner.device)
    runner.capture_graphs()
    return llm


def captures_of(llm: LLM, monkeypatch) -> list[None]:
    """One entry per decode-graph capture from now on (the engine still captures)."""
    calls, capture = [], llm.engine.runner.capture_graphs

    def spy() -> None:
        calls.append(None)
        capture()

    monkeypatch.setattr(llm.engine.runner, "capture_graphs", spy)
    return calls


def weight_addresses(llm: LLM) -> list[int]:
    return [param.data_ptr() for param in llm.engine.runner.model.parameters()]


def fall_asleep(llm: LLM, how: str) -> None:
    """``sleep(1)``, ``sleep(2)`` or ``release_kv_cache_memory()``, by name."""
    if how == "kv cache only":
        llm.release_kv_cache_memory()
    else:
        llm.sleep(int(how[-1]))


@pytest.mark.parametrize("weight_region", [False, True])
@pytest.mark.parametrize("how", ["kv cache only", "level 1", "level 2"])
def test_sleep_frees_pool_and_wake_restores_same_output(llama_dir, monkeypatch, how,
                                                        weight_region):
    llm = LLM(str(llama_dir), num_kv_blocks=64)
    if weight_region:
        with_weight_region(llm)
    runner = llm.engine.runner
    before = outputs(llm)
    kept = {name: t.clone() for name, t in llm.engine.weight_parameters().items()}
    pool_bytes, pool_address = llm.stats()["kv_cache_bytes"], runner.kv_cache.data_ptr()
    weights = weight_addresses(llm)
    assert pool_bytes > 0 and runner.kv_cache.count_nonzero() > 0
    captures = captures_of(llm, monkeypatch)
    fall_asleep(llm, how)
    level = {"kv cache only": 0, "level 1": 1, "level 2": 2}[how]
    assert llm.stats()["kv_cache_bytes"] == 0 and llm.stats()["sleep_level"] == level
    assert llm.is_sleeping and runner.kv_region.released
    assert weight_region == (runner.offloadable_weights is not None)
    if weight_region:  # the weights leave the device (level 1 in a copy) but for the KV only
        assert runner.offloadable_weights.offloaded == (level > 0)
        assert runner.offloadable_weights.discarded == (level == 2)
    with pytest.raises(EngineAsleepError, match="wake_up"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up(["weights"])
    assert llm.is_sleeping and llm.stats()["kv_cache_bytes"] == 0
    with pytest.raises(ValueError, match="unknown wake_up tags"):
        llm.wake_up(["optimizer"])
    llm.wake_up(["kv_cache"])
    stats = llm.stats()
    assert stats["sleep_level"] == 0 and not llm.is_sleeping
    assert stats["kv_cache_bytes"] == pool_bytes and stats["kv_blocks_used"] == 0
    # The pool and weights are back at their addresses, the pool zeroed: no capture is due.
    assert runner.kv_cache.data_ptr() == pool_address and not runner.kv_cache.count_nonzero()
    assert weight_addresses(llm) == weights and not captures
    assert stats["wake_seconds"] >= stats["wake_weights_seconds"] + \
        stats["wake_kv_cache_seconds"] + stats["wake_capture_seconds"]
    assert stats["sleep_seconds"] >= stats["sleep_kv_cache_seconds"] + \
        stats["sleep_weights_seconds"] > 0
    if level == 2:  # discarded (in a region, zeroed): the next full update brings them back
        with pytest.raises(EngineAsleepError, match="discarded by sleep"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        llm.update_weights(kept.items())
    assert outputs(llm) == before == outputs(LLM(str(llama_dir), num_kv_blocks=64))


@pytest.mark.parametrize("weight_region", [False, True])
def test_discarded_weights_take_only_a_full_update_once_awake(llama_dir, tmp_path,
                                                               weight_region):
    llm = LLM(str(llama_dir))
    if weight_region:
        with_weight_region(llm)
    trainer = trainer_model(llama_dir, seed=7)
    tensors = dict(trainer.state_dict())
    llm.sleep(2)
    with pytest.raises(EngineAsleepError, match=r"wake_up\(tags=\['weights'\]\)"):
        llm.update_weights(tensors.items())  # their memory is not there yet
    llm.wake_up(["weights"])
    name = "model.layers.0.self_attn.q_proj.weight"
    llm.update_weights([(name, tensors[name])], full=False)  # a part leaves the rest stale
    with pytest.raises(EngineAsleepError, match="full"):
        llm.engine.full_weight(name)  # what a LoRA merge starts from
    llm.wake_up()
    with pytest.raises(EngineAsleepError, match="discarded by sleep"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.update_weights(tensors.items()) == 2
    assert completions(llm) == fresh_completions(trainer, llama_dir, tmp_path)


def test_an_adapter_served_from_a_sleep_is_captured_on_wake(llama_dir, monkeypatch):
    llm = LLM(str(llama_dir))
    name, layer = next(iter(llm.engine.runner.lora_layers().items()))
    generator = torch.Generator().manual_seed(3)
    factors = {name: (torch.randn(2, layer.in_features, generator=generator),
                      torch.randn(layer.out_features, 2, generator=generator), 0.5)}
    captures = captures_of(llm, monkeypatch)
    llm.sleep(1)
    llm.engine.commit_lora(factors, 1, 1)
    assert not captures
    llm.wake_up()
    assert len(captures) == 1  # the adapter changed the captured code path


@pytest.mark.parametrize("weight_region", [False, True])
@pytest.mark.parametrize("alias", [False, True])
def test_update_while_asleep_applies(llama_dir, tmp_path, monkeypatch, alias, weight_region):
    llm = LLM(str(llama_dir), exact_logprobs=not alias)
    if weight_region:
        with_weight_region(llm)
    trainer = trainer_model(llama_dir, seed=7)
    captures = captures_of(llm, monkeypatch)
    llm.sleep(1)  # the weights offloaded: the update lands in their host copy
    llm.update_weights(trainer.state_dict().items(), alias=alias)
    llm.wake_up()
    # Adopted tensors moved the weights (ending their region): only then a capture is due.
    assert len(captures) == alias
    assert (llm.engine.runner.offloadable_weights is not None) == (weight_region and not alias)
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


def staged_by_commit(llm: LLM, monkeypatch) -> dict[str, torch.Tensor]:
    """Every tensor the engine's next commits receive, by name (the engine still commits)."""
    staged, commit = {}, llm.engine.commit_weights

    def spy(tensors: dict[str, torch.Tensor], version: int, alias: bool) -> None:
        staged.update(tensors)
        commit(tensors, version, alias)

    monkeypatch.setattr(llm.engine, "commit_weights", spy)
    return staged


def engine_weights(llm: LLM) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in llm.engine.weight_parameters().items()}


def served_state(llm: LLM, folder, seed: int) -> dict[str, torch.Tensor]:
    """The trainer's weights already in the engine's dtype on its device (the fast path)."""
    parameters = llm.engine.weight_parameters()
    return {name: tensor.to(parameters[name].device, parameters[name].dtype)
            for name, tensor in trainer_model(folder, seed).state_dict().items()}


@pytest.mark.parametrize("given", ["list", "items", "generator"])
def test_a_list_is_committed_without_a_staging_copy_and_a_generator_with_one(
        llama_dir, monkeypatch, given):
    llm = LLM(str(llama_dir))
    parameters = llm.engine.weight_parameters()
    addresses = {name: param.data_ptr() for name, param in parameters.items()}
    state = served_state(llm, llama_dir, seed=8)
    staged = staged_by_commit(llm, monkeypatch)
    named = {"list": list(state.items()), "items": state.items(),
             "generator": ((name, tensor) for name, tensor in state.items())}[given]
    llm.update_weights(named)
    shared = {name for name, tensor in staged.items()
              if tensor.untyped_storage().data_ptr() == state[name].untyped_storage().data_ptr()}
    assert shared == (set() if given == "generator" else set(parameters))
    for name, param in parameters.items():
        assert param.data_ptr() == addresses[name]  # copied in place: graphs stay valid
        assert torch.equal(param, state[name])
    committed = engine_weights(llm)
    with torch.no_grad():
        for tensor in state.values():
            tensor.mul_(2.0)  # the trainer steps on: the engine serves what it committed
    assert all(torch.equal(param, committed[name]) for name, param in parameters.items())


@pytest.mark.parametrize("copy", [True, False])
def test_one_non_finite_tensor_among_many_refuses_all_and_keeps_every_weight(llama_dir, copy):
    llm = LLM(str(llama_dir))
    before = engine_weights(llm)
    state = served_state(llm, llama_dir, seed=9)
    names = list(state)
    for name, bad in ((names[len(names) // 2], float("nan")), (names[-1], float("-inf"))):
        tensors = dict(state)
        tensors[name] = state[name].clone()
        tensors[name].view(-1)[-1] = bad
        with pytest.raises(WeightUpdateError, match=f"weight '{name}' holds NaN or infinite"):
            with llm.weight_update(copy=copy) as update:
                update.load(list(tensors.items())[:3])
                update.load(list(tensors.items())[3:])
        assert llm.weight_version == 0
        after = engine_weights(llm)
        assert all(torch.equal(after[name], before[name]) for name in before)


def test_finiteness_is_checked_in_the_engines_dtype(llama_dir):
    llm = LLM(str(llama_dir), dtype="bfloat16")
    before = engine_weights(llm)
    state = trainer_model(llama_dir, seed=10).state_dict()
    name = "model.layers.1.self_attn.o_proj.weight"
    state[name][0, 0] = torch.finfo(torch.float32).max  # finite in float32, inf in bfloat16
    with pytest.raises(WeightUpdateError, match=f"weight '{name}' holds NaN or infinite"):
        llm.update_weights(state.items())
    after = engine_weights(llm)
    assert all(torch.equal(after[name], before[name]) for name in before)


def host_reads_of_an_update(llm: LLM, named: list, monkeypatch) -> int:
    """How often an update of ``named`` reads a tensor's value back to Python (on a GPU,
    each one waits for the device)."""
    reads = []
    for method in ("__bool__", "__float__", "item", "tolist"):
        original = getattr(torch.Tensor, method)

        def counted(tensor, *args, original=original):
            reads.append(original)
            return original(tensor, *args)

        monkeypatch.setattr(torch.Tensor, method, counted)
    llm.update_weights(named, full=False)
    monkeypatch.undo()
    return len(reads)


def test_host_reads_do_not_grow_with_the_number_of_tensors(llama_dir, monkeypatch):
    llm = LLM(str(llama_dir))
    state = list(served_state(llm, llama_dir, seed=11).items())
    one = host_reads_of_an_update(llm, state[:1], monkeypatch)
    every = host_reads_of_an_update(llm, state, monkeypatch)
    assert len(state) > 10 and every == one == 1


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_one_non_finite_value_anywhere_among_many_tensors_is_named(device, dtype):
    generator = torch.Generator().manual_seed(12)
    sizes = [1, 7, 65535, 65536, 65537, 300_001] * 4  # around the foreach kernels' chunks
    tensors = [(f"w{i}", torch.randn(size, generator=generator).to(device, dtype))
               for i, size in enumerate(sizes)]
    check_all_finite(tensors)
    for bad in (float("nan"), float("inf"), float("-inf")):
        index = int(torch.randint(len(sizes), (1,), generator=generator))
        name, tensor = tensors[index]
        spoiled = tensor.clone()
        spoiled[int(torch.randint(tensor.numel(), (1,), generator=generator))] = bad
        with pytest.raises(WeightUpdateError, match=f"weight '{name}' holds NaN or infinite"):
            check_all_finite([*tensors[:index], (name, spoiled), *tensors[index + 1:]])
