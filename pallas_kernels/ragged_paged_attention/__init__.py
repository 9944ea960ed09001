"""Ragged paged relative-bias attention (decode, chunked prefill and speculative verify in one call): the entry
point the model calls. `backend` picks the implementation: "tpu" (Mosaic TPU), "gpu" (Mosaic GPU), "reference"
(pure jnp), or "auto": the kernel of the platform the computation runs on (GPU: Hopper), the reference elsewhere
(CPU, other GPUs) and for inputs a kernel does not take (on GPU fp32, head dims or blocks not multiples of 64:
the tiny test models; on TPU rings without a block of whole sublane tiles)."""

import functools
import importlib
from collections.abc import Callable

import jax

from pallas_kernels.devices import on_hopper
from pallas_kernels.ragged_paged_attention import reference, tpu
from pallas_kernels.ragged_paged_attention.blocks import kv_block

BACKENDS = ("auto", "reference", "tpu", "gpu")


def automatic(q: jax.Array, k: jax.Array, page_table: jax.Array | None) -> str:
    """The backend "auto" means for these inputs on this platform: its kernel where the kernel takes their
    dtype and tiling, else the reference."""
    platform, block = jax.default_backend(), kv_block(k, page_table)
    if platform == "tpu":
        return "tpu" if tpu.supports(k.dtype, block) else "reference"
    if platform == "gpu" and on_hopper():
        from pallas_kernels.ragged_paged_attention import gpu  # Mosaic GPU is imported only where it runs

        return "gpu" if gpu.supports(q.dtype, q.shape[-1], block) else "reference"
    return "reference"


def implementation(backend: str) -> Callable[..., jax.Array]:
    """The function behind a backend other than "auto", all with the reference's signature."""
    if backend not in BACKENDS[1:]:
        raise ValueError(f"attention backend {backend!r} is not one of {', '.join(BACKENDS)}")
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
    ring_rows: jax.Array | None = None,
    backend: str = "auto",
    invariant: bool = True,
) -> jax.Array:
    """`reference.ragged_paged_attention`'s contract (shapes and semantics there), computed by `backend`.
    invariant (the GPU kernel's): a position's row gets the same bits whatever the step's width (decode, verify,
    prefill chunk) and neighbours; False lets prefill chunks take the GPU kernel's faster tiles, which sum a row's
    keys in another order."""
    chosen = automatic(q, k, page_table) if backend == "auto" else backend
    ring_rows = reference.sequence_rings(ring_rows, q.shape[0])
    return _computed(
        q, k, v, kv_lens, query_lens, rel, rel_proj, sinks, page_table, ring_rows, scale=scale, window=window,
        backend=chosen, invariant=invariant,
    )  # fmt: skip


@functools.partial(jax.jit, static_argnames=("scale", "window", "backend", "invariant"))
def _computed(
    q, k, v, kv_lens, query_lens, rel, rel_proj, sinks, page_table, ring_rows, *, scale, window, backend, invariant
) -> jax.Array:
    """One backend's attention as its own jaxpr: every layer's call of one shape traces to the same jaxpr, which
    a program lowers once (lowering a Mosaic kernel takes about a second)."""
    options = {"invariant": invariant} if backend == "gpu" else {}
    return implementation(backend)(
        q, k, v, kv_lens, query_lens, rel, rel_proj, sinks, page_table=page_table, scale=scale, window=window,
        ring_rows=ring_rows, **options,
    )  # fmt: skip


__all__ = ["BACKENDS", "automatic", "implementation", "ragged_paged_attention"]
