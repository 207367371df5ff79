"""The FP8 KV cache's quantization against e4m3 from its definition in float64, every
backend's store against it bit for bit, and the refusals of what cannot run."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.fp8_kv import FP8, FP8_MAX, dequantize, kv_cache_dtype, quantize
from tandem.kernels.testing import kernel_backends
from tandem.rollout import EngineConfig

BACKENDS = kernel_backends(torch.device("cpu"))  # Triton in its interpreter (conftest)


def e4m3_grid() -> torch.Tensor:
    """Every finite non-negative e4m3fn value, from its definition: 4 exponent bits (bias 7),
    3 mantissa bits, subnormals at exponent 0, no infinity, 448 the largest."""
    values = [m / 8 * 2.0 ** -6 for m in range(8)]
    values += [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8)]
    return torch.tensor([v for v in values if v <= FP8_MAX], dtype=torch.float64)


def nearest_e4m3(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float64) rounded to the nearest e4m3 value, ties to the even mantissa, beyond
    ±448 saturated."""
    grid = e4m3_grid()
    magnitude = x.abs().clamp(max=FP8_MAX)
    distance = (magnitude[:, None] - grid[None, :]).abs()
    best = distance.min(1, keepdim=True).values
    ties = distance == best
    even = (torch.arange(len(grid)) % 2 == 0)[None, :]  # the grid's codes are in order
    choice = torch.where((ties & even).any(1), (ties & even).float().argmax(1),
                         ties.float().argmax(1))
    return grid[choice] * x.sign()


def random_rows(generator: torch.Generator, *shape: int) -> torch.Tensor:
    """Random values across e4m3's whole range: subnormals, normals and beyond 448."""
    exponents = torch.randint(-14, 12, shape, generator=generator).float()
    return torch.randn(*shape, generator=generator) * torch.exp2(exponents)


def test_quantize_rounds_to_the_nearest_e4m3_value_ties_to_even():
    generator = torch.Generator().manual_seed(0)
    rows = random_rows(generator, 512, 3, 8)
    scale = torch.tensor([1.0, 0.37, 5.0])
    # exact ties between two e4m3 values, in the normal and the subnormal range
    rows[0, 0, :6] = torch.tensor([1.0625, 1.1875, 9.0, -17.0, 3 * 2.0 ** -10, 5 * 2.0 ** -10])
    stored = quantize(rows, scale)
    assert stored.dtype == FP8
    expected = nearest_e4m3((rows.float() / scale[:, None]).double().flatten()).view(rows.shape)
    assert torch.equal(stored.double(), expected)


def test_values_beyond_the_range_saturate_and_never_become_nan():
    rows = torch.tensor([1e6, -1e6, 449.0, -480.0, float("inf"), float("-inf"), 3e38])
    stored = quantize(rows.view(-1, 1, 1), torch.ones(1)).float().flatten()
    assert torch.equal(stored, torch.tensor([448.0, -448.0, 448.0, -448.0, 448.0, -448.0,
                                             448.0]))
    scaled = quantize(torch.tensor([[[100.0, -100.0]]]), torch.tensor([0.1])).float()
    assert torch.equal(scaled, torch.tensor([[[448.0, -448.0]]]))


def test_dequantize_multiplies_each_heads_scale():
    stored = quantize(torch.tensor([[[2.0, -3.0], [4.0, 8.0]]]), torch.tensor([0.5, 2.0]))
    assert torch.equal(dequantize(stored, torch.tensor([0.5, 2.0])),
                       torch.tensor([[[2.0, -3.0], [4.0, 8.0]]]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_backends_store_writes_the_bits_of_quantize_and_skips_padding(backend, dtype):
    generator = torch.Generator().manual_seed(1)
    key, value = (random_rows(generator, 7, 3, 40).to(dtype) for _ in range(2))
    slot_mapping = torch.tensor([17, -1, 0, 95, 40, -1, 16])
    k_scale, v_scale = torch.tensor([0.5, 1.0, 3.0]), torch.tensor([0.01, 1.0, 2.0])
    k_cache = torch.zeros(6, 16, 3, 40, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    BACKENDS[backend].store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    written = slot_mapping >= 0
    for cache, rows, scale in ((k_cache, key, k_scale), (v_cache, value, v_scale)):
        slots = cache.view(-1, 3, 40).view(torch.uint8)
        assert torch.equal(slots[slot_mapping[written]],
                           quantize(rows[written], scale).view(torch.uint8))
        assert int(slots.any(-1).any(-1).sum()) == int(written.sum())  # nothing else written


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3"])
def test_both_names_give_float8_e4m3fn_and_auto_the_models_dtype(name):
    cpu = torch.device("cpu")
    assert kv_cache_dtype(name, torch.bfloat16, cpu) == torch.float8_e4m3fn
    assert kv_cache_dtype("auto", torch.bfloat16, cpu) == torch.bfloat16


def test_an_unknown_kv_cache_dtype_names_the_valid_ones():
    with pytest.raises(ValueError, match="kv_cache_dtype='fp16' is invalid: use one of 'auto', "
                                         "'fp8', 'fp8_e4m3'"):
        EngineConfig(model="m", kv_cache_dtype="fp16")


def test_a_torch_without_float8_is_refused_naming_the_fix(monkeypatch):
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(ValueError, match="lacks: upgrade torch .* or use kv_cache_dtype='auto'"):
        EngineConfig(model="m", kv_cache_dtype="fp8")
    EngineConfig(model="m")  # "auto" needs nothing


@pytest.mark.parametrize("capability, refused", [((8, 0), True), ((8, 6), True),
                                                 ((8, 9), False), ((9, 0), False)])
def test_a_gpu_that_triton_cannot_convert_fp8_on_is_refused_naming_the_fix(
        monkeypatch, capability, refused):
    # Triton 3.6 refuses float8_e4m3fn below sm_89 (tests/test_triton_compile.py compiles
    # the FP8 kernels for sm_90 only).
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability)
    cuda = torch.device("cuda")
    if refused:
        with pytest.raises(ValueError, match=f"8.9 or newer .* cuda is sm_{capability[0]}"
                                             f"{capability[1]}: use kv_cache_dtype='auto'"):
            kv_cache_dtype("fp8", torch.bfloat16, cuda)
    else:
        assert kv_cache_dtype("fp8", torch.bfloat16, cuda) == FP8
    assert kv_cache_dtype("auto", torch.bfloat16, cuda) == torch.bfloat16
