"""An aiohttp load client for ``tandem serve`` (as AIPerf and vLLM's serving benchmark use:
httpx's own connection pool cost up to 3x at 128 connections here): closed-loop clients over
a list of token-id prompts, output tok/s and time to first token."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import time


def free_port() -> int:
    """A port free on 127.0.0.1 right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def wait_healthy(session, server: subprocess.Popen, wait: float = 240.0) -> None:
    """Return once the server answers ``/health`` with 200.

    Raises:
        RuntimeError: when its process exits or ``wait`` seconds pass first.
    """
    import aiohttp

    deadline = time.monotonic() + wait
    while server.poll() is None and time.monotonic() < deadline:
        try:
            async with session.get("/health") as response:
                if response.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError(f"the server did not come up (exit code {server.poll()})")


async def serve_level(session, prompts: list[list[int]], max_tokens: int, concurrency: int,
                      stream: bool) -> dict:
    """``prompts`` sent by ``concurrency`` closed-loop clients: output tok/s and TTFT."""
    queue = list(enumerate(prompts))
    first_token: list[float] = []
    tokens = 0

    async def client() -> None:
        nonlocal tokens
        while queue:
            _, prompt = queue.pop()
            body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                    "temperature": 1.0, "stream": stream}
            if stream:
                body["stream_options"] = {"include_usage": True}
            completion_tokens = await send(session, body, first_token)
            tokens += completion_tokens  # not `tokens += await ...`: that reads tokens first

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    seconds = time.perf_counter() - start
    first_token.sort()
    return dict(concurrency=concurrency, stream=stream, requests=len(prompts),
                tok_s=round(tokens / seconds, 1),
                ttft_p50=round(first_token[len(first_token) // 2], 3) if first_token else None,
                ttft_p99=round(first_token[int(0.99 * (len(first_token) - 1))], 3)
                if first_token else None)


async def send(session, body: dict, first_token: list[float]) -> int:
    """One completion request; its completion tokens (the usage's). A streamed one appends
    its time to first token."""
    start = time.perf_counter()
    async with session.post("/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:300]}")
        if not body["stream"]:
            return (await response.json())["usage"]["completion_tokens"]
        usage = 0
        async for line in response.content:
            text = line.decode().strip()
            if not text.startswith("data:") or text == "data: [DONE]":
                continue
            chunk = json.loads(text[5:])
            if chunk.get("choices") and start is not None:
                first_token.append(time.perf_counter() - start)
                start = None
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
        return usage
