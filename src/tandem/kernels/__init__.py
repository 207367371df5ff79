"""Attention and layer kernels: Triton kernels, each beside a plain-torch reference.

``select_kernels(backend, device)`` picks a backend; ``attention.py`` and ``layers.py`` hold
the references, ``triton_attention.py`` and ``triton_layers.py`` the Triton versions (imported
only when selected), ``cpu_attention.py`` and ``cpu_layers.py`` (with their C sources, built
by ``cpu_build.py``) the compiled CPU decode attention and layer operations; ``fp8_kv.py``
the FP8 KV cache's dtype and quantization, which every attention backend reads.
"""

from .attention import (
                        AttentionMetadata,
                        BlockRuns,
                        CascadeLayout,
                        DecodeBuffers,
                        block_runs,
                        paged_attention,
                        pool_layout,
                        store_kv,
)
from .dispatch import (
                       BACKENDS,
                       CPU_OPS,
                       TORCH_OPS,
                       AttentionBackend,
                       KernelOps,
                       LayerKernels,
                       batch_invariance_gap,
                       check_backend,
                       check_quantized,
                       check_sharded,
                       select_kernels,
)
from .fp8_kv import KV_CACHE_DTYPES, check_kv_cache_dtype, kv_cache_dtype

__all__ = ["BACKENDS", "CPU_OPS", "KV_CACHE_DTYPES", "TORCH_OPS", "AttentionBackend",
           "AttentionMetadata", "BlockRuns", "CascadeLayout", "DecodeBuffers", "KernelOps",
           "LayerKernels", "batch_invariance_gap", "block_runs", "check_backend",
           "check_kv_cache_dtype", "check_quantized", "check_sharded", "kv_cache_dtype",
           "paged_attention", "pool_layout", "select_kernels", "store_kv"]
