"""The GPU check's quantized section (issue 42): 8-bit weights on the device.

- The Triton 8-bit matmul (``triton_linear.linear`` with codes and scales) at Qwen3-0.6B's
  MLP shape, per row count: the error against float64 on the dequantized weight, whether row
  0 keeps its bits alone and among the others, and the seconds against cuBLAS on the
  bfloat16 weight. int8 always; fp8 where the device converts it (compute capability 8.9+),
  else recorded as refused with the engine's own message.
- The engine: decode tokens/s at batch 1 and 64, each quantized engine against the
  unquantized one built on the same folder, and the unquantized engine's greedy completions
  teacher-forced through the quantized one (how often its greedy choice agrees, and the
  mean |Δ log-prob| of the completion's tokens).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_check_common import Recorder, collect, make_llm, seconds_per_call
from gpu_check_throughput import decode_tok_s

from tandem.kernels import quantization, select_kernels
from tandem.kernels.dispatch import check_quantized
from tandem.kernels.testing import TOLERANCE, relative_error
from tandem.rollout import LLM, SamplingParams

MLP = (1024, 3072)  # Qwen3-0.6B's gate/up: in, out
ROWS = (1, 64, 512)


def check_quantized_section(rec: Recorder, folder: Path) -> None:
    """The kernel, then the engine (see the module docstring)."""
    methods = [method for method in quantization.QUANTIZATIONS if runs(rec, method)]
    for method in methods:
        check_matmul(rec, method)
    check_engine(rec, folder, methods)


def runs(rec: Recorder, method: str) -> bool:
    """Whether the device multiplies ``method``'s weights; a refusal is recorded."""
    try:
        check_quantized(select_kernels("auto" if rec.device.type == "cuda" else "triton",
                                       rec.device), rec.device, method)
    except ValueError as refusal:
        rec.record("quantized", f"{method} refused", reason=str(refusal),
                   ok=method == "fp8")  # fp8 below compute capability 8.9 is refused
        return False
    return True


def check_matmul(rec: Recorder, method: str) -> None:
    """Error, row invariance and seconds against cuBLAS per row count."""
    from tandem.kernels import triton_linear

    device, dtype = rec.device, torch.bfloat16 if rec.device.type == "cuda" else torch.float32
    in_features, out_features = (64, 96) if rec.smoke else MLP
    generator = torch.Generator(device=device).manual_seed(0)
    weight = torch.randn(out_features, in_features, device=device, generator=generator) \
        / in_features ** 0.5
    codes, scale = quantization.quantize(weight, method)
    served = codes.double() * scale.double()[:, None]
    plain = weight.to(dtype)
    for rows in (1, 8) if rec.smoke else ROWS:
        x = torch.randn(rows, in_features, device=device, generator=generator).to(dtype)
        out = triton_linear.linear(x, codes, None, scale)
        error = relative_error(out, x.double() @ served.t())
        alone = torch.equal(triton_linear.linear(x[:1], codes, None, scale), out[:1])
        repeats = 3 if rec.smoke else 50
        seconds = seconds_per_call(functools.partial(triton_linear.linear, x, codes, None,
                                                     scale), repeats)
        cublas = seconds_per_call(functools.partial(F.linear, x, plain), repeats)
        rec.record("quantized", f"{method} matmul {out_features}x{in_features}", rows=rows,
                   rel_error=error, row_invariant=alone, seconds=round(seconds, 7),
                   cublas_bf16_over_8_bit=round(cublas / seconds, 2),
                   ok=error < 4 * TOLERANCE[dtype] and alone)


def check_engine(rec: Recorder, folder: Path, methods: list[str]) -> None:
    """Decode tokens/s and accuracy of each quantized engine against the unquantized one."""
    prompts = [[(13 * i + j) % 500 + 2 for j in range(16 + 5 * i)] for i in range(8)]
    greedy = SamplingParams(temperature=0, max_tokens=8 if rec.smoke else 64, logprobs=0,
                            ignore_eos=True)
    plain = make_llm(rec, folder)
    reference = [o.outputs[0] for o in plain.generate(prompts, greedy, use_tqdm=False)]
    batches = (1, 4) if rec.smoke else (1, 64)
    steps = 4 if rec.smoke else 64
    baseline = {batch: decode_tok_s(plain, batch, steps) for batch in batches}
    del plain
    collect()
    for method in methods:
        llm = make_llm(rec, folder, quantization=method)
        agreement, gap = teacher_forced(llm, prompts, reference)
        rec.record("quantized", f"{method} engine against the unquantized one",
                   greedy_agreement=round(agreement, 4), mean_abs_logprob_gap=round(gap, 5),
                   ok=agreement > 0.5)
        for batch in batches:
            tok_s = decode_tok_s(llm, batch, steps)
            rec.record("quantized", f"{method} decode tok/s, batch {batch}",
                       quantized=round(tok_s), unquantized=round(baseline[batch]),
                       ratio=round(tok_s / baseline[batch], 2))
        del llm
        collect()


def teacher_forced(llm: LLM, prompts: list[list[int]], reference) -> tuple[float, float]:
    """The fraction of ``reference``'s tokens that are ``llm``'s greedy choice given the
    tokens before them, and the mean |Δ log-prob| of those tokens."""
    outputs = llm.generate([p + r.token_ids for p, r in zip(prompts, reference)],
                           SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    same, gaps = [], []
    for prompt, ref, out in zip(prompts, reference, outputs):
        for token, logprob, scores in zip(ref.token_ids, ref.logprobs,
                                          out.prompt_logprobs[len(prompt):]):
            same.append(max(scores, key=scores.get) == token)
            gaps.append(abs(scores[token] - logprob))
    return sum(same) / len(same), sum(gaps) / len(gaps)
