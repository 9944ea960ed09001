"""Routed-expert computation of a dropless top-k MoE: the entry point the model calls.

`backend` picks "tpu" (the Mosaic TPU kernels, over weights laid out by `layouts.for_tpu` at load),
"reference" (pure jnp under XLA) or "auto": the TPU kernels on TPU when the weights are laid out for them
(and of a shape they take), the reference otherwise.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.moe import reference, tpu
from pallas_kernels.moe.layouts import TpuWeight, for_tpu
from pallas_kernels.quantized import QuantizedArray

BACKENDS = ("auto", "reference", "tpu")
Weight = jax.Array | QuantizedArray | TpuWeight


def moe_experts(
    x: jax.Array, gate_up: Weight, down: Weight, experts: jax.Array, weights: jax.Array, *, gate_cap: float,
    up_cap: float, out_dtype: jnp.dtype | None = None, backend: str = "auto",
) -> jax.Array:  # fmt: skip
    """`reference.moe_experts`'s contract ([N, H]: each token's weighted sum over its experts), by `backend`."""
    if backend not in BACKENDS:
        raise ValueError(f"MoE backend {backend!r} is not one of {', '.join(BACKENDS)}")
    laid_out = isinstance(gate_up, TpuWeight) and isinstance(down, TpuWeight)
    if backend == "auto":
        on_tpu = jax.default_backend() == "tpu" and laid_out and tpu.supports(*gate_up.shape[1:])
        backend = "tpu" if on_tpu else "reference"
    options = {"gate_cap": gate_cap, "up_cap": up_cap, "out_dtype": out_dtype}
    if backend == "reference":
        return reference.moe_experts(x, gate_up, down, experts, weights, **options)
    if not laid_out:
        raise ValueError(
            "the TPU expert kernels take weights laid out by pallas_kernels.moe.layouts.for_tpu (once, at load);"
            f" got {type(gate_up).__name__} and {type(down).__name__}"
        )
    return tpu.moe_experts(x, gate_up, down, experts, weights, **options)


__all__ = ["BACKENDS", "TpuWeight", "for_tpu", "moe_experts"]
