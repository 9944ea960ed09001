"""Relative-bias attention with a per-token sink logit: the entry point the model calls."""

from pallas_kernels.relative_attention.reference import relative_attention

__all__ = ["relative_attention"]
