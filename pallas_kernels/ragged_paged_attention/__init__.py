"""Ragged paged relative-bias attention (decode, chunked prefill and speculative verify in one call): the
entry point the model calls. `backend` picks the implementation: "tpu" (Mosaic TPU), "gpu" (Mosaic GPU),
"reference" (pure jnp), or "auto": the kernel of the platform the computation runs on, the reference
elsewhere (CPU)."""

import importlib
from collections.abc import Callable

import jax

from pallas_kernels.ragged_paged_attention import reference

BACKENDS = ("auto", "reference", "tpu", "gpu")


def implementation(backend: str = "auto") -> Callable[..., jax.Array]:
    """The function behind `backend`, all with the reference's signature."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = jax.default_backend() if jax.default_backend() in ("tpu", "gpu") else "reference"
    if backend == "reference":
        return reference.ragged_paged_attention
    return importlib.import_module(f"pallas_kernels.ragged_paged_attention.{backend}").ragged_paged_attention


def ragged_paged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_lens: jax.Array,
    query_lens: jax.Array,
    rel: jax.Array,
    rel_proj: jax.Array,
    sinks: jax.Array,
    *,
    page_table: jax.Array | None,
    scale: float,
    window: int | None,
    backend: str = "auto",
) -> jax.Array:
    """`reference.ragged_paged_attention`'s contract (shapes and semantics there), computed by `backend`."""
    return implementation(backend)(
        q, k, v, kv_lens, query_lens, rel, rel_proj, sinks, page_table=page_table, scale=scale, window=window
    )


__all__ = ["BACKENDS", "implementation", "ragged_paged_attention"]
