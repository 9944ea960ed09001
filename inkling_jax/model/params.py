"""Declaring parameters: shape, dtype, initialiser and logical sharding axes in one place.

Weights keep the checkpoints' layout ([out, in] for projections) so loading is a rename, never a
transpose. Logical axis names are mapped onto mesh axes by `inkling_jax.sharding`.
"""

import itertools
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
        self,
        rngs: nnx.Rngs,
        in_features: int,
        out_features: int,
        axes: tuple[str | None, str | None],
        dtype: jnp.dtype,
        std: float,
    ):
        self.weight = param(rngs, (out_features, in_features), axes, dtype, normal(std))

    def __call__(self, x: jax.Array) -> jax.Array:
        return einsum("...i,oi->...o", x, round_to(self.weight[...], x.dtype))


class HeadProjections(nnx.Module):
    """Projections of one input fused into one weight [H, F, in] (sizes: each projection's F per head, in order;
    a stacked module's weight carries its leading axes too): one gemm reads them all, sharded by head as each of
    them was. Each output column is its own dot product: the separate projections' values (bit for bit on CPU; a
    GPU's gemm may sum a wider matrix in another order)."""

    def __init__(self, projections: list[tuple[Linear, int]], heads: int, axis: str):
        """projections: (Linear with weight [..., heads * f, in], f) each; axis: the logical axis of their heads."""
        weights = []
        for linear, per_head in projections:
            weight = linear.weight[...]
            weights.append(weight.reshape(*weight.shape[:-2], heads, per_head, weight.shape[-1]))
        leading = logical_axes(projections[0][0].weight)[:-2]
        fused = jnp.concatenate(weights, axis=-2)
        self.weight = nnx.Param(fused, out_sharding=(*leading, axis, None, "embed"), eager_sharding=False)
        self.sizes = tuple(per_head for _, per_head in projections)

    def __call__(self, x: jax.Array) -> list[jax.Array]:
        """x [..., in] -> each projection's [..., H, f] in x's dtype."""
        out = einsum("...i,hfi->...hf", x, round_to(self.weight[...], x.dtype))
        bounds = [0, *itertools.accumulate(self.sizes)]
        return [out[..., start:end] for start, end in itertools.pairwise(bounds)]
