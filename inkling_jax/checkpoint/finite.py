"""Non-finite values in loaded parameters, found on the devices that hold them.

A NaN or Inf in a checkpoint's weights or scales would load without complaint and make the logits NaN; the
loaders refuse such a checkpoint with a CheckpointError naming each tensor that holds one, and how many. As each
parameter is placed, a jitted reduction (fused: no copy of the parameter is made) turns it into one flag per
checkpoint tensor it holds: one for a plain parameter, one per row of a stacked one. The flags stay on device
until `FiniteCheck.raise_if_any` reads them together at the end of the load, so the check adds one host sync to
a load, not one per tensor; only the parameters whose flags are set are then counted, to name their tensors.

What is non-finite depends on how a parameter stores its values:
- float (bf16, f16, f32): NaN and +-Inf;
- E4M3 (MXFP8 values, NVFP4 block scales; E4M3FN has no Inf): the NaN codes 0x7F and 0xFF;
- E8M0 (MXFP8 block scales, held as their uint8 bytes): the NaN code 0xFF;
- NVFP4 values (E2M1 codes, two per uint8): none, every code is a number.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from inkling_jax.checkpoint.errors import CheckpointError
from pallas_kernels.block_formats import E4M3, E8M0_NAN

FLOAT, E4M3_CODES, E8M0_CODES = "float", "e4m3", "e8m0"
SHOWN = 8  # offending tensors an error lists by name
_INT32_LIMIT = 2**31  # counts are summed on device in int32, at most this many values per sum


def value_kind(path: str, dtype: jnp.dtype) -> str | None:
    """How the parameter at `path` stores its values (FLOAT, E4M3_CODES, E8M0_CODES), or None when every stored
    value is a number (NVFP4's E2M1 codes)."""
    dtype = np.dtype(dtype)
    if dtype == E4M3:
        return E4M3_CODES
    if dtype == np.uint8:
        return E8M0_CODES if path.endswith(".scales") else None
    return FLOAT if jnp.issubdtype(dtype, jnp.floating) else None


def _non_finite(x: jax.Array, kind: str) -> jax.Array:
    """Where `x` holds no number (bool, `x`'s shape)."""
    if kind == FLOAT:
        return ~jnp.isfinite(x)
    codes = jax.lax.bitcast_convert_type(x, jnp.uint8)
    return (codes & 0x7F) == 0x7F if kind == E4M3_CODES else codes == E8M0_NAN


def _marks(x: jax.Array, kind: str) -> jax.Array:
    """float32 of `x`'s shape: 0 where `x` holds a number, NaN or 1 where it does not. Arithmetic only (no
    compare or select), so that a sum over it is one vectorized pass: on XLA:CPU about ten times faster than
    reducing `_non_finite`, which makes the difference to a load from the page cache."""
    if kind == FLOAT:
        return x.astype(jnp.float32) * 0  # NaN and +-Inf times 0 are NaN
    codes = jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.float32)
    if kind == E8M0_CODES:
        return jnp.maximum(codes - (E8M0_NAN - 1), 0)  # 1 at 0xFF
    magnitude = codes - 128 * jnp.floor(codes / 128)  # the code without its sign bit
    return jnp.maximum(magnitude - 126, 0)  # 1 at 0x7F and 0xFF


def _replicated(array: jax.Array) -> Sharding:
    """The result sharding of a reduction of `array`: whole on each of its devices, so that every process can
    read it (a multi-process mesh included)."""
    sharding = array.sharding
    return NamedSharding(sharding.mesh, PartitionSpec()) if isinstance(sharding, NamedSharding) else sharding


@functools.cache
def _flags_fn(kind: str, per_row: bool, sharding: Sharding):
    """Whether `x` holds a non-finite value: one bool, or one per leading row."""

    def flags(x: jax.Array) -> jax.Array:
        axes = tuple(range(1 if per_row else 0, x.ndim))
        return _marks(x, kind).sum(axis=axes) != 0  # NaN != 0 too

    return jax.jit(flags, out_shardings=sharding)


@functools.cache
def _counts_fn(kind: str, keep: int, sharding: Sharding):
    """The non-finite values of `x`, counted over every axis after the first `keep`."""

    def counts(x: jax.Array) -> jax.Array:
        return _non_finite(x, kind).sum(axis=tuple(range(keep, x.ndim)), dtype=jnp.int32)

    return jax.jit(counts, out_shardings=sharding)


def _counted(array: jax.Array, kind: str, names: str | Sequence[str | None]) -> list[tuple[str, int]]:
    """(tensor name, non-finite values) for each tensor of `array` that holds any."""
    keep = 0 if isinstance(names, str) else 1
    while math.prod(array.shape[keep:]) >= _INT32_LIMIT:  # keep leading axes until each sum fits in int32
        keep += 1
    counts = np.asarray(_counts_fn(kind, keep, _replicated(array))(array), np.int64)
    if isinstance(names, str):
        return [(names, int(counts.sum()))]
    per_row = counts.reshape(len(names), -1).sum(axis=1)
    return [(name, int(count)) for name, count in zip(names, per_row, strict=True) if count]


def non_finite_message(where: str, offending: Sequence[tuple[str, int]]) -> str:
    """One line naming the offending tensors (the first SHOWN of them) and how many non-finite values each holds."""
    parts = [f"tensor {name!r} holds {count} non-finite value{'s' if count > 1 else ''}" for name, count in offending]
    more = len(parts) - SHOWN
    return f"{where}: " + "; ".join(parts[:SHOWN]) + (f"; and {more} more tensors" if more > 0 else "")


class FiniteCheck:
    """The flags of a load's parameters, queued on device as they are placed and read once at the end."""

    def __init__(self) -> None:
        self._queued: list[tuple[jax.Array, str, str | Sequence[str | None], jax.Array]] = []

    def add(self, array: jax.Array, kind: str | None, names: str | Sequence[str | None]) -> None:
        """Queue the check of a placed parameter (`kind`: `value_kind`'s; None checks nothing). `names`: the
        tensor it holds, or for a stacked parameter the tensor each row holds (None for a row no tensor fills)."""
        if kind is None:
            return
        flags = _flags_fn(kind, not isinstance(names, str), _replicated(array))(array)
        self._queued.append((array, kind, names, flags))

    def raise_if_any(self, where: str) -> None:
        """Read every queued flag (one sync); CheckpointError naming each tensor that holds a non-finite value."""
        flags = jax.device_get([flags for *_, flags in self._queued])
        found = []
        for (array, kind, names, _), flag in zip(self._queued, flags, strict=True):
            if flag.any():
                found += _counted(array, kind, names)
        if found:
            raise CheckpointError(non_finite_message(where, found))
