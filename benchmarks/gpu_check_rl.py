"""The GPU check's sections around the engine: CUDA IPC weight transfer between two
processes, a colocated GRPO run, the HTTP server under load against the same requests
offline, and structured outputs."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from gpu_check_common import (
    QWEN3_06B,
    TOY,
    Recorder,
    collect,
    device_used_bytes,
    make_llm,
    save_byte_tokenizer,
    save_random_model,
    sync,
    vocab_size,
)
from safetensors.torch import load_file
from serve_client import free_port, serve_level, wait_healthy

from tandem.rollout import SamplingParams
from tandem.rollout.structured_outputs import StructuredOutputsParams

CLI = [sys.executable, "-m", "tandem.cli"]  # tandem.cli where the project is installed


def check_ipc(rec: Recorder, folder: Path) -> None:
    """A full weight push from a sender process to an engine in another (CUDA IPC on one
    GPU; gloo on CPU), timed on the sender until the engine committed (target: 0.18 s, vLLM's
    packed NCCL sync of Qwen3-0.6B)."""
    import sync as sync_benchmark  # benchmarks/sync.py

    state = load_file(folder / "model.safetensors", device=str(rec.device))
    path, gigabytes, seconds = sync_benchmark.two_process_row(folder, state, 3,
                                                              str(rec.device.type))
    rec.record("ipc", path, gb=round(gigabytes, 3), seconds=round(seconds, 4),
               gb_s=round(gigabytes / seconds, 1), ok=seconds <= 0.18 or rec.smoke)


class PeakPoller:
    """Samples the device's memory in use every 50 ms on a thread, keeping the largest."""

    def __init__(self) -> None:
        self.peak = 0
        self.running = True
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while self.running:
            self.peak = max(self.peak, device_used_bytes())
            time.sleep(0.05)

    def stop(self) -> int:
        """Stop sampling; the peak bytes seen."""
        self.running = False
        self.thread.join()
        return self.peak


def check_grpo(rec: Recorder, folder: Path, work: Path) -> None:
    """``tandem train`` colocated (engine and trainer in one process on one device), GRPO,
    3 steps of 32 prompts x 8 completions x 128 tokens, with the device's peak polled from
    this process; the per-step seconds and the sampler-trainer log-prob gap from its log."""
    output = work / "grpo"
    small = rec.smoke
    recipe = {
        "algorithm": "grpo", "model": str(folder), "dtype": "float32" if small else "bfloat16",
        "task": "arith", "task_args": {"max_operand": 9, "operations": "+-"},
        "rewards": [{"name": "correct", "weight": 1.0}, {"name": "format", "weight": 0.5}],
        "steps": 2 if small else 3, "seed": 0, "output_dir": str(output),
        "logging": {"wandb": False, "progress_bar": False},
        "rollout": {"prompts_per_step": 2 if small else 32, "num_generations": 2 if small else 8,
                    "max_tokens": 4 if small else 128, "temperature": 1.0,
                    "engine": {"num_kv_blocks": 256} if small else
                    {"gpu_memory_utilization": 0.3, "max_model_len": 1024}},
        "optim": {"lr": 1e-6, "micro_batch_size": 4 if small else 64},
        "grpo": {"beta": 0.0, "loss_type": "grpo"}}
    (work / "grpo.json").write_text(json.dumps(recipe))
    baseline = device_used_bytes()
    poller = PeakPoller()
    run = subprocess.run([*CLI, "train", str(work / "grpo.json")], capture_output=True,
                         text=True, timeout=max(30.0, rec.seconds_left()))
    peak = poller.stop() - baseline
    if run.returncode != 0:
        raise RuntimeError(f"tandem train exited with {run.returncode}:\n{run.stderr[-3000:]}")
    for line in (output / "metrics.jsonl").read_text().splitlines():
        metrics = json.loads(line)
        keep = ("step", "rollout_seconds", "train_seconds", "sync_seconds",
                "sampler_logprob_diff_max", "sampler_logprob_diff_mean")
        rec.record("grpo", "step", **{k: round(metrics[k], 5) for k in keep if k in metrics})
    rec.record("grpo", "device peak (polled)", gib=round(peak / 2**30, 2))


# ---------------------------------------------------------------- the server


def served_workload(smoke: bool, vocab_size: int) -> tuple[list[list[int]], int]:
    """Distinct random prompts (564 tokens; 32 on CPU) and the tokens each generates."""
    generator = torch.Generator().manual_seed(7)
    length, count = (32, 16) if smoke else (564, 384)
    return [torch.randint(2, min(10000, vocab_size), (length,), generator=generator).tolist()
            for _ in range(count)], 8 if smoke else 128


def check_server(rec: Recorder, folder: Path, work: Path) -> None:
    """``tandem serve`` at concurrency 1, 8, 32 and 128, streamed and not (aiohttp client,
    distinct prompts, EOS ignored), against the largest level's requests offline in one
    ``generate`` call: output tok/s and their ratio, and time to first token."""
    prompts, max_tokens = served_workload(rec.smoke, vocab_size(folder))
    port = free_port()
    options = (["--num-kv-blocks", "512", "--max-model-len", "512"] if rec.smoke else
               ["--gpu-memory-utilization", "0.5", "--max-model-len", "2048"])
    log = (work / "server.log").open("wb")
    server = subprocess.Popen([*CLI, "serve", str(folder), "--port", str(port), *options],
                              stdout=log, stderr=log)
    try:
        levels = asyncio.run(serve_levels(rec, f"http://127.0.0.1:{port}", server, prompts,
                                          max_tokens))
    finally:
        server.terminate()
        server.wait(60)
        log.close()
    collect()
    llm = make_llm(rec, folder, **({} if rec.smoke else {"gpu_memory_utilization": 0.5,
                                                          "max_model_len": 2048,
                                                          "max_num_seqs": 256}))
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:4], params, use_tqdm=False)
    llm.reset_prefix_cache()
    sync()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    sync()
    offline = len(prompts) * max_tokens / (time.perf_counter() - start)
    rec.record("server", "offline, one generate call", requests=len(prompts),
               tok_s=round(offline, 1))
    for row in levels:
        rec.record("server", "served", **row, of_offline=round(row["tok_s"] / offline, 3))


async def serve_levels(rec: Recorder, url: str, server: subprocess.Popen,
                       prompts: list[list[int]], max_tokens: int) -> list[dict]:
    """Every level's row, once the server answers ``/health``."""
    import aiohttp

    async with aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(limit=0)) as session:
        await wait_healthy(session, server)
        await serve_level(session, prompts[:4], max_tokens, 4, True)  # warm-up, not recorded
        rows = []
        for concurrency in (1, 2) if rec.smoke else (1, 8, 32, 128):
            count = min(len(prompts), max(8, 3 * concurrency))
            for stream in (False, True):
                rows.append(await serve_level(session, prompts[:count], max_tokens,
                                              concurrency, stream))
        return rows


# ---------------------------------------------------------------- structured outputs

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def check_structured(rec: Recorder, work: Path) -> None:
    """JSON-schema constrained sampling on the device (xgrammar's bitmask) on a Qwen3-0.6B
    body with a byte-level vocabulary: every finished completion parses and matches the
    schema; tok/s against the same requests unconstrained."""
    folder = work / "structured"
    folder.mkdir(parents=True, exist_ok=True)
    vocab_size = save_byte_tokenizer(folder)
    shape = (TOY if rec.smoke else QWEN3_06B) | dict(vocab_size=max(vocab_size, 512),
                                                     bos_token_id=0, eos_token_id=1)
    save_random_model(shape, folder, torch.float32 if rec.smoke else torch.bfloat16,
                      rec.device, word_tokenizer=False)
    llm = make_llm(rec, folder, max_model_len=1024)
    prompts = [[2 + i, 40, 41] for i in range(16 if rec.smoke else 64)]
    rows = {}
    for side in ("unconstrained", "json schema"):
        params = SamplingParams(temperature=1.0, max_tokens=64, structured_outputs=None
                                if side == "unconstrained" else
                                StructuredOutputsParams(json=SCHEMA))
        llm.generate(prompts[:2], params, use_tqdm=False)
        sync()
        start = time.perf_counter()
        outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        sync()
        tokens = sum(len(o.token_ids) for o in outputs)
        rows[side] = tokens / (time.perf_counter() - start)
        if side == "json schema":
            finished = [o for o in outputs if o.finish_reason == "stop"]
            valid = sum(matches_schema(o.text) for o in finished)
            rec.record("structured", "JSON schema on the device", finished=len(finished),
                       valid=valid, of=len(outputs), ok=valid == len(finished) > 0)
    rec.record("structured", "tok/s", unconstrained=round(rows["unconstrained"], 1),
               json_schema=round(rows["json schema"], 1),
               ratio=round(rows["json schema"] / rows["unconstrained"], 3))


def matches_schema(text: str) -> bool:
    """Whether ``text`` is a JSON object with exactly a string ``name`` and an integer
    ``age`` (control characters allowed inside strings, as xgrammar's JSON grammar does: a
    random model over a byte vocabulary samples them)."""
    try:
        value = json.loads(text, strict=False)
    except ValueError:
        return False
    return (isinstance(value, dict) and set(value) == {"name", "age"}
            and isinstance(value["name"], str)
            and isinstance(value["age"], int) and not isinstance(value["age"], bool))

