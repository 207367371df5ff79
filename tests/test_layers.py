"""Layer kernels (RMSNorm, rotary, SiLU-and-mul), both backends, against float64 references."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import TORCH_OPS

from .kernel_checks import BACKENDS, TOLERANCE, relative_error


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def rotary_tables(max_position: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half cos/sin tables, as ``RotaryEmbedding`` builds them."""
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(max_position).float(), inv_freq).repeat(1, 2)
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", TOLERANCE, ids=str)
@pytest.mark.parametrize("shape", [(5, 48), (3, 4, 32), (1, 64)])
def test_rms_norm_matches_float64(backend, dtype, shape):
    x, weight = randn(*shape, dtype=dtype, seed=0), randn(shape[-1], dtype=dtype, seed=1)
    out = BACKENDS[backend].rms_norm(x, weight, 1e-6)
    reference = TORCH_OPS.rms_norm(x.double(), weight.double(), 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    assert relative_error(out, reference) < TOLERANCE[dtype]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", TOLERANCE, ids=str)
def test_rms_norm_with_residual_returns_normed_sum_and_sum(backend, dtype):
    x, residual = randn(7, 48, dtype=dtype, seed=0), randn(7, 48, dtype=dtype, seed=2)
    weight = randn(48, dtype=dtype, seed=1)
    out, summed = BACKENDS[backend].rms_norm(x, weight, 1e-5, residual)
    ref_out, ref_sum = TORCH_OPS.rms_norm(x.double(), weight.double(), 1e-5, residual.double())
    assert relative_error(summed, ref_sum) < TOLERANCE[dtype]
    assert relative_error(out, ref_out) < TOLERANCE[dtype]
    assert torch.equal(x, randn(7, 48, dtype=dtype, seed=0))  # inputs untouched


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", TOLERANCE, ids=str)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 32), (6, 2, 48), (8, 1, 64)])
def test_rotary_embedding_rotates_query_and_key_in_place(backend, dtype, num_heads,
                                                         num_kv_heads, head_dim):
    cos, sin = rotary_tables(200, head_dim)
    positions = torch.tensor([0, 1, 17, 199, 64, 5])
    query = randn(6, num_heads, head_dim, dtype=dtype, seed=0)
    key = randn(6, num_kv_heads, head_dim, dtype=dtype, seed=1)
    ref_query, ref_key = query.double(), key.double()
    TORCH_OPS.rotary_embedding(positions, ref_query, ref_key, cos.double(), sin.double())
    BACKENDS[backend].rotary_embedding(positions, query, key, cos, sin)
    assert relative_error(query, ref_query) < TOLERANCE[dtype]
    assert relative_error(key, ref_key) < TOLERANCE[dtype]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", TOLERANCE, ids=str)
@pytest.mark.parametrize("shape", [(7, 100), (1, 2048), (3, 1)])
def test_silu_and_mul_matches_float64(backend, dtype, shape):
    gate, up = randn(*shape, dtype=dtype, seed=0), randn(*shape, dtype=dtype, seed=1)
    out = BACKENDS[backend].silu_and_mul(gate, up)
    reference = TORCH_OPS.silu_and_mul(gate.double(), up.double())
    assert out.dtype == dtype and out.shape == gate.shape
    assert relative_error(out, reference) < TOLERANCE[dtype]
