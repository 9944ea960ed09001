"""Declaring parameters: shape, dtype, initialiser and logical sharding axes in one place.

Weights keep the checkpoints' layout ([out, in] for projections) so loading is a rename, never a
transpose. Logical axis names are mapped onto mesh axes by `inkling_jax.sharding`.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.numerics import einsum, round_to

Initializer = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]


def normal(std: float) -> Initializer:
    return lambda key, shape, dtype: std * jax.random.normal(key, shape, dtype)


def ones(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
    del key
    return jnp.ones(shape, dtype)


def zeros(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
    del key
    return jnp.zeros(shape, dtype)


def param(
    rngs: nnx.Rngs,
    shape: tuple[int, ...],
    axes: tuple[str | None, ...],
    dtype: jnp.dtype,
    init: Initializer,
) -> nnx.Param:
    """A parameter annotated with one logical axis name (or None) per dimension."""
    assert len(axes) == len(shape), (shape, axes)
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=axes, eager_sharding=False)


def logical_axes(variable: nnx.Variable) -> tuple[str | None, ...]:
    """The logical axes a parameter was declared with."""
    return variable.get_metadata()["out_sharding"]


class Linear(nnx.Module):
    """y = x @ weight.T with weight [out, in], accumulated in fp32 and rounded to x's dtype."""

    def __init__(
        self, rngs: nnx.Rngs, in_features: int, out_features: int, axes: tuple[str | None, str | None],
        dtype: jnp.dtype, std: float,
    ):  # fmt: skip
        self.weight = param(rngs, (out_features, in_features), axes, dtype, normal(std))

    def __call__(self, x: jax.Array) -> jax.Array:
        return einsum("...i,oi->...o", x, round_to(self.weight[...], x.dtype))
