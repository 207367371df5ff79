"""The Triton mixture-of-experts kernels in the interpreter: the padded layout by expert,
the fused experts against a float64 reference, a token's bits in any batch, and the engine
on them against transformers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.kernels import layers, triton_moe
from tandem.kernels.testing import TOLERANCE, relative_error
from tandem.rollout import LLM, SamplingParams

from .test_models import hf_greedy
from .test_moe import PROMPTS, moe_dirs, reference  # noqa: F401 - a fixture


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 12), st.integers(1, 3), st.integers(3, 6), st.sampled_from([4, 8]),
       st.randoms(use_true_random=False))
def test_the_layout_groups_every_pair_under_its_experts_block(tokens, top_k, experts, block,
                                                               rng):
    chosen = torch.tensor([rng.sample(range(experts), top_k) for _ in range(tokens)])
    token_of_row, block_expert, row_of_pair = triton_moe.group_by_expert(chosen, experts,
                                                                         block)
    assert token_of_row.shape[0] == triton_moe.max_pairs(tokens, top_k, experts, block)
    pairs = torch.arange(tokens * top_k)
    assert torch.equal(token_of_row[row_of_pair], pairs // top_k)
    assert torch.equal(block_expert[row_of_pair // block], chosen.flatten())
    assert row_of_pair.unique().numel() == tokens * top_k
    assert int((token_of_row >= 0).sum()) == tokens * top_k


def reference_moe(x, gate_up, down, experts, weights):
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for e, w in zip(experts[t].tolist(), weights[t].tolist(), strict=True):
            gate, up = (x[t].double() @ gate_up[e].double().T).chunk(2)
            out[t] += w * (down[e].double() @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_fused_experts_match_a_float64_reference_and_keep_a_tokens_bits(dtype):
    generator = torch.Generator().manual_seed(0)
    num_experts, hidden, intermediate, tokens = 4, 32, 16, 9
    x = torch.randn(tokens, hidden, generator=generator).to(dtype)
    gate_up = (torch.randn(num_experts, 2 * intermediate, hidden, generator=generator)
               / hidden ** 0.5).to(dtype)
    down = (torch.randn(num_experts, hidden, intermediate, generator=generator)
            / intermediate ** 0.5).to(dtype)
    experts = torch.stack([torch.randperm(num_experts, generator=generator)[:2]
                           for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=generator)
    out = triton_moe.fused_moe(x, gate_up, down, experts, weights, layers.silu_and_mul)
    assert relative_error(out, reference_moe(x, gate_up, down, experts, weights)) \
        < 4 * TOLERANCE[dtype]
    alone = triton_moe.fused_moe(x[:1], gate_up, down, experts[:1], weights[:1],
                                 layers.silu_and_mul)
    assert torch.equal(alone, out[:1])


def test_the_engine_on_the_triton_experts_matches_transformers(moe_dirs):  # noqa: F811
    folder = moe_dirs["qwen3_moe", 0]
    llm = LLM(str(folder), attention_backend="triton", exact_logprobs=False,
              max_model_len=64, num_kv_blocks=64)
    assert llm.engine.runner.ops.layers.fused_moe is triton_moe.fused_moe
    params = SamplingParams(temperature=0, max_tokens=4, min_tokens=4)
    outputs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    hf_model = reference(folder)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf_model, p, 4)
                                                         for p in PROMPTS[:2]]
