"""The GPU check's exact log-probs section (issue 40): the batch-invariant Triton matmul
against cuBLAS (``F.linear``), and the engine with ``exact_logprobs`` on the device.

- ``matmul``: per row count M at Qwen3-0.6B's MLP shape (1024 -> 3072, 3072 -> 1024),
  whether row 0 has the same bits alone and among M rows, for the Triton kernel and for
  ``F.linear``, and the Triton kernel's seconds over cuBLAS's (the cost of exactness).
- ``engine``: decode tok/s at batch 64 with ``exact_logprobs`` on over off; a seeded
  completion's log-probs alone, in a batch of 8 and rescored by prefill (bitwise counts);
  and the trainer's forward through the engine's kernels (``LLM.exact_forward``) against
  the engine's sampled log-probs: the largest gap (0.0 is exact) and the bitwise fraction.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_check_common import Recorder, load_hf_model, make_llm, seconds_per_call
from gpu_check_throughput import decode_tok_s

from tandem.rollout import LLM, SamplingParams
from tandem.trainers.policy import completion_logprobs, token_batch

ROWS = (1, 8, 64, 256, 2048)
SHAPES = {"up 1024->3072": (1024, 3072), "down 3072->1024": (3072, 1024)}


def check_exact(rec: Recorder, folder: Path) -> None:
    """Both halves (see the module docstring)."""
    check_matmul(rec)
    check_engine(rec, folder)


def check_matmul(rec: Recorder) -> None:
    """Row 0's bits alone and among M rows, and the seconds against cuBLAS."""
    from tandem.kernels import triton_linear

    device, dtype = rec.device, torch.bfloat16 if rec.device.type == "cuda" else torch.float32
    rows = (1, 8, 33) if rec.smoke else ROWS
    for name, (in_features, out_features) in SHAPES.items():
        if rec.smoke:
            in_features, out_features = in_features // 32, out_features // 32
        weight = torch.randn(out_features, in_features, device=device).to(dtype)
        for count in rows:
            x = torch.randn(count, in_features, device=device).to(dtype)
            same, seconds = {}, {}
            for label, linear in (("triton", triton_linear.linear), ("cublas", F.linear)):
                same[label] = torch.equal(linear(x, weight)[:1], linear(x[:1], weight))
                seconds[label] = seconds_per_call(functools.partial(linear, x, weight),
                                                  3 if rec.smoke else 20)
            rec.record("exact", f"matmul {name}", rows=count, triton_row_invariant=same["triton"],
                       cublas_row_invariant=same["cublas"],
                       triton_over_cublas_s=round(seconds["triton"] / seconds["cublas"], 2),
                       ok=same["triton"])


def check_engine(rec: Recorder, folder: Path) -> None:
    """Decode cost, the engine's own consistency and the trainer's exactness on the device."""
    exact = make_llm(rec, folder, exact_logprobs=True)
    if not rec.smoke:
        plain = make_llm(rec, folder)
        on, off = (decode_tok_s(llm, 64, 32) for llm in (exact, plain))
        del plain
        rec.record("exact", "decode tok/s, batch 64", exact=round(on), not_exact=round(off),
                   ratio=round(on / off, 2))
    prompt = [(11 * j) % 400 + 5 for j in range(40)]
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=24, logprobs=0, ignore_eos=True)
    alone = exact.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    others = [[(5 * i + j) % 300 + 3 for j in range(20 + i)] for i in range(7)]
    batch = exact.generate([prompt, *others], [params] + [SamplingParams(max_tokens=24)] * 7,
                           use_tqdm=False)[0].outputs[0]
    scored = exact.generate([prompt + alone.token_ids], SamplingParams(
        max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0].prompt_logprobs[len(prompt):]
    rescored = [entry[token] for entry, token in zip(scored, alone.token_ids)]
    rec.record("exact", "engine against itself", tokens=len(alone.token_ids),
               batch_bitwise=sum(a == b for a, b in zip(batch.logprobs, alone.logprobs)),
               prefill_bitwise=sum(a == b for a, b in zip(rescored, alone.logprobs)),
               ok=batch.logprobs == alone.logprobs and rescored == alone.logprobs)
    trainer_against_engine(rec, exact, folder)


def trainer_against_engine(rec: Recorder, llm: LLM, folder: Path) -> None:
    """Sampled log-probs of 16 seeded completions against the trainer's exact forward."""
    prompts = [[(13 * i + j) % 500 + 2 for j in range(16 + 3 * i)] for i in range(4)]
    outputs = llm.generate(prompts, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=32,
                                                   logprobs=0, ignore_eos=True),
                           use_tqdm=False)
    rows = [(p, c.token_ids, c.logprobs) for p, o in zip(prompts, outputs) for c in o.outputs]
    dtype = llm.engine.runner.dtype
    model = load_hf_model(folder, dtype, rec.device)
    batch = token_batch([r[0] for r in rows], [r[1] for r in rows], 0, rec.device)
    with torch.no_grad():
        logprobs, _, _ = completion_logprobs(llm.exact_forward(model), batch, 1.0)
    expected = torch.tensor([r[2] for r in rows], device=rec.device)
    gap = (logprobs - expected).abs().max().item()
    rec.record("exact", "trainer forward against the engine", tokens=expected.numel(),
               largest_gap=gap, bitwise_fraction=round(
                   (logprobs == expected).float().mean().item(), 4), ok=gap == 0.0)
