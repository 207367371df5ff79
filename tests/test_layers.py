"""Layer kernels (RMSNorm, Gemma's RMSNorm, rotary, SiLU- and GELU-tanh-and-mul), every
backend, against transformers' modules; and the training twins of Gemma's two
(``differentiable.py``) against autograd through the references.

The references are transformers' own: ``LlamaRMSNorm``, ``Gemma3RMSNorm``,
``apply_rotary_pos_emb`` with the tables of ``LlamaRotaryEmbedding``, ``ACT2FN["silu"]``
and ``ACT2FN["gelu_pytorch_tanh"]``, each run in float32 (GELU in float64) on the same inputs
(upcast when those are half precision).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, PretrainedConfig, Qwen3Config
from transformers.activations import ACT2FN
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from tandem.kernels import layers
from tandem.kernels.differentiable import training_ops
from tandem.kernels.testing import TOLERANCE, kernel_backends, relative_error
from tandem.rollout.worker.models.llama import head_dim_of
from tandem.rollout.worker.models.rotary import RotaryEmbedding

# On a CPU the Triton kernels run in Triton's interpreter (conftest switches it on).
BACKENDS = kernel_backends(torch.device("cpu"))
MAX_POSITION = 512
# Head geometries that hit the kernels' edges (a head_dim whose half is no power of two, a
# single KV head); rope types default (two thetas), llama3 and yarn (an attention scaling),
# with positions on both sides of the scaled ones' original context.
ROPE_CONFIGS = {
    "llama default theta": LlamaConfig(hidden_size=128, num_attention_heads=4,
                                       num_key_value_heads=4),
    "qwen3 theta 1e6": Qwen3Config(hidden_size=64, num_attention_heads=6, num_key_value_heads=2,
                                   head_dim=48, rope_parameters={"rope_type": "default",
                                                                 "rope_theta": 1e6}),
    "llama3 scaling": LlamaConfig(
        hidden_size=512, num_attention_heads=8, num_key_value_heads=1, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "yarn scaling": Qwen3Config(
        hidden_size=64, num_attention_heads=3, num_key_value_heads=1, head_dim=16,
        max_position_embeddings=MAX_POSITION, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
            "original_max_position_embeddings": 128}),
}


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm`` with ``weight`` applied to ``x``, in float32."""
    norm = LlamaRMSNorm(x.shape[-1], eps)
    with torch.no_grad():
        norm.weight.copy_(weight.float())
        return norm(x.float())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", TOLERANCE, ids=str)
@pytest.mark.parametrize("shape", [(1, 64), (7, 33), (3, 4, 32)], ids=str)
def test_rms_norm_matches_transformers(backend, dtype, shape):
    x, weight = randn(*shape, dtype=dtype, seed=0), randn(shape[-1], dtype=dtype, seed=1)
    out = BACKENDS[backend].rms_norm(x, weight, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    assert relative_error(out, hf_rms_norm(x, weight, 1e-6)) < TOLERANCE[dtype]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", TOLERANCE, ids=str)
@pytest.mark.parametrize("shape", [(1, 64), (7, 33)], ids=str)
def test_rms_norm_with_residual_normalises_the_sum_and_returns_it(backend, dtype, shape):
    x, residual = randn(*shape, dtype=dtype, seed=0), randn(*shape, dtype=dtype, seed=2)
    weight = randn(shape[-1], dtype=dtype, seed=1)
    out, summed = BACKENDS[backend].rms_norm(x, weight, 1e-5, residual)
    reference_sum = x.float() + residual.float()
    assert relative_error(summed, reference_sum) < TOLERANCE[dtype]
    assert relative_error(out, hf_rms_norm(reference_sum, weight, 1e-5)) < TOLERANCE[dtype]
    assert torch.equal(x, randn(*shape, dtype=dtype, seed=0))
    assert torch.equal(residual, randn(*shape, dtype=dtype, seed=2))


def hf_rotary(config: PretrainedConfig, positions: torch.Tensor, query: torch.Tensor,
              key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``query`` and ``key`` ``[tokens, heads, head_dim]`` rotated by transformers, in
    float32."""
    query, key = query.float()[None], key.float()[None]
    cos, sin = LlamaRotaryEmbedding(config)(query, positions[None])
    rotated = apply_rotary_pos_emb(query, key, cos, sin, unsqueeze_dim=2)
    return rotated[0][0], rotated[1][0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", TOLERANCE, ids=str)
@pytest.mark.parametrize("config_name", ROPE_CONFIGS)
@pytest.mark.parametrize("positions", [[300], [0, 1, 17, 511, 64, 130]], ids=len)
def test_rotary_embedding_in_place_matches_transformers(backend, dtype, config_name, positions):
    config = ROPE_CONFIGS[config_name]
    head_dim, positions = head_dim_of(config), torch.tensor(positions)
    tables = RotaryEmbedding(config, head_dim, MAX_POSITION, torch.device("cpu"))
    query = randn(len(positions), config.num_attention_heads, head_dim, dtype=dtype, seed=0)
    key = randn(len(positions), config.num_key_value_heads, head_dim, dtype=dtype, seed=1)
    ref_query, ref_key = hf_rotary(config, positions, query, key)
    BACKENDS[backend].rotary_embedding(positions, query, key, tables.cos, tables.sin)
    assert query.dtype == dtype and key.dtype == dtype
    assert relative_error(query, ref_query) < TOLERANCE[dtype]
    assert relative_error(key, ref_key) < TOLERANCE[dtype]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", TOLERANCE, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (7, 99), (1, 1025)], ids=str)
def test_silu_and_mul_matches_transformers_silu_times_up(backend, dtype, shape):
    # 1025 elements: one Triton block and one more.
    gate, up = randn(*shape, dtype=dtype, seed=0), randn(*shape, dtype=dtype, seed=1)
    out = BACKENDS[backend].silu_and_mul(gate, up)
    reference = ACT2FN["silu"](gate.float()) * up.float()
    assert out.dtype == dtype and out.shape == gate.shape
    assert relative_error(out, reference) < TOLERANCE[dtype]


def hf_gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``Gemma3RMSNorm`` with ``weight`` applied to ``x``, in float32."""
    norm = Gemma3RMSNorm(x.shape[-1], eps)
    with torch.no_grad():
        norm.weight.copy_(weight.float())
        return norm(x.float())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", TOLERANCE, ids=str)
@pytest.mark.parametrize("shape", [(1, 64), (7, 33), (3, 4, 16)], ids=str)
def test_gemma_rms_norm_matches_transformers_with_and_without_residual(backend, dtype, shape):
    x, residual = randn(*shape, dtype=dtype, seed=0), randn(*shape, dtype=dtype, seed=2)
    weight = randn(shape[-1], dtype=dtype, seed=1)
    out = BACKENDS[backend].gemma_rms_norm(x, weight, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    assert relative_error(out, hf_gemma_rms_norm(x, weight, 1e-6)) < TOLERANCE[dtype]
    out, summed = BACKENDS[backend].gemma_rms_norm(x, weight, 1e-6, residual)
    reference_sum = x.float() + residual.float()
    assert relative_error(summed, reference_sum) < TOLERANCE[dtype]
    assert relative_error(out, hf_gemma_rms_norm(reference_sum, weight, 1e-6)) < \
        TOLERANCE[dtype]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", TOLERANCE, ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (7, 99), (1, 1025)], ids=str)
def test_gelu_tanh_and_mul_matches_transformers_gelu_times_up(backend, dtype, shape):
    # 1025 elements: one Triton block and one more; gates far out on both tails.
    gate, up = randn(*shape, dtype=dtype, seed=0) * 4, randn(*shape, dtype=dtype, seed=1)
    out = BACKENDS[backend].gelu_tanh_and_mul(gate, up)
    reference = ACT2FN["gelu_pytorch_tanh"](gate.double()) * up.double()
    assert out.dtype == dtype and out.shape == gate.shape
    assert relative_error(out, reference) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", TOLERANCE, ids=str)
def test_the_gemma_references_round_where_transformers_does(dtype):
    # Gemma's norm scales by 1 + w in float32, then rounds (Llama's rounds first); the GELU
    # rounds to the dtype before the product: bit for bit transformers' modules.
    x, weight = randn(7, 33, dtype=dtype, seed=0), randn(33, dtype=dtype, seed=1)
    norm = Gemma3RMSNorm(33, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        assert torch.equal(layers.gemma_rms_norm(x, weight, 1e-6), norm(x))
    gate, up = randn(7, 99, dtype=dtype, seed=2) * 4, randn(7, 99, dtype=dtype, seed=3)
    assert torch.equal(layers.gelu_tanh_and_mul(gate, up),
                       ACT2FN["gelu_pytorch_tanh"](gate) * up)


def twin_and_reference(kernel: str, run, inputs: list[torch.Tensor], backend: str) -> None:
    """``run(kernel function, *inputs)`` through the training twin of ``kernel`` gives the
    backend kernel's bits, and the gradients autograd gives through the torch reference
    (``layers.py``) of float64 inputs."""
    grad = randn(*run(getattr(layers, kernel), *inputs).shape, dtype=torch.float32, seed=9)
    outputs, gradients = [], []
    for function, dtype in ((getattr(training_ops(BACKENDS[backend]), kernel), torch.float32),
                            (getattr(layers, kernel), torch.float64)):
        leaves = [t.detach().to(dtype).requires_grad_() for t in inputs]
        outputs.append(run(function, *leaves))
        outputs[-1].backward(grad.to(dtype))
        gradients.append([leaf.grad for leaf in leaves])
    assert torch.equal(outputs[0], run(getattr(BACKENDS[backend], kernel), *inputs))
    for ours, expected in zip(*gradients, strict=True):
        assert relative_error(ours, expected) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_gemma_rms_norms_twin_has_the_kernels_bits_and_autograds_gradients(backend):
    # The normalised sum and the sum (the next residual) both used downstream.
    inputs = [randn(5, 48, dtype=torch.float32, seed=seed) for seed in (0, 1)]
    twin_and_reference("gemma_rms_norm",
                       lambda norm, x, residual, weight: torch.mul(*norm(x, weight, 1e-6,
                                                                         residual)),
                       [*inputs, randn(48, dtype=torch.float32, seed=2)], backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gelu_tanh_and_muls_twin_has_the_kernels_bits_and_autograds_gradients(backend):
    inputs = [randn(5, 96, dtype=torch.float32, seed=seed) for seed in (3, 4)]
    twin_and_reference("gelu_tanh_and_mul", lambda act, gate, up: act(gate * 3, up), inputs,
                       backend)
