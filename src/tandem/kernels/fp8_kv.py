"""The FP8 KV cache (``kv_cache_dtype="fp8"``, vLLM's name): K and V stored as
``float8_e4m3fn``, one byte an element, with a float32 scale per layer and KV head.

A stored element is ``x / scale``, clamped to ±448 (e4m3's largest finite value, so that a
value beyond the range saturates and never becomes NaN) and rounded to the nearest e4m3
value; a kernel reads it back as ``float32(element) * scale``. ``quantize`` is the one
rounding every CPU path takes (the torch reference's ``store_kv``, which the CPU backend's
store falls back to, and so the trainer's exact forward); Triton's store writes out the
same arithmetic and is tested bit for bit against it.

The scales are 1.0, vLLM's default where a checkpoint carries none, and fixed for the
engine's life. Calibrating them from the first prefill would make every later token's KV
depend on which request happened to come first: a resumed or repeated run, another order of
requests, or another SPMD rank's share would store other bits. With fixed scales a token's
KV depends on its own K and V only, so a token's log-prob never depends on what the engine
served before, and seeded runs repeat. e4m3 keeps 3 mantissa bits over 2^-6..448
(subnormals down to 2^-9) whatever the scale, so the scale only decides what saturates and
what underflows: on SmolLM2-135M the largest |K| of any layer and KV head is 26 and |V| 11,
far from 448, and 1% of K and 3% of V fall below 2^-6. Scales calibrated on the very
prompts scored gained little there (BENCHMARKS.md, ``benchmarks/kv_cache_fp8.py``).
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
FP8 = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0
# Triton converts float8_e4m3fn on NVIDIA GPUs of this compute capability and newer only
# (Ada, Hopper): Triton 3.6 refuses the type on sm_80 and sm_86.
MIN_CUDA_CAPABILITY = (8, 9)


def check_kv_cache_dtype(name: str) -> None:
    """Raise ValueError unless ``name`` is one of ``KV_CACHE_DTYPES`` and this torch has
    ``float8_e4m3fn`` where it names an FP8 cache."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={name!r} is invalid: use one of "
                         f"{', '.join(map(repr, KV_CACHE_DTYPES))}.")
    if name != "auto" and not hasattr(torch, "float8_e4m3fn"):
        raise ValueError(f"kv_cache_dtype={name!r} needs torch.float8_e4m3fn, which torch "
                         f"{torch.__version__} lacks: upgrade torch (2.1 or newer), or use "
                         "kv_cache_dtype='auto'.")


def kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The pool's element dtype for ``kv_cache_dtype=name``: the model's for ``"auto"``, else
    ``float8_e4m3fn``.

    Raises:
        ValueError: for an unknown name, a torch without ``float8_e4m3fn``, or a CUDA device
            below ``MIN_CUDA_CAPABILITY``, naming the fix.
    """
    check_kv_cache_dtype(name)
    if name == "auto":
        return model_dtype
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CUDA_CAPABILITY:
            major, minor = capability
            raise ValueError(
                f"kv_cache_dtype={name!r} needs a GPU of compute capability 8.9 or newer (Ada, "
                f"Hopper), where Triton converts float8_e4m3fn; {device} is sm_{major}{minor}: "
                "use kv_cache_dtype='auto'.")
    return FP8


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` ``[tokens, kv_heads, head_dim]`` as the pool stores it: divided by its head's
    ``scale`` ``[kv_heads]`` in float32, clamped to ±``FP8_MAX``, rounded to e4m3."""
    return (x.float() / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Stored elements ``x`` back in float32, each times its KV head's ``scale``
    ``[kv_heads]``; dimension ``dim`` of ``x`` holds the KV heads."""
    shape = [1] * x.dim()
    shape[dim] = -1
    return x.float() * scale.view(shape)
