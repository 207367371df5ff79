"""What exact log-probs cost and give: the engine and the trainer with ``exact_logprobs`` on
and off, on the grpo-cpu workload (``grpo_cpu.py``: the embedded SmolLM2-135M-Instruct, 8
chat prompts x n=8, at most 64 tokens, 2 threads).

- ``rollout``: the engine's generated tok/s with its batch-invariant kernels (the panels
  for every linear layer) against the same engine in the layout timed fastest on this
  machine (``exact_logprobs=False``, the fastest non-exact mode), alternating, the median
  of ``--rounds``; the ratio is the issue's bound (at least 0.95x).
- ``trainer``: one GRPO micro-batch's forward and backward over the rollout's 64
  completions, through the engine's kernels (``LLM.exact_forward``) and through
  transformers, with each one's largest gap to the engine's sampled log-probs
  (exact: 0.0 bit for bit) and its seconds.

With ``--recipe``, training runs instead: the recipe with ``exact_logprobs`` on and off for
each of ``--seeds``, one row each: the largest ``sampler_logprob_diff_max`` over the steps,
the least ``sampler_logprob_exact_fraction``, the mean rollout and training seconds per step
(and each over the first and second half of the steps), the mean reward over the first and
last two steps, and the held-out accuracy before and after.

Run::

    python benchmarks/exact_logprobs.py [--dtype float32] [--rounds 3]
    python benchmarks/exact_logprobs.py --recipe recipes/grpo_arith.yaml --seeds 0 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import model_folder, print_table, setup_torch
from grpo_cpu import build_workload

from tandem.rollout import LLM, SamplingParams
from tandem.trainers.policy import completion_logprobs, token_batch


def rollout_rows(dtype: str, rounds: int) -> tuple[list[tuple[str, ...]], tuple]:
    """The rollout table and the exact engine's last sampled batch (prompts, completions,
    log-probs) and the engine itself."""
    folder = model_folder()
    work = build_workload(folder, "grpo", None)
    params = SamplingParams(n=work.n, temperature=1.0, max_tokens=work.max_tokens, logprobs=0,
                            seed=0)
    engines = {exact: LLM(str(folder), dtype=dtype, exact_logprobs=exact)
               for exact in (True, False)}
    rates = {exact: [] for exact in engines}
    sampled = None
    for round_index in range(rounds + 1):
        for exact, llm in engines.items():
            llm.reset_prefix_cache()
            start = time.perf_counter()
            outputs = llm.generate(work.prompt_ids, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            if round_index:  # the first round warms up
                rates[exact].append(sum(len(c.token_ids) for o in outputs for c in o.outputs)
                                    / seconds)
            if exact:
                sampled = [(p, c.token_ids, c.logprobs)
                           for p, o in zip(work.prompt_ids, outputs) for c in o.outputs]
    timed = statistics.median(rates[False])
    rows = [("rollout", "layout", "tok/s", "of fastest non-exact")]
    for exact, llm in engines.items():
        rate = statistics.median(rates[exact])
        rows.append(("exact" if exact else "timed (not exact)",
                     str(llm.engine.runner.model.linear_layout), f"{rate:.0f}",
                     f"{rate / timed:.2f}x"))
    return rows, (sampled, engines[True])


def trainer_rows(dtype: str, sampled: list, llm: LLM, rounds: int) -> list[tuple[str, ...]]:
    """One forward and backward of the rollout's completions through each forward pass."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_folder(), dtype=getattr(torch, dtype))
    prompts, completions, logprobs = (list(column) for column in zip(*sampled))
    batch = token_batch(prompts, completions, 0)
    width = batch.num_completion_slots
    expected = torch.tensor([row + [0.0] * (width - len(row)) for row in logprobs])
    rows = [("trainer pass", "forward s", "forward+backward s", "largest gap to the sampler")]
    for name, forward in (("engine kernels (exact)", llm.exact_forward(model)),
                          ("transformers", model)):
        forwards, totals = [], []
        for round_index in range(rounds + 1):  # the first warms up, untimed
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            scored, _, _ = completion_logprobs(forward, batch, 1.0)
            forwards.append(time.perf_counter() - start)
            (scored * batch.completion_mask).sum().backward()
            totals.append(time.perf_counter() - start)
            if not round_index:
                forwards.clear()
                totals.clear()
        gap = ((scored.detach() - expected) * batch.completion_mask).abs().max().item()
        rows.append((name, f"{statistics.median(forwards):.2f}",
                     f"{statistics.median(totals):.2f}", f"{gap:.1e}"))
    return rows


TRAINING_COLUMNS = ("steps", "diff max", "exact fraction min", "rollout s/step",
                    "train s/step (halves)", "reward first 2 / last 2",
                    "accuracy before / after")


def training_row(recipe: str, overrides: list[str]) -> tuple[str, ...]:
    """``trained_row`` in a fresh process, as ``tandem train`` runs: a run after another in
    one process finds its memory already mapped, and skips the page faults of the first
    steps that a user's run pays."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(trained_row, recipe, overrides).result()


def trained_row(recipe: str, overrides: list[str]) -> tuple[str, ...]:
    """One training run of ``recipe`` with ``overrides`` (in a scratch output folder, no
    W&B): the largest ``sampler_logprob_diff_max`` over the steps, the least
    ``sampler_logprob_exact_fraction``, the mean rollout and training seconds per step (and
    each over the first and second half of the steps), the mean reward over the first and
    last two steps, and the held-out accuracy before and after (``TRAINING_COLUMNS``)."""
    import tempfile

    from tandem.trainers.config import load_config
    from tandem.trainers.trainer import Trainer

    with tempfile.TemporaryDirectory() as out:
        config = load_config(recipe, [*overrides, f"output_dir={out}", "logging.wandb=false",
                                      "logging.progress_bar=false"])
        summary = Trainer(config).train()
    steps = summary["history"]
    half = len(steps) // 2
    train = [m["train_seconds"] for m in steps]
    rewards = [m["reward"] for m in steps]
    return (str(len(steps)),
            f"{max(m['sampler_logprob_diff_max'] for m in steps):.1e}",
            f"{min(m['sampler_logprob_exact_fraction'] for m in steps):.3f}",
            f"{statistics.mean(m['rollout_seconds'] for m in steps):.2f}",
            f"{statistics.mean(train):.2f} ({statistics.mean(train[:half]):.2f} / "
            f"{statistics.mean(train[half:]):.2f})",
            f"{statistics.mean(rewards[:2]):.3f} / {statistics.mean(rewards[-2:]):.3f}",
            f"{summary['before'].get('accuracy', float('nan')):.3f} / "
            f"{summary['after'].get('accuracy', float('nan')):.3f}")


def recipe_rows(recipe: str, seeds: list[int], overrides: list[str]) -> list[tuple[str, ...]]:
    """One training run per (seed, exact on / off) of ``recipe`` (``training_row``)."""
    rows = [("exact", "seed", *TRAINING_COLUMNS)]
    for seed in seeds:
        for exact in (True, False):
            rows.append(("on" if exact else "off", str(seed), *training_row(
                recipe, [*overrides, f"seed={seed}", f"exact_logprobs={str(exact).lower()}"])))
            print_table(rows)
    return rows


def main() -> None:
    """Print both tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--recipe", default=None, help="training runs of this recipe instead")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("overrides", nargs="*", help="recipe overrides (key=value)")
    args = parser.parse_args()
    setup_torch()
    if args.recipe:
        print(f"{args.recipe} {' '.join(args.overrides)}, {torch.get_num_threads()} threads")
        recipe_rows(args.recipe, args.seeds, args.overrides)
        return
    print(f"grpo workload, {args.dtype}, {torch.get_num_threads()} threads, "
          f"median of {args.rounds} rounds")
    rows, (sampled, llm) = rollout_rows(args.dtype, args.rounds)
    print_table(rows)
    print_table(trainer_rows(args.dtype, sampled, llm, args.rounds))


if __name__ == "__main__":
    main()
