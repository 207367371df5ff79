"""The FP8 KV cache (``kv_cache_dtype="fp8"``) on the embedded SmolLM2-135M-Instruct: how many
blocks and tokens the same pool bytes hold, and what the rounding costs in accuracy.

Capacity: one engine per pool dtype at the CPU default pool (1 GiB, or ``--pool-mib``):
float32 and bfloat16 models with ``kv_cache_dtype="auto"`` and the FP8 pool; the blocks and
tokens are the engines' own (``num_kv_blocks``), the bytes their ``kv_cache_bytes``.

Accuracy, per model dtype (float32, bfloat16): ``--prompts`` chat prompts, each a question
of its own, greedy to ``--max-tokens`` tokens (EOS ignored) on the unquantized engine; then
the FP8 engine scores those very sequences (``prompt_logprobs=1``: teacher forcing):

- ``top-1 agreement``: the share of completion positions where the FP8 engine's most likely
  token is the unquantized engine's greedy token;
- ``mean |d logprob|`` and ``max``: the difference of the two engines' log-probs of the
  unquantized engine's tokens, in nats;
- ``same completions``: free-running greedy, the completions the FP8 engine generates alike,
  and ``tokens before divergence``: the mean share of each completion generated alike up to
  the first difference.

A second row per dtype, ``fp8 calibrated``, sets the FP8 engine's scales to each layer's and
KV head's largest |K| and |V| over the unquantized engine's pool after its run, divided by
448 (what calibrating on these very prompts would give), to measure what the fixed scales
of 1.0 (``kernels/fp8_kv.py`` says why) give up. A last row sets the scale of the effect: a
bfloat16 model (its pool bfloat16) along the float32 one, with no FP8 at all.

Run::

    python benchmarks/kv_cache_fp8.py [--prompts 16] [--max-tokens 64] [--pool-mib 1024]
"""

from __future__ import annotations

import argparse

import torch
from common import DTYPES, chat_prompt_ids, model_folder, print_table, setup_torch

from tandem.kernels.fp8_kv import FP8_MAX
from tandem.rollout import LLM, SamplingParams

QUESTIONS = [
    "What is 17*4?", "Name three primary colors.", "Write a haiku about the sea.",
    "What is the capital of France?", "Explain photosynthesis in one sentence.",
    "How many legs does a spider have?", "Give me a synonym for happy.",
    "What is 123 + 456?", "Translate 'good morning' into Spanish.",
    "Why is the sky blue?", "List the first five prime numbers.",
    "What does a CPU do?", "Write one sentence about cats.", "What is 2 to the power 10?",
    "Who wrote Romeo and Juliet?", "Describe a rainbow in a few words.",
    "What is the boiling point of water in Celsius?", "Suggest a name for a pet turtle.",
    "What is the opposite of cold?", "How many days are in a leap year?",
]


def parse_args() -> argparse.Namespace:
    """Parse the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16, help="prompts (at most 20)")
    parser.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--pool-mib", type=int, default=1024,
                        help="pool bytes of the capacity table (default: the CPU default)")
    return parser.parse_args()


def capacity(pool_bytes: int) -> list[tuple[str, ...]]:
    """Each pool dtype's blocks and tokens in ``pool_bytes``, from the engines themselves."""
    rows = [("model dtype", "kv_cache_dtype", "pool", "bytes/token", "blocks", "tokens",
             "x float32")]
    float32_tokens = 0
    for dtype, kv_cache_dtype in (("float32", "auto"), ("bfloat16", "auto"),
                                  ("float32", "fp8")):
        llm = LLM(str(model_folder()), dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                  kv_cache_memory_bytes=pool_bytes)
        engine = llm.engine
        tokens = engine.num_kv_blocks * engine.config.block_size
        float32_tokens = float32_tokens or tokens
        rows.append((dtype, kv_cache_dtype, str(engine.runner.kv_cache.dtype).removeprefix(
            "torch."), str(llm.stats()["kv_cache_bytes"] // tokens), str(engine.num_kv_blocks),
            str(tokens), f"{tokens / float32_tokens:.1f}"))
    return rows


def prompts(llm: LLM, count: int) -> list[list[int]]:
    """The first ``count`` questions as chat prompts (token ids)."""
    return [chat_prompt_ids(llm.get_tokenizer(), question) for question in QUESTIONS[:count]]


def pool_scales(llm: LLM) -> torch.Tensor:
    """Each layer's and KV head's largest |K| and |V| in the engine's pool over 448:
    ``[2, layers, kv_heads]``, the scales calibrating on what it computed would give."""
    pool = llm.engine.runner.kv_cache.float().abs()  # [2, layers, blocks, tokens, heads, dim]
    return pool.amax(dim=(2, 3, 5)) / FP8_MAX


def accuracy(reference: LLM, llm: LLM, prompt_ids: list[list[int]],
             max_tokens: int) -> tuple[str, ...]:
    """``llm`` along ``reference``'s greedy completions (see the module docstring)."""
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    expected = [o.outputs[0] for o in reference.generate(prompt_ids, greedy, use_tqdm=False)]
    scored = llm.generate([p + c.token_ids for p, c in zip(prompt_ids, expected)],
                          SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    agree, differences = [], []
    for prompt, completion, output in zip(prompt_ids, expected, scored):
        for j, (token, logprob) in enumerate(zip(completion.token_ids, completion.logprobs)):
            entry = output.prompt_logprobs[len(prompt) + j]
            agree.append(max(entry, key=entry.get) == token)
            differences.append(abs(entry[token] - logprob))
    generated = [o.outputs[0].token_ids for o in llm.generate(prompt_ids, greedy,
                                                              use_tqdm=False)]
    alike = [next((i for i, (a, b) in enumerate(zip(c.token_ids, g)) if a != b), max_tokens)
             for c, g in zip(expected, generated)]
    return (f"{sum(agree) / len(agree):.4f}", f"{sum(differences) / len(differences):.4f}",
            f"{max(differences):.3f}", f"{sum(a == max_tokens for a in alike)}/{len(alike)}",
            f"{sum(alike) / (max_tokens * len(alike)):.3f}")


def accuracy_rows(dtype: str, count: int, max_tokens: int) -> list[tuple[str, ...]]:
    """The FP8 engine at scale 1.0 and at scales calibrated on these prompts, against the
    unquantized engine, in ``dtype``."""
    reference = LLM(str(model_folder()), dtype=dtype)
    prompt_ids = prompts(reference, count)
    fp8 = LLM(str(model_folder()), dtype=dtype, kv_cache_dtype="fp8")
    rows = [(dtype, "fp8 (scales 1.0)", *accuracy(reference, fp8, prompt_ids, max_tokens))]
    fp8.engine.runner.kv_scales.copy_(pool_scales(reference))
    fp8.reset_prefix_cache()  # its blocks hold K and V of the old scales
    rows.append((dtype, "fp8 calibrated", *accuracy(reference, fp8, prompt_ids, max_tokens)))
    return rows


def main() -> None:
    args = parse_args()
    setup_torch()
    print_table(capacity(args.pool_mib << 20))
    print()
    rows = [("model dtype", "KV pool", "top-1 agreement", "mean |d logprob|", "max",
             "same completions", "tokens before divergence")]
    for dtype in DTYPES:
        rows += accuracy_rows(dtype, args.prompts, args.max_tokens)
    reference = LLM(str(model_folder()), dtype="float32")
    bfloat16 = LLM(str(model_folder()), dtype="bfloat16")
    rows.append(("bfloat16 along float32", "auto", *accuracy(
        reference, bfloat16, prompts(reference, args.prompts), args.max_tokens)))
    print_table(rows)


if __name__ == "__main__":
    main()
