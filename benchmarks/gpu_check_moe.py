"""The GPU check's mixture-of-experts section (issue 41): the Triton grouped experts
(``kernels/triton_moe.py``) at Qwen3-30B-A3B's layer shape (128 experts, top 8, hidden
2048, expert intermediate 768) in bfloat16, per token count: the error against a float64
reference, whether token 0 keeps its bits alone and among the others, the seconds against
the torch path (one ``F.linear`` per expert, the engine's fallback) and tokens/s.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from gpu_check_common import Recorder, seconds_per_call

from tandem.kernels import layers
from tandem.kernels.testing import TOLERANCE, relative_error

SHAPE = dict(experts=128, top_k=8, hidden=2048, intermediate=768)
TOY = dict(experts=4, top_k=2, hidden=32, intermediate=16)
TOKENS = (1, 64, 512)


def torch_experts(x, gate_up, down, experts, weights) -> torch.Tensor:
    """The engine's torch path: grouped by expert, one ``F.linear`` per expert."""
    out = torch.zeros_like(x)
    for expert in experts.unique().tolist():
        rows, slots = (experts == expert).nonzero(as_tuple=True)
        gate, up = F.linear(x[rows], gate_up[expert]).chunk(2, dim=-1)
        hidden = F.linear(F.silu(gate) * up, down[expert])
        out.index_add_(0, rows, hidden * weights[rows, slots, None].to(x.dtype))
    return out


def check_moe(rec: Recorder) -> None:
    """Error, row invariance and speed per token count (see the module docstring)."""
    from tandem.kernels import triton_moe

    device = rec.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = TOY if rec.smoke else SHAPE
    generator = torch.Generator(device=device).manual_seed(0)
    e, k, h, i = shape["experts"], shape["top_k"], shape["hidden"], shape["intermediate"]
    gate_up = (torch.randn(e, 2 * i, h, device=device, generator=generator) / h ** 0.5).to(dtype)
    down = (torch.randn(e, h, i, device=device, generator=generator) / i ** 0.5).to(dtype)
    for tokens in (1, 8) if rec.smoke else TOKENS:
        x = torch.randn(tokens, h, device=device, generator=generator).to(dtype)
        logits = torch.randn(tokens, e, device=device, generator=generator)
        weights, experts = torch.softmax(logits, -1).topk(k, dim=-1)
        fused = functools.partial(triton_moe.fused_moe, x, gate_up, down, experts, weights,
                                  layers.silu_and_mul)
        out = fused()
        reference = torch_experts(x.double(), gate_up.double(), down.double(), experts,
                                  weights.double())
        alone = triton_moe.fused_moe(x[:1], gate_up, down, experts[:1], weights[:1],
                                     layers.silu_and_mul)
        error = relative_error(out, reference)
        repeats = 2 if rec.smoke else 20
        seconds = seconds_per_call(fused, repeats)
        loop = seconds_per_call(functools.partial(torch_experts, x, gate_up, down, experts,
                                                  weights), repeats)
        rec.record("moe", "fused experts", tokens=tokens, rel_error=error,
                   row_invariant=torch.equal(alone, out[:1]), seconds=round(seconds, 6),
                   torch_over_fused=round(loop / seconds, 2),
                   tok_per_s=round(tokens / seconds), ok=error < 4 * TOLERANCE[dtype])
