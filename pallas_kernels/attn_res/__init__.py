"""The attention-residual mix fused with the RMSNorm after it (twice per layer, and once before the final norm):
the entry point. `backend` picks "tpu" (Mosaic TPU), "reference" (pure jnp under XLA) or "auto": the TPU kernel
on TPU, the reference elsewhere."""

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from pallas_kernels.attn_res import reference, tpu

BACKENDS = ("auto", "reference", "tpu")


def attn_res_norm(
    sources: Sequence[jax.Array],
    partial: jax.Array,
    queries: jax.Array,
    norm_weights: jax.Array,
    *,
    eps: float,
    out_dtype: jnp.dtype,
    backend: str = "auto",
) -> jax.Array:
    """`reference.attn_res_norm`'s contract ([Q, ..., H]: RMSNorm_q(mix_q)), computed by `backend`."""
    if backend not in BACKENDS:
        raise ValueError(f"attention-residual backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = "tpu" if jax.default_backend() == "tpu" else "reference"
    implementation = tpu.attn_res_norm if backend == "tpu" else reference.attn_res_norm
    return implementation(sources, partial, queries, norm_weights, eps=eps, out_dtype=out_dtype)


__all__ = ["BACKENDS", "attn_res_norm"]
