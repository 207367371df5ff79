"""Single-sequence greedy latency per token on CPU: Tandem against Hugging Face ``generate``.

Workload: the embedded SmolLM2-135M-Instruct with ``torch.set_num_threads(2)``; one prompt,
"What is 17*4?" as a user message with the chat template applied; greedy decoding of
exactly 128 new tokens (Tandem: ``temperature=0, min_tokens=max_tokens=128``; transformers:
``do_sample=False, min_new_tokens=max_new_tokens=128``), in float32 (or ``--dtype``).

Each engine runs one untimed warm-up call, then ``--repeats`` timed calls (the median is
kept); ms/token is the call's time (prefill included) over the 128 tokens. Both engines run
in this process, one after the other.

Decoding one sequence is memory-bound: each token reads every weight once. Two floors are
measured in the same run. "linear floor": the model's linear layers alone (q, k, v, o, gate,
up, down of every layer and the LM head, ``torch.nn.functional.linear`` on random inputs)
for the same steps, one prefill over the prompt, then one row per token: what the matmul
library can do here. "memory floor": the model's parameter bytes (tied embeddings counted
once) over the memory read bandwidth, the best of several ``t.sum()`` over a 512 MiB float32
tensor: what the memory could do. "of floor" is the linear floor's ms/token over the
engine's. "others' CPU" is the
share of the machine's CPU time other processes used during the timed call; trust only rows
where it is near 0%.

Run::

    python benchmarks/cpu_latency.py
    python benchmarks/cpu_latency.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time

import torch
from common import (
    DTYPES,
    NUM_THREADS,
    Run,
    chat_prompt_ids,
    floor_seconds,
    load_hf_model,
    measure,
    model_folder,
    print_table,
    setup_torch,
)
from transformers import AutoTokenizer, GenerationConfig

from tandem.rollout import LLM, SamplingParams

MESSAGE = "What is 17*4?"
NEW_TOKENS = 128
BANDWIDTH_BYTES = 512 << 20
BANDWIDTH_TRIES = 10


def parse_args() -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="model dtype on both engines (default: float32)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed calls per engine after the warm-up; the median is reported")
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


def bench_tandem(dtype: str, prompt_ids: list[int], repeats: int) -> Run:
    """Time Tandem's greedy ``LLM.generate`` of exactly ``NEW_TOKENS`` tokens."""
    llm = LLM(str(model_folder()), dtype=dtype)
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
    lines = [("engine", "dtype", "tokens", "seconds", "ms/token", "speedup vs generate",
              "of floor", "others' CPU")]
    for engine, run in runs.items():
        ms = ms_per_token(run)
        lines.append((engine, dtype, str(run.tokens), f"{run.seconds:.2f}", f"{ms:.1f}",
                      f"{reference / ms:.2f}x", f"{floor_ms / ms:.0%}", f"{run.others_cpu:.0%}"))
    for name, ms in (("linear floor", floor_ms), ("memory floor", memory_ms)):
        lines.append((name, dtype, "", "", f"{ms:.1f}", f"{reference / ms:.2f}x", "", ""))
    return lines


def main() -> None:
    """Measure bandwidth, time both engines and print the table."""
    args = parse_args()
    setup_torch()
    folder = model_folder()
    prompt_ids = chat_prompt_ids(AutoTokenizer.from_pretrained(folder), MESSAGE)
    bandwidth = read_bandwidth()
    runs = {"tandem": bench_tandem(args.dtype, prompt_ids, args.repeats)}
    model = load_hf_model(folder, args.dtype)
    runs["generate"] = bench_generate(model, prompt_ids, args.repeats)
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
