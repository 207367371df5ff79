"""The compiled CPU layer operations against the torch references, on the inputs the engine
gives them: row views into a wider projection output, enough rows for the threaded path, and
padding slots. bfloat16 results equal the references' bit for bit (every rounding mirrored)
but for RMSNorm, whose sum of squares is added in another order; float32 ones are within a
few units in the last place (transformers' parity is tests/test_layers.py's)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels import attention, cpu_layers, layers
from tandem.kernels.attention import pool_layout

DTYPES = [torch.float32, torch.bfloat16]
NORMS = ["rms_norm", "gemma_rms_norm"]  # Llama's, Gemma's (1 + weight)
ROWS = [1, 5, 300]  # 300 rows of 576 pass the kernels' threading threshold


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def close(out: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype, ulps: int) -> bool:
    """Within ``ulps`` units in the last place of ``dtype`` at the reference's magnitude."""
    spacing = torch.finfo(dtype).eps * reference.float().abs().clamp(min=1.0)
    return bool(((out.float() - reference.float()).abs() <= ulps * spacing).all())


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_of_a_row_view_with_and_without_residual(norm, dtype, rows):
    x = randn(rows, 3 * 576, dtype=dtype, seed=0)[:, 576:1152]  # rows 1728 elements apart
    residual, weight = randn(rows, 576, dtype=dtype, seed=1), randn(576, dtype=dtype, seed=2)
    kernel, reference = getattr(cpu_layers, norm), getattr(layers, norm)
    out, total = kernel(x, weight, 1e-5, residual)
    expected, expected_total = reference(x, weight, 1e-5, residual)
    assert torch.equal(total, expected_total)
    assert close(out, expected, dtype, ulps=8 if dtype == torch.float32 else 1)
    assert close(kernel(x, weight, 1e-5), reference(x, weight, 1e-5),
                 dtype, ulps=8 if dtype == torch.float32 else 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul_of_the_fused_gate_up_halves(dtype, rows):
    gate_up = randn(rows, 2 * 576, dtype=dtype, seed=3)
    gate, up = gate_up.split(576, dim=-1)
    out, expected = cpu_layers.silu_and_mul(gate, up), layers.silu_and_mul(gate, up)
    if dtype == torch.bfloat16:
        assert torch.equal(out, expected)
    else:
        assert close(out, expected, dtype, ulps=8)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
def test_gelu_tanh_and_mul_of_the_fused_gate_up_halves(dtype, rows):
    # Against float64: the kernel's g sigmoid(2u) keeps the far negative tail, which
    # torch's float32 0.5 g (1 + tanh u) cancels to zero; gates out past -8.6, where
    # exp(-2u) would overflow.
    gate_up = randn(rows, 2 * 576, dtype=dtype, seed=3) * 4
    gate, up = gate_up.split(576, dim=-1)
    expected = F.gelu(gate.double(), approximate="tanh") * up.double()
    assert close(cpu_layers.gelu_tanh_and_mul(gate, up), expected, dtype,
                 ulps=8 if dtype == torch.float32 else 2)


@pytest.mark.parametrize("kernel", ["rms_norm", "gemma_rms_norm", "gelu_tanh_and_mul"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(kernel, dtype):
    # Exact log-probs: the engine's rows and the trainer's come in batches of their own
    # (300 rows take the threaded path).
    x, other = randn(300, 576, dtype=dtype, seed=0) * 4, randn(300, 576, dtype=dtype, seed=1)
    if kernel == "gelu_tanh_and_mul":
        batch, row = (cpu_layers.gelu_tanh_and_mul(x[rows], other[rows])
                      for rows in (slice(None), slice(7, 8)))
    else:
        batch, row = (getattr(cpu_layers, kernel)(x[rows], other[0], 1e-5, other[rows])[0]
                      for rows in (slice(None), slice(7, 8)))
    assert torch.equal(batch[7:8], row)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ROWS)
def test_rotary_embedding_of_query_and_key_views_in_place(dtype, rows):
    qkv = randn(rows, 9 * 64 + 2 * 3 * 64, dtype=dtype, seed=4)
    positions = torch.randint(0, 512, (rows,), generator=torch.Generator().manual_seed(5))
    cos, sin = randn(512, 32, dtype=torch.float32, seed=6), randn(512, 32, dtype=torch.float32,
                                                                 seed=7)
    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)  # rotate-half tables
    expected = qkv.clone()
    for rows_of, rotate in ((qkv, cpu_layers.rotary_embedding),
                            (expected, layers.rotary_embedding)):
        query, key = rows_of[:, :576].view(rows, 9, 64), rows_of[:, 576:768].view(rows, 3, 64)
        rotate(positions, query, key, cos, sin)
    if dtype == torch.bfloat16:
        assert torch.equal(qkv, expected)
    else:
        assert close(qkv, expected, dtype, ulps=4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_kv_writes_each_slot_and_skips_padding(dtype):
    storage, order = pool_layout((6, 16, 3, 8))  # head-major, as the engine stores it
    k_cache = torch.zeros(storage, dtype=dtype).permute(order)
    v_cache = torch.zeros(storage, dtype=dtype).permute(order)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    kv = randn(7, 2, 3, 8, dtype=dtype, seed=8)
    key, value = kv[:, 0], kv[:, 1]  # views, as the q/k/v split gives them
    slots = torch.tensor([5, -1, 16, 17, 95, 40, -1])
    cpu_layers.store_kv(key, value, k_cache, v_cache, slots)
    attention.store_kv(key, value, expected_k, expected_v, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert k_cache.flatten(0, 1)[16].abs().sum() > 0


def test_float16_takes_the_references():
    x, weight = randn(4, 64, dtype=torch.float16, seed=9), randn(64, dtype=torch.float16, seed=1)
    assert torch.equal(cpu_layers.rms_norm(x, weight, 1e-6), layers.rms_norm(x, weight, 1e-6))
    assert torch.equal(cpu_layers.silu_and_mul(x, weight.expand(4, 64)),
                       layers.silu_and_mul(x, weight.expand(4, 64)))
