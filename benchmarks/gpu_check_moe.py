"""The GPU check's mixture-of-experts section (issue 41): the Triton grouped experts
(``kernels/triton_moe.py``) at Qwen3-30B-A3B's layer shape (128 experts, top 8, hidden
2048, expert intermediate 768) in bfloat16, per token count: the error against a float64
reference, whether token 0 keeps its bits alone and among the others, the seconds against
the torch path (one ``F.linear`` per expert, the engine's fallback) and tokens/s.

The ``moe_graphs`` section runs an engine on a random Qwen3-MoE (``QWEN3_MOE``: Qwen3-0.6B's
attention, 4 layers of 128 experts, top 8, expert intermediate 256; saved once by
``moe_folder`` for this section and ``sync_free``) through the fused Triton experts: with
decode graphs (the default) it starts and captures them; its greedy tokens in float32 equal
the eager engine's (8 prompts of one length, so every decode step runs the same batch both
ways); and both engines' decode tokens/s at batch 1 and 64 with overlapped steps on and off.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_check_common import (
    QWEN3_06B,
    Recorder,
    collect,
    make_llm,
    save_random_model,
    seconds_per_call,
)
from gpu_check_common import TOY as TOY_MODEL
from gpu_check_engine import greedy
from gpu_check_throughput import decode_overlap_rows

from tandem.kernels import layers
from tandem.kernels.testing import TOLERANCE, relative_error

SHAPE = dict(experts=128, top_k=8, hidden=2048, intermediate=768)
TOY = dict(experts=4, top_k=2, hidden=32, intermediate=16)
TOKENS = (1, 64, 512)
QWEN3_MOE = QWEN3_06B | dict(num_hidden_layers=4, num_experts=128, num_experts_per_tok=8,
                             moe_intermediate_size=256, norm_topk_prob=True)
TOY_QWEN3_MOE = TOY_MODEL | dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                 norm_topk_prob=True)


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


# ---------------------------------------------------------------- an MoE engine with graphs


def moe_folder(rec: Recorder, work: Path) -> Path:
    """The random Qwen3-MoE model folder (``QWEN3_MOE``; toy-sized with ``--smoke``), saved
    by the first section that asks for it."""
    folder = work / "qwen3-moe-random"
    if not (folder / "tokenizer.json").exists():  # written last
        save_random_model(TOY_QWEN3_MOE if rec.smoke else QWEN3_MOE, folder,
                          torch.float32 if rec.smoke else torch.bfloat16, rec.device)
    return folder


def check_moe_graphs(rec: Recorder, folder: Path) -> None:
    """An MoE engine with decode graphs against the eager one (see the module docstring)."""
    prompts = [[(11 * i + j) % 500 + 2 for j in range(24)] for i in range(8)]
    tokens = {}
    for mode, eager in (("graphs", False), ("eager", True)):
        llm = make_llm(rec, folder, dtype="float32", enforce_eager=eager, max_num_seqs=16)
        if not eager:
            stats = llm.stats()
            rec.record("moe_graphs", "engine with graphs starts",
                       graphs=stats["num_decode_graphs"],
                       capture_seconds=round(stats["graph_capture_seconds"], 2),
                       ok=stats["num_decode_graphs"] > 0 if rec.device.type == "cuda" else None)
        tokens[mode] = greedy(llm, prompts, 4 if rec.smoke else 32)
        del llm
        collect()
    equal = sum(a == b for a, b in zip(tokens["graphs"], tokens["eager"]))
    rec.record("moe_graphs", "greedy tokens, graphs = eager (float32)",
               equal_sequences=f"{equal}/{len(prompts)}", ok=equal == len(prompts))
    for mode, eager in (("graphs", False), ("eager", True)):
        llm = make_llm(rec, folder, enforce_eager=eager, max_num_seqs=16 if rec.smoke else 64)
        decode_overlap_rows(rec, "moe_graphs", f"{mode} decode tok/s", llm)
        del llm
        collect()
