"""The GPU check's throughput sections (issue 46): engine decode with and without CUDA graphs
and overlapped steps, the device's busy fraction under the torch profiler, and nano-bench
against its bandwidth bound and transformers' ``generate``.

Each section builds its own engines inside its own functions and lets them go on return
(see ``gpu_check_engine.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from gpu_check_common import (
    Recorder,
    collect,
    device_used_bytes,
    load_hf_model,
    make_llm,
    sync,
    timed,
    vocab_size,
)
from gpu_check_kernels import copy_bandwidth
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from tandem.rollout import LLM, SamplingParams

# ---------------------------------------------------------------- decode


@contextmanager
def decoding(llm: LLM, batch: int, steps: int, **sampling) -> Iterator[Callable[[], object]]:
    """``batch`` sequences (128-token prompts, greedy, EOS ignored, room for ``3 * steps +
    8`` tokens; ``sampling`` overrides these ``SamplingParams``) prefilled and one step into
    decoding; yields a call that runs ``steps`` decode steps; aborts them after."""
    engine = llm.engine
    request_ids = [f"decode-{batch}-{i}" for i in range(batch)]
    params = SamplingParams(**(dict(temperature=0, max_tokens=3 * steps + 8, ignore_eos=True)
                               | sampling))
    for i, request_id in enumerate(request_ids):
        engine.add_request(request_id, [(7 * i + j) % 500 + 2 for j in range(128)], params)
    while min(engine.num_output_tokens(r) for r in request_ids) == 0:  # every prefill done
        engine.step()
    engine.step()
    try:
        yield lambda: [engine.step() for _ in range(steps)]
    finally:
        for request_id in request_ids:
            engine.abort_request(request_id)


def decode_tok_s(llm: LLM, batch: int, steps: int) -> float:
    """Decode tokens/s of ``batch`` sequences (see ``decoding``)."""
    with decoding(llm, batch, steps) as run:
        return batch * steps / timed(run)


def decode_overlap_rows(rec: Recorder, section: str, name: str, llm: LLM) -> None:
    """``llm``'s decode tokens/s at batch 1 and 64 (1 and 2 with ``--smoke``), overlapped
    steps on and off: a row named ``name`` per batch."""
    steps = 4 if rec.smoke else 32
    for batch in (1, 2) if rec.smoke else (1, 64):
        tok_s = {}
        for overlap in (True, False):
            llm.engine.steps.overlap = overlap
            tok_s[overlap] = decode_tok_s(llm, batch, steps)
        rec.record(section, name, batch=batch, overlap_on=round(tok_s[True], 1),
                   overlap_off=round(tok_s[False], 1),
                   overlap_gain=round(tok_s[True] / tok_s[False], 3))


def device_busy_fraction(run: Callable[[], object]) -> float | None:
    """The share of the device's timeline that kernels and copies covered while ``run``
    ran (the torch profiler's CUDA activity): the union of their intervals over the span
    from the first one's start to the last one's end; None without any."""
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        run()
        sync()
    intervals = sorted((e.time_range.start, e.time_range.end) for e in profiler.events()
                       if e.device_type == DeviceType.CUDA)
    if not intervals:
        return None
    busy, (start, end) = 0.0, intervals[0]
    for first, last in intervals[1:]:
        if first > end:
            busy, start = busy + end - start, first
        end = max(end, last)
    busy += end - start
    return busy / max(end - intervals[0][0], 1e-9)


def target_row(rec: Recorder, target: float | None, value: float | None) -> dict:
    """A row's target and whether ``value`` meets it (at least); none in a smoke run, whose
    toy sizes on a CPU say nothing of a GPU's figures."""
    if rec.smoke or target is None:
        return {}
    return {"target": target, "ok": None if value is None else value >= target}


def check_decode(rec: Recorder, folder: Path) -> None:
    """Engine decode tokens/s, eager against CUDA graphs, at batch 1, 8, 64 and 256, with
    overlapped steps (the CUDA default) and, with graphs at batch 1 and 256, without; the
    device's busy fraction at batch 256 both ways (issue 46's targets: batch 1 at least
    650 tok/s, busy at least 0.9)."""
    modes = {"eager": True} if rec.smoke else {"eager": True, "graphs": False}
    steps = 4 if rec.smoke else 32
    for mode, enforce_eager in modes.items():
        llm = make_llm(rec, folder, enforce_eager=enforce_eager,
                       max_num_seqs=16 if rec.smoke else 256)
        stats = llm.stats()
        rec.record("decode", f"{mode} engine", graphs=stats["num_decode_graphs"],
                   capture_seconds=round(stats["graph_capture_seconds"], 2),
                   graph_bytes=stats["graph_bytes"],
                   planned_graph_bytes=stats.get("memory_graph_bytes", 0))
        largest = 2 if rec.smoke else 256
        for batch in [1, 2] if rec.smoke else [1, 8, 64, 256]:
            for overlap in (True, False) if batch in (1, largest) else (True,):
                llm.engine.steps.overlap = overlap
                tok_s = decode_tok_s(llm, batch, steps)
                target = 650 if batch == 1 and mode == "graphs" and overlap else None
                rec.record("decode", f"decode tok/s {mode}", batch=batch, overlap=overlap,
                           tok_s=round(tok_s, 1), **target_row(rec, target, tok_s))
        if rec.device.type == "cuda":
            for overlap in (True, False):
                llm.engine.steps.overlap = overlap
                with decoding(llm, largest, steps) as run:
                    busy = device_busy_fraction(run)
                rec.record("decode", f"device busy fraction {mode}", batch=largest,
                           overlap=overlap, busy=None if busy is None else round(busy, 3),
                           **target_row(rec, 0.9 if overlap else None, busy))
        del llm
        collect()


# ---------------------------------------------------------------- nano-bench


def nano_bench_workload(num_seqs: int, low: int, high: int,
                        vocab_size: int) -> tuple[list, list[int]]:
    """Prompts of random ids below 10000 and output lengths, both lengths uniform in
    [low, high] (nano-vllm's bench)."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, min(10000, vocab_size), (int(n),), generator=generator).tolist()
               for n in torch.randint(low, high + 1, (num_seqs,), generator=generator)]
    outputs = torch.randint(low, high + 1, (num_seqs,), generator=generator).tolist()
    return prompts, outputs


def bandwidth_bound_seconds(llm: LLM, prompts: list[list[int]], output_lens: list[int],
                            copy_bytes_per_s: float) -> float:
    """The workload's floor at the device's copy bandwidth: every decode step reads each
    running sequence's cached K/V (o·p + o²/2 tokens a sequence) and the weights once."""
    config = llm.engine.runner.model.config
    kv_bytes_per_token = (2 * config.num_hidden_layers * config.num_key_value_heads
                          * config.head_dim * llm.engine.runner.dtype.itemsize)
    cached_tokens = sum(o * len(p) + o * o / 2 for p, o in zip(prompts, output_lens))
    weight_reads = max(output_lens) * llm.engine.runner.weight_bytes()
    return (cached_tokens * kv_bytes_per_token + weight_reads) / copy_bytes_per_s


def nano_bench_tandem(rec: Recorder, section: str, folder: Path, workload: tuple,
                      copy_bytes_per_s: float, overlap: bool = True) -> None:
    """Tandem on nano-bench's workload, with or without overlapped steps; against the
    bandwidth bound (issue 46's target with overlap: 0.7 of it)."""
    prompts, output_lens = workload
    llm = make_llm(rec, folder, max_model_len=512 if rec.smoke else 2048,
                   max_num_seqs=16 if rec.smoke else 256, async_scheduling=overlap,
                   **({} if rec.smoke else {"gpu_memory_utilization": 0.6}))
    llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=16, ignore_eos=True),
                 use_tqdm=False)
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True)
              for n in output_lens]
    sync()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    bound = bandwidth_bound_seconds(llm, prompts, output_lens, copy_bytes_per_s)
    rec.record(section, "tandem" if overlap else "tandem, overlap off", tokens=tokens,
               seconds=round(seconds, 2), tok_s=round(tokens / seconds, 1),
               bound_tok_s=round(tokens / bound, 1), of_bound=round(bound / seconds, 3),
               preemptions=llm.stats()["preemptions"], **target_row(
                   rec, 0.7 if overlap else None, bound / seconds))


def check_nano_bench(rec: Recorder, folder: Path, section: str = "nano_bench",
                     comparator: bool = True) -> None:
    """DESIGN.md's nano-bench (256 sequences, lengths uniform in [100, 1024], EOS ignored):
    Tandem's output tok/s against the bandwidth bound, then transformers' ``generate`` on the
    same prompts once the engine has gone."""
    workload = nano_bench_workload(*((4, 10, 30) if rec.smoke else (256, 100, 1024)),
                                   vocab_size(folder))
    nano_bench_tandem(rec, section, folder, workload, copy_bandwidth(rec))
    collect()
    if comparator:  # the overlap's gain, on the 0.6B shape only
        nano_bench_tandem(rec, section, folder, workload, copy_bandwidth(rec), overlap=False)
        collect()
    rec.record(section, "held after the engine", device_gib=round(device_used_bytes() / 2**30, 2))
    if comparator:
        hf_generate(rec, section, folder, *workload)


def hf_generate(rec: Recorder, section: str, folder: Path, prompts: list[list[int]],
                output_lens: list[int]) -> None:
    """transformers ``generate`` on the prompts as one left-padded batch, sampling at 0.6,
    every row to the longest output length or ``max_time``."""
    model = load_hf_model(folder, torch.float32 if rec.smoke else torch.bfloat16, rec.device)
    max_time = 5.0 if rec.smoke else max(10.0, min(20.0, rec.seconds_left() / 4))
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=rec.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                        device=rec.device)
    options = dict(do_sample=True, temperature=0.6, top_k=0, top_p=1.0, pad_token_id=0)
    length = max(output_lens)
    with torch.no_grad():
        model.generate(input_ids[:2, -8:], attention_mask=mask[:2, -8:], max_new_tokens=4,
                       min_new_tokens=4, **options)
        sync()
        start = time.perf_counter()
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=length,
                             min_new_tokens=length, max_time=max_time, **options)
        sync()
    seconds = time.perf_counter() - start
    tokens = (out.shape[1] - width) * len(prompts)
    rec.record(section, "transformers generate", tokens=tokens, seconds=round(seconds, 2),
               tok_s=round(tokens / seconds, 1), max_time=max_time)
