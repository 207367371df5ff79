"""Which of the engine's CPU operations give a row the same bits whatever rows share its step
(exact on-policy log-probs, issue 40, need every operation on a token's path to be
batch-invariant).

For each operation and dtype, a fixed random row is computed alone and then as row 0 of a
batch of M random rows, for M in ``--rows``; the table gives, per M, whether row 0's output is
bitwise the same as alone, and the largest absolute difference:

- linear, in each CPU layout (``kernels/cpu_linear.py``): ``F.linear`` on row-major weights,
  ``"transposed"``, ``"onednn"`` (in float32 with the panels up to ``PANEL_ROWS`` rows) and
  ``"panels"``, at a Qwen3-0.6B projection's shape (1024 in, 3072 out) and its LM head's
  (1024 in, 151,936 out: ``--lm-head``);
- RMSNorm and log-softmax, the row reductions of the layer and the sampler.

The engine end to end is the other half: a completion's log-probs sampled alone against the
same seeded completion inside a batch, and against the engine's own prefill scoring of the
same tokens (``prompt_logprobs``): ``--engine`` over the embedded model, with the engine's
batch-invariant kernels (``exact_logprobs``, the default on CPU) or, ``--not-exact``, this
machine's timed layout. What exactness costs is ``exact_logprobs.py``'s.

Run::

    python benchmarks/batch_invariance.py
    python benchmarks/batch_invariance.py --engine --dtype bfloat16
    python benchmarks/batch_invariance.py --engine --not-exact
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from common import print_table, setup_torch
from torch import nn

from tandem.kernels import cpu_linear

Op = Callable[[torch.Tensor], torch.Tensor]


def linear_ops(in_features: int, out_features: int, dtype: torch.dtype) -> dict[str, Op]:
    """``x W^T`` in every layout this machine offers for ``dtype``, one random W."""
    torch.manual_seed(0)
    layer = nn.Linear(in_features, out_features, bias=False, dtype=dtype).requires_grad_(False)
    ops: dict[str, Op] = {"F.linear": lambda x: F.linear(x, layer.weight)}
    transposed = cpu_linear.column_major(layer.weight)
    ops["transposed"] = lambda x: F.linear(x, transposed)
    for layout in cpu_linear.candidate_layouts(dtype):
        if layout in cpu_linear.COPIES:
            ops[layout] = cpu_linear.PackedWeight([layer], layout)
    return ops


def row_ops(width: int, dtype: torch.dtype) -> dict[str, Op]:
    """The per-row reductions: RMSNorm (as the engine's torch reference computes it) and
    log-softmax in float32."""
    weight = torch.rand(width, dtype=dtype) + 0.5

    def rms_norm(x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype) * weight

    return {"rms_norm": rms_norm, "log_softmax": lambda x: torch.log_softmax(x.float(), -1)}


def invariance(op: Op, width: int, dtype: torch.dtype, rows: list[int]) -> list[str]:
    """Per M of ``rows``: "=" when row 0 of an M-row batch equals the row alone bit for bit,
    else the largest absolute difference."""
    generator = torch.Generator().manual_seed(1)
    first = torch.randn(1, width, generator=generator).to(dtype)
    alone = op(first)
    cells = []
    for count in rows:
        batch = torch.cat([first, torch.randn(count - 1, width, generator=generator).to(dtype)])
        row = op(batch)[:1]
        cells.append("=" if torch.equal(row, alone)
                     else f"{(row.float() - alone.float()).abs().max().item():.1e}")
    return cells


def kernel_table(args: argparse.Namespace, dtype: torch.dtype) -> list[tuple[str, ...]]:
    """One row per operation: its name, shape and the cells of ``invariance``."""
    out_features = 151_936 if args.lm_head else 3072
    table = [("operation", "shape", *(f"M={m}" for m in args.rows))]
    for name, op in linear_ops(1024, out_features, dtype).items():
        table.append((f"linear {name}", f"1024x{out_features}",
                      *invariance(op, 1024, dtype, args.rows)))
    for name, op in row_ops(1024, dtype).items():
        table.append((name, "1024", *invariance(op, 1024, dtype, args.rows)))
    return table


def engine_rows(dtype: str, exact: bool = True) -> list[tuple[str, ...]]:
    """The embedded model's seeded completion alone, in a batch of 8, and rescored by
    prefill: how many of its log-probs are bitwise equal, and the largest gap, with the
    engine's batch-invariant kernels (``exact_logprobs``) or without (the timed layout)."""
    from tandem.rollout import LLM, SamplingParams

    llm = LLM("smollm2-135m-instruct", dtype=dtype, max_model_len=512, exact_logprobs=exact)
    prompt = llm.get_tokenizer().encode("Write a short poem about the sea.")
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=24, logprobs=0, ignore_eos=True)
    alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    others = [llm.get_tokenizer().encode(f"Count to {i}.") for i in range(7)]
    batch = llm.generate([prompt, *others], [params] + [SamplingParams(max_tokens=24)] * 7,
                         use_tqdm=False)[0].outputs[0]
    scored = llm.generate([prompt + alone.token_ids], SamplingParams(
        max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0].prompt_logprobs
    rescored = [entry[token] for entry, token in
                zip(scored[len(prompt):], alone.token_ids)]

    def compare(name: str, tokens: list[int], logprobs: list[float]) -> tuple[str, ...]:
        same_tokens = next((i for i, (a, b) in enumerate(zip(tokens, alone.token_ids))
                            if a != b), len(tokens))
        pairs = list(zip(logprobs[:same_tokens], alone.logprobs[:same_tokens]))
        equal = sum(a == b for a, b in pairs)
        gap = max((abs(a - b) for a, b in pairs), default=0.0)
        return (name, dtype, f"{same_tokens}/{len(alone.token_ids)}", f"{equal}/{len(pairs)}",
                f"{gap:.1e}")

    name = "engine, exact_logprobs" if exact else "engine, timed layout"
    return [(name, "dtype", "same tokens", "bitwise log-probs", "largest gap"),
            compare("in a batch of 8", batch.token_ids, batch.logprobs),
            compare("prefill rescoring", alone.token_ids, rescored)]


def main() -> None:
    """Print the kernels' table (and with ``--engine`` the engine's)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--rows", type=int, nargs="+", default=[2, 7, 16, 17, 64, 256])
    parser.add_argument("--lm-head", action="store_true",
                        help="the LM head's shape (151,936 outputs) instead of a projection's")
    parser.add_argument("--engine", action="store_true",
                        help="also the embedded model's engine end to end")
    parser.add_argument("--not-exact", action="store_true",
                        help="with --engine: exact_logprobs off (this machine's timed layout)")
    args = parser.parse_args()
    setup_torch()
    dtype = getattr(torch, args.dtype)
    print(f"row 0 of an M-row batch against the row alone ({args.dtype}, "
          f"{torch.get_num_threads()} threads): '=' bitwise, else the largest difference")
    print_table(kernel_table(args, dtype))
    if args.engine:
        print_table(engine_rows(args.dtype, not args.not_exact))


if __name__ == "__main__":
    main()
