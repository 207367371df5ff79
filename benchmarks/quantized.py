"""8-bit weights on CPU (issue 42): the panel kernel's rate per weight format, and what
quantizing costs in accuracy, on the embedded SmolLM2-135M-Instruct.

``--part kernels``: every decoder projection of the model (q, k, v, o, gate, up, down, its
real weights, each layer's in turn so they stream from memory as in a forward pass) through
the panels (``cpu_linear.c``) with the weights in float32, bfloat16, int8 and fp8 e4m3
(8-bit codes and a scale per output channel; float32 activations, and bfloat16 ones beside
the bfloat16 weights), at 1, 8 and 64 rows: the best of five passes after an untimed one,
its weight bytes per second, and its speed over the float32 and bfloat16 panels'. At a few
rows a pass is bound by reading the weights, so 8 bits should run near 4x float32 and 2x
bfloat16; at many rows by the multiply-adds, which 8 bits do not make fewer.

``--part accuracy``: the unquantized engine's completions (greedy, and sampled at
temperature 1 with n=4) of 24 prompts (the arith recipe's questions and grpo-cpu's eight)
teacher-forced through each quantized engine (``quantization="int8"``, ``"fp8"``), in
float32 and bfloat16: on the greedy completions, how often the quantized engine's greedy
choice is the unquantized one's; on both, the mean and largest |Δ log-prob| of the
completions' tokens (the sampler's gap to an unquantized trainer, which the
importance-sampling correction weighs).

``--part learning``: the main job (``recipes/grpo_arith.yaml``, or ``--recipe``) with its
rollouts unquantized, int8 and fp8 (``rollout.quantization``), for each of ``--seeds``: the
rewards and held-out accuracy, the sampler-trainer gap and the seconds per step
(``exact_logprobs.training_row``).

Run::

    python benchmarks/quantized.py --part kernels
    python benchmarks/quantized.py --part accuracy
    python benchmarks/quantized.py --part learning --seeds 0 1
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch
from common import (
    NUM_THREADS,
    load_hf_model,
    model_folder,
    print_table,
    setup_torch,
)
from exact_logprobs import TRAINING_COLUMNS, training_row
from grpo_cpu import GRPO_MESSAGES
from matmul_floor import shape_groups

from tandem.kernels import cpu_linear, quantization
from tandem.rollout import LLM, SamplingParams
from tandem.trainers.tasks import build_task

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "grpo_arith.yaml"
ROWS = (1, 8, 64)
PASSES = 5
ROLES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# weight format -> (activation dtype, how a float32 weight is prepared: panels, scales)
FORMATS: dict[str, tuple[torch.dtype, Callable]] = {
    "float32": (torch.float32, lambda w: (cpu_linear.panel_layout(w), None)),
    "bfloat16": (torch.bfloat16, lambda w: (cpu_linear.panel_layout(w.bfloat16()), None)),
    **{method: (torch.float32, lambda w, m=method: _quantized_panels(w, m))
       for method in quantization.QUANTIZATIONS},
    **{f"{method}, bf16 activations": (torch.bfloat16,
                                        lambda w, m=method: _quantized_panels(w, m))
       for method in quantization.QUANTIZATIONS},
}
ARITH_PROMPTS = 16


def _quantized_panels(weight: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scale = quantization.quantize(weight, method)
    return cpu_linear.panel_layout(codes), scale


def pass_seconds(prepared: list[tuple[torch.Tensor, torch.Tensor | None, int, int]],
                 rows: int, dtype: torch.dtype) -> float:
    """The best of ``PASSES`` timed passes of ``rows`` random rows in ``dtype`` through every
    prepared weight ``(panels, scales, out, in)``, after one untimed pass."""
    inputs = {size: torch.randn(rows, size).to(dtype) for *_, size in prepared}
    best = float("inf")
    for attempt in range(PASSES + 1):
        start = time.perf_counter()
        for panels, scales, out_features, in_features in prepared:
            cpu_linear.panel_linear(inputs[in_features], panels, out_features, None, scales)
        if attempt:
            best = min(best, time.perf_counter() - start)
    return best


def kernel_rows() -> list[tuple[str, ...]]:
    """One line per row count and weight format (see the module docstring)."""
    groups = shape_groups(load_hf_model(model_folder(), "float32"))
    tensors = [weight for role in ROLES for weight in groups[role]]
    lines = [("rows", "weights", "MiB", "ms/pass", "GB/s", "vs float32", "vs bfloat16")]
    for rows in ROWS:
        seconds = {}
        for name, (dtype, prepare) in FORMATS.items():
            prepared = [(*prepare(w), *w.shape) for w in tensors]
            seconds[name] = best = pass_seconds(prepared, rows, dtype)
            weight_bytes = sum(p.numel() * p.element_size() for p, *_ in prepared)
            lines.append((str(rows), name, f"{weight_bytes / 2**20:.1f}", f"{1e3 * best:.2f}",
                          f"{weight_bytes / best / 1e9:.1f}",
                          f"{seconds['float32'] / best:.2f}x",
                          f"{seconds['bfloat16'] / best:.2f}x" if "bfloat16" in seconds
                          else ""))
    return lines


def prompts(llm: LLM) -> list[list[int]]:
    """The arith recipe's first training questions and grpo-cpu's eight, chat-templated."""
    task = build_task("arith")
    conversations = [task.train_example(0, i)["prompt"] for i in range(ARITH_PROMPTS)]
    conversations += [[{"role": "user", "content": message}] for message in GRPO_MESSAGES]
    return [llm.engine.apply_chat_template(conversation) for conversation in conversations]


def teacher_forced(llm: LLM, prompt_ids: list[list[int]], completions) -> tuple[float, ...]:
    """Greedy agreement, mean and largest |Δ log-prob| of ``completions`` (each with its
    prompt) through ``llm``."""
    outputs = llm.generate([p + c.token_ids for p, c in completions],
                           SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    same, gaps = [], []
    for (prompt, completion), out in zip(completions, outputs):
        for token, logprob, scores in zip(completion.token_ids, completion.logprobs,
                                          out.prompt_logprobs[len(prompt):]):
            same.append(max(scores, key=scores.get) == token)
            gaps.append(abs(scores[token] - logprob))
    return sum(same) / len(same), sum(gaps) / len(gaps), max(gaps)


def accuracy_rows() -> list[tuple[str, ...]]:
    """One line per dtype, format and sampling (see the module docstring)."""
    folder = model_folder()
    samplings = {"greedy": SamplingParams(temperature=0, max_tokens=64, logprobs=0),
                 "sampled": SamplingParams(temperature=1.0, n=4, seed=0, max_tokens=64,
                                           logprobs=0)}
    lines = [("dtype", "weights", "completions", "tokens", "greedy agreement",
              "mean |Δ log-prob|", "max |Δ log-prob|")]
    for dtype in ("float32", "bfloat16"):
        plain = LLM(str(folder), dtype=dtype)
        prompt_ids = prompts(plain)
        references = {name: [(p, c) for p, out in zip(prompt_ids, plain.generate(
            prompt_ids, params, use_tqdm=False)) for c in out.outputs]
            for name, params in samplings.items()}
        del plain
        for method in quantization.QUANTIZATIONS:
            llm = LLM(str(folder), dtype=dtype, quantization=method)
            for name, completions in references.items():
                agreement, mean, largest = teacher_forced(llm, prompt_ids, completions)
                tokens = sum(len(c.token_ids) for _, c in completions)
                lines.append((dtype, method, name, str(tokens),
                              f"{agreement:.4f}" if name == "greedy" else "",
                              f"{mean:.4f}", f"{largest:.3f}"))
    return lines


def learning_rows(recipe: str, seeds: list[int], methods: list[str]) -> list[tuple[str, ...]]:
    """The recipe trained with each of ``methods`` (``"none"``: unquantized rollouts), one
    row per (seed, method)."""
    rows = [("weights", "seed", *TRAINING_COLUMNS)]
    for seed in seeds:
        for method in methods:
            setting = "null" if method == "none" else method
            rows.append((method, str(seed), *training_row(
                recipe, [f"seed={seed}", f"rollout.quantization={setting}"])))
            print_table(rows)
    return rows


def main() -> None:
    """Run the part asked for and print its table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("kernels", "accuracy", "learning"), required=True)
    parser.add_argument("--recipe", default=str(RECIPE),
                        help="the recipe of --part learning")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--methods", nargs="+", choices=("none", *quantization.QUANTIZATIONS),
                        default=["none", *quantization.QUANTIZATIONS],
                        help="the rollouts' weights in --part learning")
    args = parser.parse_args()
    setup_torch()
    print(f"quantized {args.part}: SmolLM2-135M-Instruct, threads={NUM_THREADS}")
    if args.part == "learning":
        learning_rows(args.recipe, args.seeds, args.methods)
    else:
        print_table(kernel_rows() if args.part == "kernels" else accuracy_rows())


if __name__ == "__main__":
    main()
