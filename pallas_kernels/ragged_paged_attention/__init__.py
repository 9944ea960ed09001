"""Ragged paged relative-bias attention (decode, chunked prefill and speculative verify in one call): the entry
point the model calls. `backend` picks the implementation: "tpu" (Mosaic TPU), "gpu" (Mosaic GPU), "reference"
(pure jnp), or "auto": the kernel of the platform the computation runs on (GPU: Hopper), the reference elsewhere
(CPU, other GPUs) and for inputs a kernel does not take (on GPU fp32, head dims or blocks not multiples of 64:
the tiny test models; on TPU rings without a block of whole sublane tiles): `IMPLEMENTATIONS`, a
`backends.Backends`. `paged_keys` reads a page pool back in position order."""

import functools
from collections.abc import Callable

import jax

from pallas_kernels import devices
from pallas_kernels.backends import Backends
from pallas_kernels.ragged_paged_attention import gpu, reference, tpu
from pallas_kernels.ragged_paged_attention.blocks import kv_block
from pallas_kernels.ragged_paged_attention.reference import paged_keys


def _tpu_takes(q: jax.Array, k: jax.Array, page_table: jax.Array | None) -> bool:
    """Mosaic TPU tiles the KV blocks in their dtype."""
    return tpu.supports(k.dtype, kv_block(k, page_table))


def _gpu_takes(q: jax.Array, k: jax.Array, page_table: jax.Array | None) -> bool:
    """On Hopper, for the activations' dtype, head dim and KV blocks."""
    return devices.on_hopper() and gpu.supports(q.dtype, q.shape[-1], kv_block(k, page_table))


IMPLEMENTATIONS = Backends("attention", "ragged_paged_attention", reference)
IMPLEMENTATIONS.register("tpu", tpu, platform="tpu", takes=_tpu_takes)
IMPLEMENTATIONS.register("gpu", gpu, platform="gpu", takes=_gpu_takes)
BACKENDS = IMPLEMENTATIONS.names


def automatic(q: jax.Array, k: jax.Array, page_table: jax.Array | None) -> str:
    """The backend "auto" means for these inputs on this platform: its kernel where the kernel takes their
    dtype and tiling, else the reference."""
    return IMPLEMENTATIONS.choose("auto", q, k, page_table)


def implementation(backend: str) -> Callable[..., jax.Array]:
    """The function behind a backend other than "auto", all with the reference's signature."""
    return IMPLEMENTATIONS.function(backend)


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
    chosen = IMPLEMENTATIONS.choose(backend, q, k, page_table)
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


__all__ = ["BACKENDS", "automatic", "implementation", "paged_keys", "ragged_paged_attention"]
