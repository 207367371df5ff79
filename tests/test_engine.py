"""The engine's API: stops, outputs, abort, stats, and clear errors on bad input."""

from __future__ import annotations

import json
import threading

import pytest

from tandem.rollout import LLM, EngineConfig, LLMEngine, SamplingParams
from tandem.rollout.core import block_manager

from .conftest import count_tokenizations


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(str(llama_dir), num_kv_blocks=40, max_model_len=256)


def greedy(max_tokens: int = 16, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)


def assert_still_serving(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    output = llm.generate(["What is 2+3?"], greedy(4, ignore_eos=True), use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 4
    assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("prompts, match", [
    ([[]], "empty"),
    ([[5] * 300], "max_model_len"),
    ([[5] * 10, [5] * 300], "max_model_len"),
    ([[10_000]], "token ids must be"),
    ([], "no prompts"),
])
def test_bad_prompt_raises_before_anything_is_queued(llm, prompts, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, greedy(), use_tqdm=False)
    assert llm.stats()["num_waiting"] == 0
    assert_still_serving(llm)


def test_prompt_longer_than_kv_pool_is_refused(llama_dir):
    llm = LLM(str(llama_dir), num_kv_blocks=4, block_size=16, max_model_len=64)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        llm.generate([[5] * 64], greedy(), use_tqdm=False)
    assert_still_serving(llm)


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -3),
    ("min_p", 2.0), ("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("max_tokens", 0),
    ("min_tokens", 99), ("logprobs", -1), ("stop", [""]), ("stop_token_ids", [-1]),
])
def test_invalid_sampling_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        SamplingParams(**{field: value})


def test_mismatched_sampling_params_list_is_refused(llm):
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [greedy()], use_tqdm=False)
    assert_still_serving(llm)


def test_unknown_architecture_lists_supported_ones(llama_dir, tmp_path):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        (tmp_path / name).write_bytes((llama_dir / name).read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        LLM(str(tmp_path))


def test_kv_budget_too_small_names_the_fixes(llama_dir):
    with pytest.raises(ValueError, match="num_kv_blocks, kv_cache_memory_bytes or "
                                         "gpu_memory_utilization, or lower max_model_len"):
        LLM(str(llama_dir), kv_cache_memory_bytes=10_000)


def test_bad_engine_config_names_the_field():
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        EngineConfig(model="x", max_num_seqs=0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(model="x", gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="not a folder"):
        LLM("/nonexistent/model")


def test_eos_ends_token_ids_but_not_text(llm):
    eos = sorted(llm.engine.eos_token_ids)[0]
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode("What is 2+3?")
    free_run = llm.generate([prompt], greedy(8, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    stop_at = free_run.token_ids[3]
    output = llm.generate([prompt], greedy(8, stop_token_ids=[stop_at]),
                          use_tqdm=False)[0].outputs[0]
    cut = free_run.token_ids.index(stop_at) + 1
    assert output.token_ids == free_run.token_ids[:cut]
    assert output.finish_reason == "stop" and output.stop_reason == stop_at
    assert output.text == tokenizer.decode(free_run.token_ids[:cut - 1])
    assert eos not in free_run.token_ids or free_run.finish_reason == "stop"


def test_stop_string_trims_text_and_keeps_its_token(llm):
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode("The quick brown")
    free_run = llm.generate([prompt], greedy(16, ignore_eos=True), use_tqdm=False)[0]
    text = free_run.outputs[0].text
    stop = text[5:8]
    output = llm.generate([prompt], greedy(16, ignore_eos=True, stop=[stop]),
                          use_tqdm=False)[0].outputs[0]
    assert output.finish_reason == "stop" and output.stop_reason == stop
    assert output.text == text[:text.find(stop)]
    assert stop in tokenizer.decode(output.token_ids)
    assert stop not in tokenizer.decode(output.token_ids[:-1])


def test_length_finish_and_n_completions(llm):
    outputs = llm.generate(["What is 2+3?", "Seven"],
                           SamplingParams(n=3, max_tokens=5, ignore_eos=True, seed=0),
                           use_tqdm=False)
    assert [len(o.outputs) for o in outputs] == [3, 3]
    for output in outputs:
        assert [c.index for c in output.outputs] == [0, 1, 2]
        assert all(c.finish_reason == "length" and len(c.token_ids) == 5 for c in output.outputs)
        assert all(c.logprobs is None and c.weight_versions == (0, 0) for c in output.outputs)


def test_chat_applies_template(llm):
    tokenizer = llm.get_tokenizer()
    conversation = [{"role": "user", "content": "What is 2+3?"}]
    output = llm.chat(conversation, greedy(4), use_tqdm=False)[0]
    expected = tokenizer.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=True)
    assert expected.startswith("<|im_start|>user\nWhat is 2+3?")
    assert output.prompt_token_ids == tokenizer.encode(expected, add_special_tokens=False)


def test_engine_step_loop_abort_frees_blocks(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=40, max_model_len=256))
    engine.add_request("a", "What is 2+3?", greedy(50, ignore_eos=True))
    engine.add_request("b", "Seven", greedy(3, ignore_eos=True))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", "x", greedy())
    finished = []
    while not finished:
        finished = engine.step()
    assert [o.request_id for o in finished] == ["b"]
    assert engine.stats()["num_running"] == 1 and engine.stats()["kv_blocks_used"] > 0
    engine.abort_request("a")
    assert not engine.has_unfinished_requests()
    stats = engine.stats()
    assert {k: stats[k] for k in ("kv_blocks_total", "kv_blocks_used", "num_running",
                                  "num_waiting", "weight_version", "preemptions")} == {
        "kv_blocks_total": 40, "kv_blocks_used": 0, "num_running": 0, "num_waiting": 0,
        "weight_version": 0, "preemptions": 0}


def test_abort_and_add_wait_for_a_commit_that_holds_the_engine_lock(llm):
    # A threaded weight commit drains and swaps under the engine's lock; an abort or an add
    # arriving from the core's thread meanwhile must wait for it, not change the scheduler
    # under it.
    engine = llm.engine
    engine.add_request("a", "What is 2+3?", greedy(50, ignore_eos=True))
    engine.step()
    committing, committed = threading.Event(), threading.Event()

    def commit() -> None:
        with engine.lock:
            committing.set()
            committed.wait(30)

    aborted = []
    calls = [threading.Thread(target=commit),
             threading.Thread(target=lambda: aborted.append(engine.abort_request("a"))),
             threading.Thread(target=engine.add_request,
                              args=("b", "Seven", greedy(3, ignore_eos=True)))]
    calls[0].start()
    committing.wait(30)
    try:
        for call in calls[1:]:
            call.start()
            call.join(0.5)
        assert all(call.is_alive() for call in calls[1:])
        assert set(engine.requests) == {"a"}
    finally:
        committed.set()
        for call in calls:
            call.join(30)
    assert [c.finish_reason for c in aborted[0].outputs] == ["abort"]
    assert set(engine.requests) == {"b"}
    while engine.has_unfinished_requests():
        engine.step()
    assert_still_serving(llm)


def test_colliding_block_hashes_never_serve_another_prompts_kv(llama_dir, monkeypatch):
    """Every block's digest collides: each prompt's greedy tokens and log-probs still equal
    an engine's without the prefix cache, and the block a prompt truly shares still hits."""
    monkeypatch.setattr(block_manager, "block_hash", lambda *args: b"collide")
    first = [(7 * i) % 150 + 5 for i in range(40)]
    prompts = [first, first[:16] + first[:24], [(11 * i) % 150 + 5 for i in range(40)]]
    params = greedy(6, ignore_eos=True, logprobs=0)
    cached = LLM(str(llama_dir), num_kv_blocks=40, max_model_len=256)
    reference = LLM(str(llama_dir), num_kv_blocks=40, max_model_len=256,
                    enable_prefix_caching=False)
    for prompt in prompts:  # one at a time, so each looks up the blocks of those before
        got, want = (llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
                     for llm in (cached, reference))
        assert got.token_ids == want.token_ids
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert cached.stats()["prefix_cache_hit_tokens"] == 16


def test_stats_report_the_peak_kv_use_of_the_last_busy_period(llama_dir):
    llm = LLM(str(llama_dir), num_kv_blocks=64, block_size=4, max_model_len=64)
    llm.generate([[5, 6, 7, 8, 9]], SamplingParams(n=3, max_tokens=6, ignore_eos=True),
                 use_tqdm=False)
    stats = llm.stats()
    # 11 tokens: the prompt's full block shared, each child's 2 more blocks of its own.
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_used_peak"] == 1 + 3 * 2
    llm.generate([[5]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.stats()["kv_blocks_used_peak"] == 1


def test_stats_keep_the_names_metrics_and_trainers_read(llm):
    # Each part reports its own counters (runner, block manager, scheduler): a rename there
    # would silently drop a /metrics gauge or a round metric.
    assert set(llm.stats()) == {
        "sleep_seconds", "sleep_kv_cache_seconds", "sleep_weights_seconds", "wake_seconds",
        "wake_weights_seconds", "wake_kv_cache_seconds", "wake_capture_seconds", "sleep_level",
        "weight_bytes", "kv_cache_bytes", "num_decode_graphs", "graph_captures",
        "graph_capture_seconds", "graph_bytes", "kv_blocks_total", "kv_blocks_used",
        "kv_blocks_used_peak", "kv_blocks_cached_free", "num_running", "num_waiting",
        "weight_version", "prefix_cache_queried_tokens", "prefix_cache_hit_tokens",
        "cow_copies", "preemptions", "prefill_tokens", "decode_steps", "decoded_seqs",
        "held_sequences", "is_sleeping"}


def test_waiting_request_ids_name_the_requests_not_yet_admitted(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=40, max_model_len=256,
                                    max_num_seqs=2))
    engine.add_requests(["a", "b", "c"], [[5, 6], [7, 8], [9, 10]],
                        [greedy(4, ignore_eos=True)] * 3)
    assert engine.waiting_request_ids() == {"a", "b", "c"}
    engine.step()  # two sequences run at most: the third waits
    assert engine.waiting_request_ids() == {"c"}
    engine.abort_request("c")
    assert engine.waiting_request_ids() == set()


@pytest.mark.parametrize("tune", [True, False])
def test_cpu_engine_tunes_malloc_unless_told_not_to(llama_dir, monkeypatch, tune):
    calls = []
    monkeypatch.setattr("tandem.rollout.engine.keep_freed_memory", lambda: calls.append(1))
    LLMEngine(EngineConfig(model=str(llama_dir), device="cpu", tune_cpu_allocator=tune))
    assert calls == ([1] if tune else [])


def test_glibc_accepts_the_malloc_settings():
    import platform

    from tandem.rollout.worker.cpu_allocator import keep_freed_memory

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    assert keep_freed_memory()


def test_each_prompt_is_tokenized_once_offline(llm, monkeypatch):
    tokenizer = count_tokenizations(llm.engine, monkeypatch)
    llm.generate(["What is 2+3?", "Seven", "x"], SamplingParams(n=2, max_tokens=2),
                 use_tqdm=False)
    assert dict(tokenizer.calls) == {"encode": 3}
    tokenizer.calls.clear()
    llm.chat([[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Yo"}]],
             SamplingParams(max_tokens=2), use_tqdm=False)
    assert dict(tokenizer.calls) == {"apply_chat_template": 2}
    tokenizer.calls.clear()
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not tokenizer.calls
