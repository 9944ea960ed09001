"""Arithmetic conventions shared by the model and the kernel references.

They reproduce how the reference (PyTorch) rounds: a matmul accumulates in fp32 and rounds once to its
output dtype, and a narrowing cast really rounds. XLA may otherwise keep excess precision across a
bf16 -> f32 cast pair, and XLA:CPU accumulates bf16 dots in pieces; fp32 matmuls run at full fp32
precision (no TF32 / bf16 passes) on every backend.

Batch invariance: a value must not depend on how many other rows are computed with it. XLA:CPU's dots and
reductions sum in an order that changes with the operands' shapes (GEMV against GEMM, blockings by size, batched
dots by batch count, reductions vectorised by the kept axes' sizes), so on the CPU every sum the model takes
(`total`, `softmax`, `log_softmax`, `einsum`, `ragged_dot`, `rms_normalize`) is a fixed tree of adds: adjacent
pairs, level by level, over the summed axis zero-padded to a power of two. Elementwise adds are not reordered, so
each output's order depends on nothing but its own summed values, and trailing zeros (a longer padding) join the
tree as a right subtree of zeros, which leaves the sum as it was.
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


def total(x: jax.Array, axis: int | tuple[int, ...] = -1, keepdims: bool = False) -> jax.Array:
    """jnp.sum over `axis`; on the CPU a fixed tree of adds (module docstring), batch-invariant. On a GPU the sum is
    materialized (`materialized`): whether XLA:GPU fuses a function of the sum (the router's sigmoid) into the
    reduction's kernel changes with the program around it, and such a kernel may sum a row in another order."""
    backend = jax.default_backend()
    if backend != "cpu":
        summed = jnp.sum(x, axis=axis, keepdims=keepdims)
        return materialized(summed) if backend == "gpu" else summed
    axes = tuple(sorted(a % x.ndim for a in ((axis,) if isinstance(axis, int) else axis)))
    kept = [a for a in range(x.ndim) if a not in axes]
    flat = jnp.transpose(x, kept + list(axes)).reshape([x.shape[a] for a in kept] + [-1])
    count = flat.shape[-1]
    flat = jnp.pad(flat, [(0, 0)] * len(kept) + [(0, (1 << max(count - 1, 0).bit_length()) - count)])
    while flat.shape[-1] > 1:
        flat = flat[..., 0::2] + flat[..., 1::2]
    out = materialized(flat[..., 0])
    return jnp.expand_dims(out, axes) if keepdims else out


def materialized(x: jax.Array) -> jax.Array:
    """x computed on its own, in no kernel with its consumers: a reduction that reads it holds none of the
    transcendental functions that made it (on a GPU they may change how the kernel sums, see `total`). On the CPU,
    XLA:CPU emits an elementwise function of a reduced value (exp(x - max), rsqrt(sum)) fused with the reduction in
    code that changes with the shapes, and its exp then rounds some values differently; reading a materialized
    reduction, the function runs as the same elementwise loop at any shape."""
    return jax.lax.optimization_barrier(x)


def softmax(x: jax.Array, axis: int = -1) -> jax.Array:
    """jax.nn.softmax, its sum through `total` (batch-invariant on the CPU)."""
    if jax.default_backend() != "cpu":
        return jax.nn.softmax(x, axis=axis)
    unnormalized = jnp.exp(x - jax.lax.stop_gradient(materialized(jnp.max(x, axis=axis, keepdims=True))))
    return unnormalized / total(unnormalized, axis, keepdims=True)


def log_softmax(x: jax.Array, axis: int = -1) -> jax.Array:
    """jax.nn.log_softmax, its sum through `total` (batch-invariant on the CPU)."""
    if jax.default_backend() != "cpu":
        return jax.nn.log_softmax(x, axis=axis)
    shifted = x - jax.lax.stop_gradient(materialized(jnp.max(x, axis=axis, keepdims=True)))
    return shifted - jnp.log(total(jnp.exp(shifted), axis, keepdims=True))


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) over the last axis, in fp32 (RMSNorm without its gain)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(total(jnp.square(x), -1, keepdims=True) / x.shape[-1] + eps)


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
    """jnp.einsum accumulated in fp32 and rounded once to `out_dtype` (default: a's dtype); batch-invariant."""
    out_dtype = a.dtype if out_dtype is None else out_dtype
    if jax.default_backend() == "cpu":
        return round_to(_sum_of_products(spec, *_operands(a, b)), out_dtype)
    out = jnp.einsum(spec, a, b, precision=HIGHEST, preferred_element_type=jnp.float32)
    return round_to(out, out_dtype)


def _sum_of_products(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """einsum(spec, a, b) (two operands, no repeated index within one) as a multiply and a sum over the
    contracted axes, summed by `total`."""
    inputs, output = spec.replace(" ", "").split("->")
    letters = inputs.split(",")
    broadcast = max(x.ndim - len(ls.replace("...", "")) for x, ls in zip((a, b), letters, strict=True))
    ellipsis = "".join(chr(ord("A") + i) for i in range(broadcast))
    named = []
    for x, ls in zip((a, b), letters, strict=True):
        count = x.ndim - len(ls.replace("...", ""))
        named.append(ls.replace("...", ellipsis[broadcast - count :]))
    output = output.replace("...", ellipsis)
    summed = "".join(dict.fromkeys(c for c in "".join(named) if c not in output))
    order = output + summed

    def aligned(x: jax.Array, ls: str) -> jax.Array:
        kept = [c for c in order if c in ls]
        x = jnp.transpose(x, [ls.index(c) for c in kept])
        return x.reshape([x.shape[kept.index(c)] if c in ls else 1 for c in order])

    product = aligned(a, named[0]) * aligned(b, named[1])
    return total(product, tuple(range(len(output), len(order))))


def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    dimension_numbers: jax.lax.RaggedDotDimensionNumbers,
    out_dtype: jnp.dtype | None = None,
) -> jax.Array:
    """jax.lax.ragged_dot_general accumulated in fp32 and rounded once to `out_dtype` (default: lhs's);
    batch-invariant."""
    out_dtype = lhs.dtype if out_dtype is None else out_dtype
    lhs, rhs = _operands(lhs, rhs)
    if jax.default_backend() == "cpu":
        return round_to(_ragged_sum_of_products(lhs, rhs, group_sizes, dimension_numbers), out_dtype)
    out = jax.lax.ragged_dot_general(
        lhs, rhs, group_sizes, dimension_numbers, precision=HIGHEST, preferred_element_type=jnp.float32
    )
    return round_to(out, out_dtype)


def _ragged_sum_of_products(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, numbers: jax.lax.RaggedDotDimensionNumbers
) -> jax.Array:
    """ragged_dot_general with rows of lhs in groups along its dim 0 and rhs's groups along its dim 0 (the
    experts' form, no batch dims): each row against its own group's rhs, rows past the groups zero."""
    (lhs_contract, rhs_contract), batch = numbers.dot_dimension_numbers
    if any(batch) or list(numbers.lhs_ragged_dimensions) != [0] or list(numbers.rhs_group_dimensions) != [0]:
        raise ValueError(
            f"ragged dot numbers {numbers}: the CPU's sums take the experts' form only (lhs rows and "
            "rhs groups along dim 0, no batch dimensions)"
        )
    groups = rhs.shape[0]
    # each row's group: how many groups end at or before it (searchsorted's count, spelled as a comparison: jax's
    # searchsorted fails to trace under shard_map when the sizes vary over a mesh axis and the rows do not)
    ends = jnp.cumsum(group_sizes)
    group = jnp.sum(ends[None, :] <= jnp.arange(lhs.shape[0], dtype=ends.dtype)[:, None], axis=1)
    rows_rhs = rhs[jnp.minimum(group, groups - 1)]  # [M, rhs dims 1..]
    names = iter("abcdefghijklmnopqrstuvwxyz")
    lhs_letters = "".join(next(names) for _ in range(lhs.ndim))
    rhs_letters = lhs_letters[0] + "".join(
        lhs_letters[lhs_contract[list(rhs_contract).index(d)]] if d in rhs_contract else next(names)
        for d in range(1, rhs.ndim)
    )
    free = [c for i, c in enumerate(lhs_letters) if i not in lhs_contract]
    out_letters = "".join(free) + "".join(c for c in rhs_letters[1:] if c not in lhs_letters)
    out = _sum_of_products(f"{lhs_letters},{rhs_letters}->{out_letters}", lhs, rows_rhs)
    inside = (group < groups).reshape((-1,) + (1,) * (out.ndim - 1))
    return jnp.where(inside, out, jnp.zeros((), out.dtype))
