"""The grpo-cpu benchmark: Tandem against Hugging Face ``generate`` and ``generate_batch``.

Workload (DESIGN.md, "Benchmarks (fixed workloads)"): the embedded SmolLM2-135M-Instruct
in float32 with ``torch.set_num_threads(2)``; eight arithmetic user messages with the chat
template applied (``add_generation_prompt=True``); n=8 samples each (64 sequences),
temperature 1.0, top_p 1.0, no top-k, at most 64 new tokens.

The figure is generated tokens per second, counting each sequence's tokens up to and
including its first EOS, timed around the generation call alone after one untimed warm-up
call, and its ratio to two references run on the same machine in the same process:

- ``generate``: Hugging Face ``model.generate`` on the 8 prompts as one left-padded batch
  with ``num_return_sequences=8``, one call;
- ``generate_batch``: transformers' continuous batching, the 8 prompts repeated 8 times,
  with a paged cache sized for the workload (every sequence's prompt plus ``max_tokens``)
  and kept between calls, so that allocating it happens in the warm-up call, as Tandem
  allocates its KV pool when ``LLM`` is built.

Peak RSS is printed at the end; it covers every engine the process ran, so memory must be
compared between separate processes (``--only``).

Run::

    python benchmarks/grpo_cpu.py
    python benchmarks/grpo_cpu.py --only tandem --repeats 3
"""

from __future__ import annotations

import argparse
import logging
import math
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    ContinuousBatchingConfig,
    GenerationConfig,
)

from tandem.rollout import LLM, SamplingParams
from tandem.rollout.default_model import embedded_model_dir

MESSAGES = [
    "What is 2+3?",
    "What is 17*4?",
    "What is 125-48?",
    "What is 9*9+1?",
    "What is 144 divided by 12?",
    "If I have 7 apples and eat 2, how many are left?",
    "What is 36+57?",
    "What is 3 cubed?",
]
N_SAMPLES = 8
NUM_THREADS = 2
ENGINES = ("tandem", "generate", "generate_batch")
REFERENCE = "generate"
PAGE_SIZE = 16


@dataclass
class Run:
    """One timed generation call: how many tokens it produced and how long it took."""

    tokens: int
    seconds: float

    @property
    def tok_s(self) -> float:
        """Generated tokens per second."""
        return self.tokens / self.seconds


@dataclass
class Workload:
    """The tokenized prompts and the sampling limits shared by every engine."""

    prompt_ids: list[list[int]]
    eos_token_id: int
    pad_token_id: int
    max_tokens: int


def parse_args() -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="model dtype on every engine (default: float32)")
    parser.add_argument("--only", choices=ENGINES, default=None,
                        help="run a single engine (to compare peak memory between processes)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed calls per engine after the warm-up; the median is reported")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per sequence")
    return parser.parse_args()


def tokens_until_eos(tokens: list[int], eos_token_id: int) -> int:
    """Count ``tokens`` up to and including the first EOS (all of them when there is none)."""
    return tokens.index(eos_token_id) + 1 if eos_token_id in tokens else len(tokens)


def build_workload(folder: Path, max_tokens: int) -> Workload:
    """Apply the chat template to every message and tokenize the result."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt_ids = []
    for message in MESSAGES:
        text = tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                             add_generation_prompt=True, tokenize=False)
        prompt_ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return Workload(prompt_ids, tokenizer.eos_token_id, tokenizer.pad_token_id, max_tokens)


def measure(call: Callable[[], int], repeats: int) -> Run:
    """Run ``call`` once untimed, then ``repeats`` times timed; return the median run by tok/s.

    ``call`` returns the number of generated tokens it produced.
    """
    call()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        tokens = call()
        runs.append(Run(tokens, time.perf_counter() - start))
    runs.sort(key=lambda run: run.tok_s)
    return runs[(len(runs) - 1) // 2]


def bench_tandem(folder: Path, dtype: str, work: Workload, repeats: int) -> Run:
    """Time Tandem's ``LLM.generate`` on the workload."""
    llm = LLM(str(folder), dtype=dtype)
    params = SamplingParams(n=N_SAMPLES, temperature=1.0, top_p=1.0, max_tokens=work.max_tokens)

    def call() -> int:
        outputs = llm.generate(work.prompt_ids, params, use_tqdm=False)
        return sum(tokens_until_eos(list(completion.token_ids), work.eos_token_id)
                   for output in outputs for completion in output.outputs)

    return measure(call, repeats)


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
    """Time Hugging Face ``generate``: one left-padded batch, ``num_return_sequences=8``."""
    input_ids, attention_mask = left_padded_batch(work)
    config = sampling_config(work, N_SAMPLES)

    def call() -> int:
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                 generation_config=config)
        new_tokens = out[:, input_ids.shape[1]:].tolist()
        return sum(tokens_until_eos(row, work.eos_token_id) for row in new_tokens)

    return measure(call, repeats)


def cache_config(work: Workload) -> ContinuousBatchingConfig:
    """A continuous-batching config whose paged cache holds the whole workload at once.

    On CPU, transformers otherwise sizes the cache (and its preallocated attention mask)
    from ~90% of the machine's RAM.
    """
    num_requests = N_SAMPLES * len(work.prompt_ids)
    longest = max(len(ids) for ids in work.prompt_ids) + work.max_tokens
    prompt_tokens = N_SAMPLES * sum(len(ids) for ids in work.prompt_ids)
    return ContinuousBatchingConfig(
        page_size=PAGE_SIZE,
        num_blocks=num_requests * math.ceil(longest / PAGE_SIZE),
        max_batch_tokens=prompt_tokens,
        max_requests_per_batch=num_requests,
    )


def bench_generate_batch(model: torch.nn.Module, work: Workload, repeats: int) -> Run:
    """Time transformers' continuous batching (``generate_batch``) on the prompts x 8."""
    inputs = [ids for ids in work.prompt_ids for _ in range(N_SAMPLES)]
    config = sampling_config(work, 1)
    cb_config = cache_config(work)
    # Every call with persistent_manager=True warns that the manager is kept; errors still show.
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)

    def call() -> int:
        outputs = model.generate_batch(inputs=inputs, generation_config=config,
                                       continuous_batching_config=cb_config,
                                       persistent_manager=True)
        if len(outputs) != len(inputs):
            raise RuntimeError(f"generate_batch returned {len(outputs)} of {len(inputs)} requests")
        return sum(tokens_until_eos(out.generated_tokens, work.eos_token_id)
                   for out in outputs.values())

    try:
        return measure(call, repeats)
    finally:
        model.destroy_cached_continuous_batching_manager()


def load_hf_model(folder: Path, dtype: str) -> torch.nn.Module:
    """Load the Hugging Face model in ``dtype`` for inference."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    return model.eval()


def run_engines(engines: list[str], folder: Path, dtype: str, work: Workload,
                repeats: int) -> dict[str, Run]:
    """Benchmark each engine in ``engines`` in turn."""
    results: dict[str, Run] = {}
    if "tandem" in engines:
        results["tandem"] = bench_tandem(folder, dtype, work, repeats)
    if "generate" in engines or "generate_batch" in engines:
        model = load_hf_model(folder, dtype)
        if "generate" in engines:
            results["generate"] = bench_generate(model, work, repeats)
        if "generate_batch" in engines:
            results["generate_batch"] = bench_generate_batch(model, work, repeats)
    return results


def ratio(run: Run, baseline: Run | None) -> str:
    """``run``'s tok/s over ``baseline``'s, formatted, or n/a without a baseline."""
    return f"{run.tok_s / baseline.tok_s:.2f}x" if baseline else "n/a"


def print_table(results: dict[str, Run]) -> None:
    """Print one row per engine, with tok/s ratios against both Hugging Face engines."""
    header = ("engine", "generated tokens", "seconds", "tok/s", "ratio vs generate",
              "ratio vs generate_batch")
    rows = [header]
    for engine in ENGINES:
        run = results.get(engine)
        if run is None:
            continue
        rows.append((engine, str(run.tokens), f"{run.seconds:.2f}", f"{run.tok_s:.1f}",
                     ratio(run, results.get(REFERENCE)), ratio(run, results.get("generate_batch"))))
    widths = [max(len(row[col]) for row in rows) for col in range(len(header))]
    for row in rows:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)))


def peak_rss_mib() -> float:
    """This process's peak resident set size in MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    """Run the grpo-cpu benchmark and print its table."""
    args = parse_args()
    torch.set_num_threads(NUM_THREADS)
    torch.manual_seed(0)
    folder = Path(embedded_model_dir())
    work = build_workload(folder, args.max_tokens)
    engines = [args.only] if args.only else list(ENGINES)
    print(f"grpo-cpu: {len(MESSAGES)} prompts x n={N_SAMPLES}, max_tokens={args.max_tokens}, "
          f"dtype={args.dtype}, threads={torch.get_num_threads()}, repeats={args.repeats}")
    results = run_engines(engines, folder, args.dtype, work, args.repeats)
    print_table(results)
    print(f"peak RSS: {peak_rss_mib():.0f} MiB for {', '.join(engines)} "
          "(compare peak memory between separate processes, with --only)")


if __name__ == "__main__":
    main()
