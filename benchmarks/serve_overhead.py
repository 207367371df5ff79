"""Served against offline, on an engine whose step costs what a GPU's does (issue 47).

The model is serve_load's tiny random Llama (2 layers, 64 wide, a 320-token byte-level BPE).
Each forward step is padded to ``--step-ms`` (default 6 ms: an H200's decode step of a 0.6B
model at batch 256) by sleeping, which releases the interpreter lock as a wait for a GPU
does, so the host's Python around the step (scheduling, sampling, the server's event loop)
costs what it would beside a GPU. The server runs as padded_serve.py, which pads its
engine core's process too. One torch thread by default (``--threads``): a GPU engine
computes nothing on the host, while the tiny model's own compute on two threads keeps an
OpenMP team spinning on the second core between its parallel regions, a core that a GPU
engine would leave to the server's HTTP and to the client (both ways, offline and served,
run with the same threads).

The same requests (distinct random prompts of ``--prompt-tokens`` tokens, ``--max-tokens``
generated, EOS ignored) run offline in one ``LLM.generate`` call, then served by
``tandem serve`` (a subprocess, the same padding) at ``--concurrency`` closed-loop clients,
not streamed and streamed, through an aiohttp client (serve_client.py). The table gives
output tok/s, time to first token, and the served/offline ratios against issue 47's CPU
targets: not streamed at least 0.9x, streamed at least 0.7x.

Run::

    cd benchmarks && python serve_overhead.py
    cd benchmarks && python serve_overhead.py --step-ms 0 --requests 64
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import print_table
from padded_serve import STEP_MS_VARIABLE, pad_steps
from serve_client import free_port, serve_level, wait_healthy
from serve_load import save_tiny_model

from tandem.rollout import LLM, SamplingParams

# The same engine both ways (the server's own CPU default budget is 1024 tokens a step).
ENGINE_OPTIONS = {"max_model_len": 512, "num_kv_blocks": 4096, "max_num_seqs": 256,
                  "max_num_batched_tokens": 2048}


def workload(args: argparse.Namespace) -> list[list[int]]:
    """Distinct random prompts of ``args.prompt_tokens`` ids (the tokenizer's 320)."""
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(5, 320, (args.prompt_tokens,), generator=generator).tolist()
            for _ in range(args.requests)]


def offline_tok_s(folder: Path, prompts: list[list[int]], max_tokens: int) -> float:
    """Output tok/s of one ``generate`` call over every prompt, after a warm-up call."""
    llm = LLM(str(folder), **ENGINE_OPTIONS)
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:4], params, use_tqdm=False)
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return tokens / (time.perf_counter() - start)


def server_command(folder: Path, port: int, serve_options: list[str]) -> list[str]:
    """``tandem serve`` on ``port`` with ``serve_options``, as padded_serve.py
    (``STEP_MS_VARIABLE`` pads it)."""
    options = [f"--{name.replace('_', '-')}={value}" for name, value in ENGINE_OPTIONS.items()]
    return [sys.executable, str(Path(__file__).parent / "padded_serve.py"), "serve",
            str(folder), "--port", str(port), *options, *serve_options]


async def served_rows(folder: Path, prompts: list[list[int]], args: argparse.Namespace,
                      log: Path) -> list[dict]:
    """Not streamed, then streamed, at ``args.concurrency`` (after a warm-up level)."""
    import aiohttp

    port = free_port()
    with log.open("wb") as out:
        server = subprocess.Popen(server_command(folder, port, args.serve_options.split()),
                                  stdout=out, stderr=out,
                                  env=os.environ | {STEP_MS_VARIABLE: str(args.step_ms),
                                                    "OMP_NUM_THREADS": str(args.threads)})
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}",
                                         connector=aiohttp.TCPConnector(limit=0)) as session:
            await wait_healthy(session, server)
            await serve_level(session, prompts[:8], args.max_tokens, 8, True)
            return [await serve_level(session, prompts, args.max_tokens, args.concurrency,
                                      stream) for stream in (False, True)]
    finally:
        server.terminate()
        server.wait(60)


def main() -> None:
    """Measure offline and served, print the table and the ratios against the targets."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-ms", type=float, default=6.0, help="each step's floor")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--serve-options", default="",
                        help="more tandem serve options, e.g. '--engine-core thread'")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads offline and in the server (OMP_NUM_THREADS)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = Path(tempfile.mkdtemp(prefix="serve_overhead_"))
    save_tiny_model(folder)
    prompts = workload(args)
    pad_steps(args.step_ms)
    offline = offline_tok_s(folder, prompts, args.max_tokens)
    rows = asyncio.run(served_rows(folder, prompts, args, folder / "server.log"))
    targets = {False: 0.9, True: 0.7}
    table = [("path", "tok/s", "ratio", "target", "met", "TTFT p50 (s)", "TTFT p99 (s)"),
             ("offline, one generate call", f"{offline:.0f}", "1.00", "", "", "", "")]
    for row in rows:
        ratio = row["tok_s"] / offline
        table.append((f"served, {'streamed' if row['stream'] else 'not streamed'}, "
                      f"concurrency {row['concurrency']}", f"{row['tok_s']:.0f}",
                      f"{ratio:.2f}", f">= {targets[row['stream']]}",
                      "yes" if ratio >= targets[row["stream"]] else "no",
                      str(row["ttft_p50"] or ""), str(row["ttft_p99"] or "")))
    print(f"{args.requests} requests of {args.prompt_tokens} prompt tokens, {args.max_tokens} "
          f"generated (EOS ignored), each step padded to {args.step_ms} ms, {args.threads} "
          f"torch threads, tandem serve {args.serve_options or '(defaults)'}")
    print_table(table)


if __name__ == "__main__":
    main()
