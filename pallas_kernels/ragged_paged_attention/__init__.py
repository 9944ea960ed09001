"""Ragged paged relative-bias attention (decode, chunked prefill and speculative verify in one call): the
entry point the model calls. Only the pure-jnp reference exists so far; the Mosaic TPU and GPU kernels
will sit beside it (issue 8)."""

from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention

__all__ = ["ragged_paged_attention"]
