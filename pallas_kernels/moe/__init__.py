"""Routed-expert computation of a dropless top-k MoE: the entry point the model calls.

`backend` picks "tpu" (the Mosaic TPU kernels, over weights laid out by `layouts.for_tpu` at load), "gpu"
(the Mosaic GPU kernels, over weights laid out by `layouts.for_gpu`; in Mosaic GPU's interpreter on CPU),
"reference" (pure jnp under XLA) or "auto": the kernels of the platform it runs on when the weights are laid
out for them (and of a shape they take), the reference otherwise (`IMPLEMENTATIONS`, a `backends.Backends`). The
model lays its experts out once, at load, for the platform `kernel_platform` names, by `kernel_layout`.
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels import devices
from pallas_kernels.backends import Backends, hopper_takes
from pallas_kernels.moe import gpu, reference, tpu
from pallas_kernels.moe.layouts import PLAIN, GpuWeight, TpuWeight, for_gpu, for_gpu_experts, for_tpu, for_tpu_experts
from pallas_kernels.quantized import QuantizedArray

Weight = jax.Array | QuantizedArray | TpuWeight | GpuWeight
LAYOUTS = {"tpu": (TpuWeight, "for_tpu"), "gpu": (GpuWeight, "for_gpu")}  # weight types, and what lays them out


def _laid_out(backend: str, gate_up: Weight, down: Weight) -> bool:
    """Whether both weights are laid out for `backend`'s kernels."""
    kind = LAYOUTS[backend][0]
    return isinstance(gate_up, kind) and isinstance(down, kind)


def _tpu_takes(x: jax.Array, gate_up: Weight, down: Weight, one_gate_up: Weight, one_down: Weight) -> bool:
    """The TPU kernels take weights laid out for them, of a shape they take."""
    return _laid_out("tpu", gate_up, down) and tpu.supports(*one_gate_up.shape[1:])


def _gpu_takes(x: jax.Array, gate_up: Weight, down: Weight, one_gate_up: Weight, one_down: Weight) -> bool:
    """The GPU kernels take weights laid out for them, on Hopper, with activations and shapes `gpu.check` takes."""
    return _laid_out("gpu", gate_up, down) and hopper_takes(gpu.check, x, one_gate_up, one_down)


IMPLEMENTATIONS = Backends("MoE", "moe_experts", reference)
IMPLEMENTATIONS.register("tpu", tpu, platform="tpu", takes=_tpu_takes)
IMPLEMENTATIONS.register("gpu", gpu, platform="gpu", takes=_gpu_takes)
BACKENDS = IMPLEMENTATIONS.names


def moe_experts(
    x: jax.Array,
    gate_up: Weight,
    down: Weight,
    experts: jax.Array,
    weights: jax.Array,
    *,
    gate_cap: float,
    up_cap: float,
    out_dtype: jnp.dtype | None = None,
    routed_experts: int | None = None,
    layer: jax.Array | int | None = None,
    distinct_ids: bool = False,
    backend: str = "auto",
) -> jax.Array:
    """`reference.moe_experts`'s contract ([N, H]: each token's weighted sum over its experts), by `backend`.
    `routed_experts`: under expert parallelism, the experts the ids were chosen among (these weights hold only
    some; the others' ids are dropped here): the TPU kernels size their row tiles for the copies expected to stay,
    the GPU's choose between shared tiles and own windows by them. `layer`: gate_up and down hold several layers'
    experts stacked [L, E, ...] and the call is layer `layer`'s (an int32 scalar, traced inside a scan over
    layers): the kernels read its weights in place, where indexing them out of the stack would copy them.
    `distinct_ids`: no token names an expert twice (a top-k router's ids), so no expert gets more copies than
    there are tokens: the GPU kernels' plan sizes its windows by that."""
    IMPLEMENTATIONS.check(backend)
    one_gate_up, one_down = (_one_layer(w) for w in (gate_up, down)) if layer is not None else (gate_up, down)
    held = one_gate_up.shape[0]
    if routed_experts is not None and routed_experts < held:
        raise ValueError(f"routed_experts ({routed_experts}) is fewer than the {held} experts the weights hold")
    backend = IMPLEMENTATIONS.choose(backend, x, gate_up, down, one_gate_up, one_down)
    if backend != "reference" and not _laid_out(backend, gate_up, down):
        raise ValueError(
            f"the {backend.upper()} expert kernels take weights laid out by pallas_kernels.moe.layouts."
            f"{LAYOUTS[backend][1]} (once, at load); got {type(gate_up).__name__} and {type(down).__name__}"
        )
    options = {
        "gate_cap": gate_cap,
        "up_cap": up_cap,
        "out_dtype": out_dtype,
        "routed_experts": routed_experts,
        "distinct_ids": distinct_ids,
    }
    layer = None if layer is None else jnp.asarray(layer, jnp.int32)
    return _computed(x, gate_up, down, experts, weights, layer, backend=backend, **options)


@functools.partial(
    jax.jit, static_argnames=("gate_cap", "up_cap", "out_dtype", "routed_experts", "distinct_ids", "backend")
)
def _computed(
    x: jax.Array,
    gate_up: Weight,
    down: Weight,
    experts: jax.Array,
    weights: jax.Array,
    layer: jax.Array | None,
    *,
    gate_cap: float,
    up_cap: float,
    out_dtype: jnp.dtype | None,
    routed_experts: int | None,
    distinct_ids: bool,
    backend: str,
) -> jax.Array:
    """One backend's experts as their own jaxpr: every layer's call of one shape traces to the same jaxpr, which
    a program lowers once (lowering a Mosaic kernel takes about a second)."""
    options = {"gate_cap": gate_cap, "up_cap": up_cap, "out_dtype": out_dtype}
    implementation = IMPLEMENTATIONS.function(backend)
    if backend == "reference":
        if layer is not None:  # the oracle takes the layer's weights out of the stack
            gate_up, down = (jax.tree.map(lambda a: a[layer], w) for w in (gate_up, down))
        return implementation(x, gate_up, down, experts, weights, **options)
    options |= {"routed_experts": routed_experts, "layer": layer}
    if backend == "tpu":
        return implementation(x, gate_up, down, experts, weights, **options)
    return implementation(
        x,
        gate_up,
        down,
        experts,
        weights,
        **options,
        distinct_ids=distinct_ids,
        interpret=jax.default_backend() == "cpu",
    )


def _one_layer(weight: Weight) -> Weight:
    """One layer's weight of a stack [L, E, ...], shapes and dtypes only (nothing is read)."""
    return jax.eval_shape(lambda w: jax.tree.map(lambda a: a[0], w), weight)


def kernel_platform() -> str | None:
    """The platform whose expert kernels this process runs, which the experts are laid out for at load: "tpu",
    "gpu" (an sm90 GPU: the kernels' wgmma) or None."""
    if jax.default_backend() == "tpu":
        return "tpu"
    return "gpu" if devices.on_hopper() else None


def kernel_layout(
    platform: str, gate_up: jax.Array | QuantizedArray
) -> Callable[[Weight, Weight], tuple[Weight, Weight]] | None:
    """What lays the experts (gate_up, down) out for `platform`'s ("tpu" or "gpu") kernels, once, at load
    (`layouts.for_tpu_experts`, `layouts.for_gpu_experts`): where those kernels take gate_up's shape [..., E, 2I,
    H] and format; None where they do not (the reference takes the weights as they are)."""
    two_i, hidden = gate_up.shape[-2:]
    if platform == "tpu" and tpu.supports(two_i, hidden):
        return for_tpu_experts
    if platform == "gpu" and gpu.supports(two_i, hidden, _gpu_format(gate_up)):
        return for_gpu_experts
    return None


def _gpu_format(weight: jax.Array | QuantizedArray) -> str:
    """The GPU kernels' name for a weight's format (plain weights only in bf16)."""
    if isinstance(weight, QuantizedArray):
        return weight.format
    return PLAIN if weight.dtype == jnp.bfloat16 else str(weight.dtype)


__all__ = [
    "BACKENDS",
    "GpuWeight",
    "TpuWeight",
    "for_gpu",
    "for_tpu",
    "kernel_layout",
    "kernel_platform",
    "moe_experts",
]
