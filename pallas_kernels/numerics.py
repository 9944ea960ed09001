"""Arithmetic conventions shared by the model and the kernel references.

They reproduce how the reference (PyTorch) rounds: a matmul accumulates in fp32 and rounds once to its
output dtype, and a narrowing cast really rounds. XLA may otherwise keep excess precision across a
bf16 -> f32 cast pair, and XLA:CPU accumulates bf16 dots in pieces; fp32 matmuls run at full fp32
precision (no TF32 / bf16 passes) on every backend.
"""

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST


def round_to(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """x in `dtype`, rounded to nearest even even where XLA would drop the cast."""
    dtype = jnp.dtype(dtype)
    if x.dtype == dtype:
        return x
    if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < jnp.finfo(x.dtype).bits:
        info = jnp.finfo(dtype)
        x = jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    return x.astype(dtype)


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) over the last axis, in fp32 (RMSNorm without its gain)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


def round_through(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """fp32 x rounded to `dtype` and back to fp32 by two casts: how kernels round where the reference does
    (inside Pallas kernels the casts really round)."""
    return x if jnp.dtype(dtype) == jnp.float32 else x.astype(dtype).astype(jnp.float32)


def _operands(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    # XLA:CPU has no bf16 x bf16 -> f32 dot; widened operands give the same exact products there.
    if jax.default_backend() == "cpu":
        return tuple(a.astype(jnp.float32) for a in arrays)
    return arrays


def einsum(spec: str, a: jax.Array, b: jax.Array, out_dtype: jnp.dtype | None = None) -> jax.Array:
    """jnp.einsum accumulated in fp32 and rounded once to `out_dtype` (default: a's dtype)."""
    out_dtype = a.dtype if out_dtype is None else out_dtype
    out = jnp.einsum(spec, *_operands(a, b), precision=HIGHEST, preferred_element_type=jnp.float32)
    return round_to(out, out_dtype)


def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    dimension_numbers: jax.lax.RaggedDotDimensionNumbers,
    out_dtype: jnp.dtype | None = None,
) -> jax.Array:
    """jax.lax.ragged_dot_general accumulated in fp32 and rounded once to `out_dtype` (default: lhs's)."""
    out_dtype = lhs.dtype if out_dtype is None else out_dtype
    lhs, rhs = _operands(lhs, rhs)
    out = jax.lax.ragged_dot_general(
        lhs, rhs, group_sizes, dimension_numbers, precision=HIGHEST, preferred_element_type=jnp.float32
    )
    return round_to(out, out_dtype)
