"""Attention and layer kernels: plain-torch references (CPU) and, later, Triton versions."""

from .attention import AttentionMetadata, paged_attention, store_kv

__all__ = ["AttentionMetadata", "paged_attention", "store_kv"]
