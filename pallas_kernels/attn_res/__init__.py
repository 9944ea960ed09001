"""The attention-residual mix fused with the RMSNorm after it (twice per layer, and once before the final norm):
the entry point. `backend` picks "tpu" (Mosaic TPU), "gpu" (Mosaic GPU, Hopper; in Mosaic GPU's interpreter on
CPU), "xla" (jnp shaped for XLA's GPU fusions), "reference" (the oracle) or "auto": the TPU kernel on TPU; on a
Hopper GPU the Mosaic GPU kernel for the shapes it takes (faster than the XLA paths, or equal at their best:
bench/results/README.md); otherwise on GPU the XLA formulation for prefill-sized calls (from the device's
`xla_mix_from_tokens`) and the oracle for decode-sized ones; the oracle on CPU (`IMPLEMENTATIONS`, a
`backends.Backends`). Every backend takes the sources as a list or as one stacked
buffer, and a count `valid` of real ones (a scan over the blocks carries it)."""

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from pallas_kernels import devices
from pallas_kernels.attn_res import gpu, reference, tpu, xla
from pallas_kernels.attn_res.reference import Sources
from pallas_kernels.backends import Backends, hopper_takes


def _gpu_takes(sources: Sources, partial: jax.Array, queries: jax.Array, norm_weights: jax.Array) -> bool:
    """On Hopper, for the shapes and dtypes `gpu.check` takes."""
    return hopper_takes(gpu.check, sources, partial, queries, norm_weights)


def _xla_takes(sources: Sources, partial: jax.Array, queries: jax.Array, norm_weights: jax.Array) -> bool:
    """Prefill-sized calls: XLA's formulation beats the oracle's from the device's `xla_mix_from_tokens`."""
    return math.prod(partial.shape[:-1]) >= devices.gpu().xla_mix_from_tokens


IMPLEMENTATIONS = Backends("attention-residual", "attn_res_norm", reference)
IMPLEMENTATIONS.register("tpu", tpu, platform="tpu", takes=lambda *operands: True)
IMPLEMENTATIONS.register("gpu", gpu, platform="gpu", takes=_gpu_takes)
IMPLEMENTATIONS.register("xla", xla, platform="gpu", takes=_xla_takes)
BACKENDS = IMPLEMENTATIONS.names


def attn_res_norm(
    sources: Sources,
    partial: jax.Array,
    queries: jax.Array,
    norm_weights: jax.Array,
    *,
    eps: float,
    out_dtype: jnp.dtype,
    valid: int | jax.Array | None = None,
    backend: str = "auto",
) -> jax.Array:
    """`reference.attn_res_norm`'s contract ([Q, ..., H]: RMSNorm_q(mix_q) of sources[:valid] and the partial),
    computed by `backend`. sources: N arrays [..., H] or one stacked [N, ..., H]; valid: None (all N real) or an
    int32 scalar, possibly traced."""
    IMPLEMENTATIONS.check(backend)
    if valid is not None:
        valid = jnp.asarray(valid, jnp.int32)
        if valid.shape:
            raise ValueError(f"valid must be a scalar count of sources, not of shape {valid.shape}")
    backend = IMPLEMENTATIONS.choose(backend, sources, partial, queries, norm_weights)
    return _computed(sources, partial, queries, norm_weights, valid, eps=eps, out_dtype=out_dtype, backend=backend)


@functools.partial(jax.jit, static_argnames=("eps", "out_dtype", "backend"))
def _computed(
    sources: Sources,
    partial: jax.Array,
    queries: jax.Array,
    norm_weights: jax.Array,
    valid: jax.Array | None,
    *,
    eps: float,
    out_dtype: jnp.dtype,
    backend: str,
) -> jax.Array:
    """One backend's mix as its own jaxpr: every layer's call of one shape traces to the same jaxpr, which a
    program lowers once (lowering a Mosaic kernel takes about a second)."""
    options = {"eps": eps, "out_dtype": out_dtype}
    implementation = IMPLEMENTATIONS.function(backend)
    if backend in ("reference", "xla"):
        return implementation(sources, partial, queries, norm_weights, valid=valid, **options)
    if backend == "gpu":
        options["interpret"] = jax.default_backend() == "cpu"

    def kernel(*operands) -> jax.Array:  # per_device passes operands by position; the kernels take valid by name
        *arrays, count = operands
        return implementation(*arrays, valid=count, **options)

    return per_device(kernel, sources, partial, queries, norm_weights, valid)


def per_device(kernel: Callable[..., jax.Array], *args) -> jax.Array:
    """kernel(*args) on every device of the current mesh, each on the whole (replicated) operands: a Pallas
    call takes no mesh axes but manual ones, and the residual stream is replicated over the model axis."""
    mesh = jax.sharding.get_abstract_mesh()
    shared = {name for name, kind in zip(mesh.axis_names, mesh.axis_types, strict=True) if kind != AxisType.Manual}
    if not shared:
        return kernel(*args)
    whole = jax.tree.map(lambda x: jax.reshard(x, P()), args)  # gathers a sharded operand (none in the model)
    return jax.shard_map(kernel, mesh=mesh, in_specs=P(), out_specs=P(), axis_names=shared, check_vma=False)(*whole)


__all__ = ["BACKENDS", "attn_res_norm"]
