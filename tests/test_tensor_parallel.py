"""Tensor parallelism on CPU with gloo (the driver and one worker process, one thread each):
TP=2 equals TP=1 in prompt log-probs, greedy tokens and sampled log-probs, on a tiny Llama
(GQA, 2 KV heads split) and a tiny Qwen3 with one KV head (replicated), tied embeddings and a
vocabulary that does not split evenly; bad sizes are refused at start; a dead worker is
reported."""

from __future__ import annotations

import os
import signal
import time
from contextlib import nullcontext

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from tandem.kernels import check_sharded, select_kernels
from tandem.rollout import LLM, Continuation, SamplingParams
from tandem.rollout.parallel import wire
from tandem.rollout.parallel.executor import TensorParallelError
from tandem.rollout.parallel.tensor_parallel import check_tensor_parallel, rank_device
from tandem.sync import LoraSync, WeightUpdateError, peft_adapter_state
from tandem.trainers.config import (
    LoggingConfig,
    OptimConfig,
    PartialRolloutConfig,
    RolloutConfig,
    TrainConfig,
)
from tandem.trainers.tasks import Task
from tandem.trainers.trainer import Trainer

from .conftest import SMALL, build_tokenizer
from .test_distributed import two_rank_run
from .test_lora import hf_model, lora_model
from .test_server import MODEL, openai_client, running_server
from .test_weight_update import trainer_model

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 60))]
OPTIONS = dict(num_kv_blocks=64, max_model_len=128, seed=7)


@pytest.fixture(scope="module")
def one_kv_head_dir(tmp_path_factory):
    """A tiny Qwen3 with one KV head, tied embeddings and an odd vocabulary."""
    path = tmp_path_factory.mktemp("qwen3_one_kv")
    tokenizer = build_tokenizer()
    torch.manual_seed(1)
    config = Qwen3Config(vocab_size=len(tokenizer) + 3, head_dim=32, tie_word_embeddings=True,
                         **{**SMALL, "num_key_value_heads": 1})
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def outputs(folder, tp: int) -> tuple[list, list]:
    llm = LLM(str(folder), tensor_parallel_size=tp, **OPTIONS)
    scored = llm.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0,
                                                  prompt_logprobs=8), use_tqdm=False)
    greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                          use_tqdm=False)
    sampled = llm.generate(PROMPTS, SamplingParams(n=4, max_tokens=12, seed=3, logprobs=0,
                                                   ignore_eos=True), use_tqdm=False)
    assert llm.stats()["kv_blocks_used"] == 0
    return [o.prompt_logprobs for o in scored], [
        [c.token_ids for c in o.outputs] for o in greedy + sampled], [
        c.logprobs for o in sampled for c in o.outputs]


@pytest.mark.parametrize("kind", ["llama", "one_kv_head"])
def test_tp2_equals_tp1(kind, model_dir, one_kv_head_dir):
    folder = model_dir("llama") if kind == "llama" else one_kv_head_dir
    scored_1, tokens_1, logprobs_1 = outputs(folder, 1)
    scored_2, tokens_2, logprobs_2 = outputs(folder, 2)
    assert tokens_2 == tokens_1  # greedy and seeded sampled tokens, groups (n=4) included
    for prompt_1, prompt_2 in zip(scored_1, scored_2, strict=True):
        for position_1, position_2 in zip(prompt_1[1:], prompt_2[1:], strict=True):
            assert position_1.keys() == position_2.keys()
            for token, logprob in position_1.items():
                assert abs(position_2[token] - logprob) < 1e-4
    for row_1, row_2 in zip(logprobs_1, logprobs_2, strict=True):
        assert max(abs(a - b) for a, b in zip(row_1, row_2, strict=True)) < 1e-4


def test_tp2_splits_the_kv_pool_by_head(model_dir):
    llm = LLM(str(model_dir("llama")), tensor_parallel_size=2, kv_cache_memory_bytes=1 << 20,
              max_model_len=128)
    single = LLM(str(model_dir("llama")), kv_cache_memory_bytes=1 << 20, max_model_len=128)
    # Each rank holds one of the two KV heads: twice the blocks in the same bytes per rank.
    assert llm.engine.num_kv_blocks == 2 * single.engine.num_kv_blocks


@pytest.mark.parametrize("options, match", [
    (dict(tensor_parallel_size=2), "exceeds the 1 CPU cores"),
    (dict(tensor_parallel_size=3), "does not divide the model's 4 attention heads"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size=0 is invalid"),
])
def test_a_size_the_machine_or_model_cannot_run_is_refused_at_start(model_dir, options, match,
                                                                    monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    with pytest.raises(ValueError, match=match):
        LLM(str(model_dir("llama")), **options, **OPTIONS)


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_an_fp8_pool_under_tp_equals_tp1_each_rank_holding_its_heads_scales(model_dir):
    folder = str(model_dir("llama"))
    single = LLM(folder, kv_cache_dtype="fp8", **OPTIONS)
    llm = LLM(folder, kv_cache_dtype="fp8", tensor_parallel_size=2, **OPTIONS)
    assert single.engine.runner.kv_scales.shape == (2, 2, 2)  # K and V, layers, KV heads
    assert llm.engine.runner.kv_scales.shape == (2, 2, 1)  # the driver's one KV head
    assert greedy(llm) == greedy(single)


@pytest.mark.parametrize("kind", ["llama", "one_kv_head"])
def test_a_full_update_under_tp_equals_a_fresh_tp_engine(kind, model_dir, one_kv_head_dir,
                                                         tmp_path):
    folder = model_dir("llama") if kind == "llama" else one_kv_head_dir
    llm = LLM(str(folder), tensor_parallel_size=2, **OPTIONS)
    before = greedy(llm)
    trainer = trainer_model(folder, seed=3)
    assert llm.update_weights(trainer.state_dict().items()) == 1
    after = greedy(llm)
    assert after != before
    trainer.save_pretrained(tmp_path)
    build_tokenizer().save_pretrained(tmp_path)
    assert after == greedy(LLM(str(tmp_path), tensor_parallel_size=2, **OPTIONS))


def test_a_quantized_tp_engine_quantizes_each_ranks_slices_at_load_and_update(model_dir,
                                                                            tmp_path):
    # Each rank quantizes its own slices (a row-split projection's scales are of its half of
    # the inputs), at load and in the commit alike: an update equals a fresh engine.
    folder = model_dir("llama")
    llm = LLM(str(folder), tensor_parallel_size=2, quantization="int8", **OPTIONS)
    single = LLM(str(folder), quantization="int8", **OPTIONS)
    assert greedy(llm) == greedy(single)
    trainer = trainer_model(folder, seed=4)
    assert llm.update_weights(trainer.state_dict().items()) == 1
    trainer.save_pretrained(tmp_path)
    build_tokenizer().save_pretrained(tmp_path)
    assert greedy(llm) == greedy(LLM(str(tmp_path), tensor_parallel_size=2,
                                     quantization="int8", **OPTIONS))


def test_a_slice_one_rank_refuses_is_applied_on_no_rank(model_dir):
    llm = LLM(str(model_dir("llama")), tensor_parallel_size=2, **OPTIONS)
    before = greedy(llm)
    weight = llm.engine.runner.model.model.layers[0].mlp.gate_proj.weight
    full = torch.randn(weight.shape[0] * 2, weight.shape[1])
    full[-1, 0] = float("nan")  # in rank 1's rows only: rank 0's slice is fine
    name = "model.layers.0.mlp.gate_proj.weight"
    with pytest.raises(WeightUpdateError, match=r"rank\(s\) \[1\] refused"):
        llm.engine.commit_weights({name: full}, 1, alias=False)
    assert greedy(llm) == before and llm.weight_version == 0
    with pytest.raises(WeightUpdateError, match="NaN"):  # the usual path refuses it at load
        llm.update_weights([(name, full)], full=False)


@pytest.mark.parametrize("mode", ["runtime", "merge"])
@pytest.mark.parametrize("kind", ["llama", "one_kv_head"])
def test_a_lora_adapter_under_tp_equals_tp1(kind, mode, model_dir, one_kv_head_dir):
    folder = model_dir("llama") if kind == "llama" else one_kv_head_dir
    tensors, spec = peft_adapter_state(lora_model(hf_model(folder), seed=3))
    results = {}
    for size in (1, 2):
        llm = LLM(str(folder), tensor_parallel_size=size, **OPTIONS)
        before = greedy(llm)
        sync = LoraSync(llm, mode=mode)
        assert sync.update(tensors, spec) == 1
        results[size] = (before, greedy(llm), llm.generate(
            PROMPTS, SamplingParams(max_tokens=8, logprobs=0, seed=5), use_tqdm=False))
        sync.update({}, spec)  # removing the adapter serves the base weights again
        assert greedy(llm) == before
        if mode == "merge" and size == 2:  # the kept bases are the gathered full weights
            base = hf_model(folder).state_dict()
            for name in sync.bases:
                torch.testing.assert_close(sync.bases[name], base[name], rtol=0, atol=0)
    (before_1, adapted_1, sampled_1), (before_2, adapted_2, sampled_2) = results[1], results[2]
    assert before_2 == before_1 and adapted_2 == adapted_1 != before_1
    for one, two in zip(sampled_1, sampled_2, strict=True):
        assert one.outputs[0].token_ids == two.outputs[0].token_ids
        assert max(abs(a - b) for a, b in zip(one.outputs[0].logprobs,
                                              two.outputs[0].logprobs)) < 1e-4


def test_a_killed_worker_is_reported_not_waited_for(model_dir):
    llm = LLM(str(model_dir("llama")), tensor_parallel_size=2, **OPTIONS)
    worker = llm.engine.runner.workers.processes[0]
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait(10)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="worker rank 1 exited"):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert time.monotonic() - start < 10


def test_sleep_and_wake_act_on_every_rank(model_dir):
    llm = LLM(str(model_dir("llama")), tensor_parallel_size=2, **OPTIONS)
    before = greedy(llm)
    kept = AutoModelForCausalLM.from_pretrained(model_dir("llama"), dtype=torch.float32)
    llm.sleep(1)  # frees every rank's pool and moves its weights to CPU (already there)
    llm.wake_up()
    assert greedy(llm) == before and llm.engine.runner.kv_cache_bytes() > 0
    llm.sleep(2)  # discards every rank's weights: a full update brings them back
    llm.wake_up()
    llm.update_weights(kept.named_parameters())
    assert greedy(llm) == before


def test_a_hung_worker_is_reported_within_the_timeout(model_dir, monkeypatch):
    # Short, but long enough for the group to form on a loaded machine.
    monkeypatch.setenv("TANDEM_TP_TIMEOUT", "10")
    llm = LLM(str(model_dir("llama")), tensor_parallel_size=2, **OPTIONS)
    worker = llm.engine.runner.workers.processes[0]
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="did not answer within 10 s"):
            llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2), use_tqdm=False)
        assert time.monotonic() - start < 60
    finally:
        os.kill(worker.pid, signal.SIGKILL)


def test_sync_alias_with_tp_is_refused_at_start():
    with pytest.raises(ValueError, match="sync_alias with rollout.engine.tensor_parallel_size"):
        TrainConfig(model="x", sync_alias=True,
                    rollout=RolloutConfig(engine={"tensor_parallel_size": 2}))


def test_tandem_serve_with_tp_answers_the_openai_client(model_dir):
    with running_server(model_dir("llama"), dict(tensor_parallel_size=2, **OPTIONS)) as (url, _):
        client = openai_client(url)
        completion = client.completions.create(model=MODEL, prompt="What is 2+3?",
                                               max_tokens=5, temperature=0)
        assert completion.choices[0].finish_reason in ("length", "stop")
        offline = LLM(str(model_dir("llama")), **OPTIONS).generate(
            ["What is 2+3?"], SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)
        assert completion.choices[0].text == offline[0].outputs[0].text


@pytest.mark.parametrize("partial", [False, True])
def test_the_native_trainer_runs_a_tp_engine(model_dir, tmp_path, partial):
    task = Task(lambda seed, index: {"prompt": f"Count {index}: one two"}, [],
                {"length": lambda completion_ids, **_: [float(len(i)) for i in completion_ids]},
                [("length", 1.0)])
    config = TrainConfig(
        model=str(model_dir("llama")), steps=2, output_dir=str(tmp_path),
        rollout=RolloutConfig(prompts_per_step=2, num_generations=4, max_tokens=8,
                              engine={"num_kv_blocks": 64, "tensor_parallel_size": 2},
                              partial=PartialRolloutConfig(enabled=partial, over_provision=2)),
        optim=OptimConfig(lr=1e-3), logging=LoggingConfig(wandb=False, progress_bar=False))
    trainer = Trainer(config, task=task)
    for step in (1, 2):
        metrics = trainer.train_step()
        assert metrics["weight_version"] == step
        if not partial:  # the second step samples from the weights the first pushed
            assert metrics["sampler_logprob_diff_max"] < 1e-4
    if partial:  # groups paused with their KV on both ranks went on under the new weights
        assert trainer.partial is not None and metrics["staleness_0"] < 1.0


def test_a_worker_that_fails_to_start_is_reported_at_once(model_dir, monkeypatch):
    monkeypatch.setattr("sys.executable", "/bin/false")  # a worker that exits at once
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="worker rank 1 exited with code 1"):
        LLM(str(model_dir("llama")), tensor_parallel_size=2, **OPTIONS)
    assert time.monotonic() - start < 10


def test_torchrun_ranks_share_a_tp_engine_and_each_update_reaches_every_slice(llama_dir,
                                                                              tmp_path):
    records = two_rank_run(llama_dir, tmp_path, "ddp", ", tensor_parallel_size: 2")
    assert len(records) == 2
    for step, ranks in enumerate(records, start=1):
        assert [r["version"] for r in ranks] == [step, step]
        assert all(r["shard_diff"] < 1e-6 for r in ranks)  # each slice is the trainer's
        assert ranks[0]["trainer_checksum"] == ranks[1]["trainer_checksum"]
        assert ranks[0]["shard_checksum"] != ranks[1]["shard_checksum"]  # two halves
        assert [r["fewest"] for r in ranks] == [10, 10]
    assert records[0][0]["shard_checksum"] != records[1][0]["shard_checksum"]


def test_torchrun_ranks_share_dynamic_sampling_and_partial_rollouts(llama_dir, tmp_path):
    # Every rank of the engine must admit the same extra prompts and carry the same groups,
    # or the ranks' steps (and their all-reduces) would stop pairing up.
    records = two_rank_run(llama_dir, tmp_path, "ddp", ", tensor_parallel_size: 2", (
        "rollout.dynamic_sampling={enabled: true, max_extra_prompts: 4}",
        "rollout.partial={enabled: true, over_provision: 2}"))
    assert len(records) == 2
    for step, ranks in enumerate(records, start=1):
        assert [r["version"] for r in ranks] == [step, step]
        assert all(r["shard_diff"] < 1e-6 for r in ranks)
        assert ranks[0]["groups_sampled"] > 4  # extras were admitted (a flat group each)


def test_tp_on_cuda_takes_one_device_per_rank_from_the_driver_s():
    assert rank_device(torch.device("cuda", 2), 1) == torch.device("cuda", 3)
    assert rank_device(torch.device("cuda"), 1) == torch.device("cuda", 1)
    assert rank_device(torch.device("cpu"), 1) == torch.device("cpu")


@pytest.mark.parametrize("device, spmd, match", [
    ("cuda:1", False, "exceeds the 1 CUDA devices from cuda:1"),
    ("cuda:1", True, None),  # a torchrun rank's own device: any of them
    ("cuda:0", False, None),
])
def test_tp_on_cuda_is_checked_against_the_devices(device, spmd, match, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with nullcontext() if match is None else pytest.raises(ValueError, match=match):
        check_tensor_parallel(2, LlamaConfig(**SMALL), torch.device(device), spmd)


def test_tp_on_cuda_refuses_kernels_that_do_not_shard():
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match="needs an attention backend that shards"):
        check_sharded(select_kernels("torch", cuda), cuda)
    check_sharded(select_kernels("torch", torch.device("cpu")), torch.device("cpu"))


def test_groups_prefix_hits_and_structured_outputs_under_tp(model_dir):
    results = {}
    for size in (1, 2):
        llm = LLM(str(model_dir("llama")), tensor_parallel_size=size, **OPTIONS)
        params = SamplingParams(n=4, max_tokens=8, seed=3, ignore_eos=True)
        first = llm.generate(PROMPTS, params, use_tqdm=False)
        again = llm.generate(PROMPTS, params, use_tqdm=False)  # served from the prefix cache
        stats = llm.stats()
        choice = SamplingParams(n=4, max_tokens=8, seed=3, structured_outputs={
            "choice": ["north", "south", "east"]})
        constrained = llm.generate(PROMPTS, choice, use_tqdm=False)
        results[size] = ([[c.token_ids for c in o.outputs] for o in first + again],
                         [c.text for o in constrained for c in o.outputs])
        assert stats["prefix_cache_hit_tokens"] > 0 and stats["cow_copies"] > 0
    assert results[2] == results[1]
    assert set(results[2][1]) <= {"north", "south", "east"}


def test_a_held_completion_continues_under_tp_as_at_tp1(model_dir):
    results = {}
    for size in (1, 2):
        llm = LLM(str(model_dir("llama")), tensor_parallel_size=size, **OPTIONS)
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        first = llm.generate([PROMPTS[0]], params, use_tqdm=False, hold_kv=True)[0]
        turn = llm.generate(Continuation(first.request_id, 0, [40, 41]), params,
                            use_tqdm=False)[0]
        results[size] = (first.outputs[0].token_ids, turn.outputs[0].token_ids)
    assert results[2] == results[1]


def test_overlapped_steps_under_tp_equal_tp1(model_dir):
    results = {}
    for size in (1, 2):
        llm = LLM(str(model_dir("llama")), tensor_parallel_size=size, async_scheduling=True,
                  **OPTIONS)
        greedy_params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        seeded = SamplingParams(n=4, max_tokens=12, seed=3, stop_token_ids=[40, 41])
        results[size] = [[c.token_ids for c in o.outputs] for o in llm.generate(
            PROMPTS, greedy_params, use_tqdm=False) + llm.generate(PROMPTS, seeded,
                                                                   use_tqdm=False)]
    assert results[2] == results[1]


def test_an_overlapped_step_is_sent_as_the_host_knows_it(model_dir, monkeypatch):
    # The pending token (sampled by the step before, still on the device) must not reach
    # the message: the driver would read it back from the device, waiting for that step.
    # Its row holds the token before it; the row travels as an index, the token device to
    # device over the device group.
    sent = []
    send = wire.send

    def recording(group, op, payload):
        if op == "step":
            sent.append((payload["positions"].tolist(), payload["input_ids"].tolist(),
                         payload.get("pending_rows")))
        send(group, op, payload)

    monkeypatch.setattr(wire, "send", recording)
    llm = LLM(str(model_dir("llama")), tensor_parallel_size=2, async_scheduling=True,
              **OPTIONS)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    tokens = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    stream = PROMPTS[0] + tokens
    decodes = [(positions, ids, rows) for positions, ids, rows in sent if positions[0] > 0]
    assert len(decodes) == len(tokens) - 1
    for (position,), ids, rows in decodes:
        assert ids == [stream[position - 1]] and rows == [0]
