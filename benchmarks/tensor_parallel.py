"""Tensor parallelism on CPU: grpo-cpu with TP=2 (the driver and one worker process, one
thread each) beside TP=1 (one process, two threads), and the KV blocks each rank holds at the
same per-rank budget.

SmolLM2-135M itself cannot be split in two (9 attention heads, 3 KV heads: vLLM refuses it
too), so the model is SmolLM2-135M's shape (30 layers, hidden 576, MLP 1536, its vocabulary
and tokenizer) with 8 attention heads of 72 and 4 KV heads, randomly initialised, in float32.
The workload is grpo_cpu.py's ``grpo`` prompts (eight chat-templated prompts, n=8, 64 new
tokens, temperature 1), EOS ignored so that both engines generate every token. Both engines
live in this process and their calls alternate (``--repeats`` timed each after one warm-up,
the median reported), the prefix cache reset before each. The figure is generated tokens per
second and its ratio to TP=1. CPU TP is expected to lose: its two ranks split two
cores that one process already uses, and add two all-reduces per layer and a logits gather
per step; its point is capacity (each rank stores half the KV heads) and the GPU path.

    python benchmarks/tensor_parallel.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from common import Run, model_folder, print_table, setup_torch, timed
from grpo_cpu import build_workload
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tandem.rollout import LLM, SamplingParams

KV_BUDGET = 512 << 20  # bytes per rank
MAX_MODEL_LEN = 1024


def parse_args() -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed calls per engine, alternating; the median is reported")
    return parser.parse_args()


def splittable_model(source: Path, target: Path) -> Path:
    """SmolLM2-135M's shape with 8 heads and 4 KV heads, random weights, saved in ``target``."""
    config = AutoConfig.from_pretrained(source)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 8, 4, 72
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(target)
    AutoTokenizer.from_pretrained(source).save_pretrained(target)
    return target


def main() -> None:
    """Time both engines and print the tables."""
    args = parse_args()
    setup_torch()
    folder = splittable_model(model_folder(), Path(tempfile.mkdtemp()))
    work = build_workload(folder, "grpo", None)
    params = SamplingParams(n=work.n, temperature=1.0, max_tokens=work.max_tokens,
                            ignore_eos=True)
    options = dict(dtype="float32", kv_cache_memory_bytes=KV_BUDGET,
                   max_model_len=MAX_MODEL_LEN)
    engines = {size: LLM(str(folder), tensor_parallel_size=size, **options) for size in (1, 2)}
    threads = {1: 2, 2: 1}
    runs: dict[int, list[Run]] = {1: [], 2: []}
    for round_index in range(args.repeats + 1):
        for size, llm in engines.items():
            torch.set_num_threads(threads[size])
            llm.reset_prefix_cache()
            outputs, seconds, others = timed(
                lambda llm=llm: llm.generate(work.prompt_ids, params, use_tqdm=False))
            lengths = [len(c.token_ids) for output in outputs for c in output.outputs]
            if round_index:
                runs[size].append(Run(lengths, seconds, others))
    medians = {size: sorted(r, key=lambda run: run.tok_s)[(len(r) - 1) // 2]
               for size, r in runs.items()}
    rows = [("engine", "threads per rank", "tokens", "seconds", "tok/s", "vs TP=1",
             "others' CPU")]
    for size, run in medians.items():
        rows.append((f"TP={size}", str(threads[size]), str(run.tokens), f"{run.seconds:.2f}",
                     f"{run.tok_s:.1f}", f"{run.tok_s / medians[1].tok_s:.2f}",
                     f"{run.others_cpu:.0%}"))
    print(f"grpo-cpu, float32, {len(work.prompt_ids)} prompts x n={work.n}, "
          f"{work.max_tokens} tokens; median of {args.repeats} alternating calls")
    print_table(rows)
    print(f"\nKV blocks per rank at {KV_BUDGET >> 20} MiB per rank "
          f"({engines[1].engine.runner.model.config.num_key_value_heads} KV heads), and the "
          "weights each rank holds (the embedding split by vocabulary under TP)")
    print_table([("engine", "KV heads per rank", "blocks per rank", "tokens per rank",
                  "weight MiB per rank")] + [
        (f"TP={size}", str(llm.engine.runner.model.model.layers[0].self_attn.num_kv_heads),
         str(llm.engine.num_kv_blocks), str(llm.engine.num_kv_blocks * 16),
         f"{llm.engine.runner.weight_bytes() / 2**20:.0f}")
        for size, llm in engines.items()])


if __name__ == "__main__":
    main()
