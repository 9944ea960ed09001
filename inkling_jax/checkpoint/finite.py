"""Non-finite values in loaded parameters, found on the devices that hold them.

A NaN or Inf in a checkpoint's weights or scales would load without complaint and make the logits NaN; the
loaders refuse such a checkpoint with a CheckpointError naming each tensor that holds one, and how many. As each
parameter is placed, one jitted program (a fused reduction: no copy of the parameter is made) has every device
flag the block of it that it holds, one flag per checkpoint tensor (per row of a stacked parameter). The devices
work apart, with no collective: XLA:CPU's collectives can deadlock between programs that run at once, as these
do. The flags stay on device until `FiniteCheck.raise_if_any` reads them together at the end of the load (one
host sync per load, not per tensor; with several processes, one all-gather of the flags so that every process
decides alike). Only flagged rows are then counted, on the host, one device's slice at a time.

What is non-finite depends on how a parameter stores its values:
- float (bf16, f16, f32): NaN and +-Inf;
- E4M3 (MXFP8 values, NVFP4 block scales; E4M3FN has no Inf): the NaN codes 0x7F and 0xFF;
- E8M0 (MXFP8 block scales, held as their uint8 bytes): the NaN code 0xFF;
- NVFP4 values (E2M1 codes, two per uint8): none, every code is a number.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec, Sharding

from inkling_jax.checkpoint.errors import CheckpointError
from pallas_kernels.block_formats import E4M3, E8M0_NAN

FLOAT, E4M3_CODES, E8M0_CODES = "float", "e4m3", "e8m0"
SHOWN = 8  # offending tensors an error lists by name


def value_kind(path: str, dtype: jnp.dtype) -> str | None:
    """How the parameter at `path` stores its values (FLOAT, E4M3_CODES, E8M0_CODES), or None when every stored
    value is a number (NVFP4's E2M1 codes)."""
    dtype = np.dtype(dtype)
    if dtype == E4M3:
        return E4M3_CODES
    if dtype == np.uint8:
        return E8M0_CODES if path.endswith(".scales") else None
    return FLOAT if jnp.issubdtype(dtype, jnp.floating) else None


def _non_finite(values: np.ndarray, kind: str) -> np.ndarray:
    """Where `values` (on the host) hold no number."""
    if kind == FLOAT:
        return ~np.isfinite(values)
    codes = values.view(np.uint8)
    return (codes & 0x7F) == 0x7F if kind == E4M3_CODES else codes == E8M0_NAN


def _marks(x: jax.Array, kind: str) -> jax.Array:
    """float32 of `x`'s shape: 0 where `x` holds a number, NaN or 1 where it does not. Arithmetic only (no
    compare or select), so that a sum over it is one vectorized pass: on XLA:CPU about ten times faster than
    summing a comparison, which makes the difference to a load from the page cache."""
    if kind == FLOAT:
        return x.astype(jnp.float32) * 0  # NaN and +-Inf times 0 are NaN
    codes = jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.float32)
    if kind == E8M0_CODES:
        return jnp.maximum(codes - (E8M0_NAN - 1), 0)  # 1 at 0xFF
    magnitude = codes - 128 * jnp.floor(codes / 128)  # the code without its sign bit
    return jnp.maximum(magnitude - 126, 0)  # 1 at 0x7F and 0xFF


def _axes(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


@functools.cache
def _flags_fn(kind: str, per_row: bool, sharding: Sharding):
    """Each device's flags of its own block of `x`, stacked on a leading axis (one entry per device, or per group
    of devices that hold different rows): [devices] or [devices, rows]."""

    def flags(x: jax.Array) -> jax.Array:
        axes = tuple(range(1 if per_row else 0, x.ndim))
        return (_marks(x, kind).sum(axis=axes) != 0)[None]  # NaN != 0 too

    if not isinstance(sharding, NamedSharding):
        return jax.jit(flags)
    spec = sharding.spec
    rows = spec[0] if per_row and len(spec) else None
    devices = tuple(axis for axis in sharding.mesh.axis_names if axis not in _axes(rows))
    out = PartitionSpec(devices, rows) if per_row else PartitionSpec(devices)
    local = jax.shard_map(flags, mesh=sharding.mesh, in_specs=spec, out_specs=out, check_vma=False)
    return jax.jit(local)


def _held(array: jax.Array) -> np.ndarray:
    """A small array's value as far as this process holds it (zeros elsewhere)."""
    if array.is_fully_addressable:
        return np.asarray(array)
    held = np.zeros(array.shape, array.dtype)
    for shard in array.addressable_shards:
        held[shard.index] = np.asarray(shard.data)
    return held


def _across_processes(local: np.ndarray) -> np.ndarray:
    """Summed over the processes (each holds its share: zeros where it holds nothing)."""
    if jax.process_count() == 1:
        return local
    return np.asarray(multihost_utils.process_allgather(local)).sum(axis=0)


def _counted(array: jax.Array, kind: str, per_row: bool, flagged: np.ndarray) -> np.ndarray:
    """The non-finite values of each flagged row of `array` (of a plain parameter: of the whole), counted on the
    host one device's slice at a time; each slice once, where its first replica lies; summed over processes."""
    counts = np.zeros(len(flagged), np.int64)
    for shard in array.addressable_shards:
        if shard.replica_id:
            continue
        if not per_row:
            counts[0] += _non_finite(np.asarray(shard.data), kind).sum()
            continue
        for local, row in enumerate(range(*shard.index[0].indices(array.shape[0]))):
            if flagged[row]:
                counts[row] += _non_finite(np.asarray(shard.data[local]), kind).sum()
    return _across_processes(counts)


def non_finite_message(where: str, offending: Sequence[tuple[str, int]]) -> str:
    """One line naming the offending tensors (the first SHOWN of them) and how many non-finite values each holds."""
    parts = [f"tensor {name!r} holds {count} non-finite value{'s' if count > 1 else ''}" for name, count in offending]
    more = len(parts) - SHOWN
    return f"{where}: " + "; ".join(parts[:SHOWN]) + (f"; and {more} more tensors" if more > 0 else "")


class FiniteCheck:
    """The flags of a load's parameters, queued on device as they are placed and read once at the end."""

    def __init__(self) -> None:
        self._queued: list[tuple[jax.Array, str, list[str | None], bool, jax.Array]] = []

    def add(self, array: jax.Array, kind: str | None, names: str | Sequence[str | None]) -> None:
        """Queue the check of a placed parameter (`kind`: `value_kind`'s; None checks nothing). `names`: the
        tensor it holds, or for a stacked parameter the tensor each row holds (None for a row no tensor fills)."""
        if kind is None:
            return
        per_row = not isinstance(names, str)
        flags = _flags_fn(kind, per_row, array.sharding)(array)
        self._queued.append((array, kind, list(names) if per_row else [names], per_row, flags))

    def raise_if_any(self, where: str) -> None:
        """Read every queued flag (one sync); CheckpointError naming each tensor that holds a non-finite value."""
        if not self._queued:
            return
        held = [_held(flags).any(axis=0).reshape(-1) for *_, flags in self._queued]
        every = _across_processes(np.concatenate(held).astype(np.int32))
        found, start = [], 0
        for (array, kind, names, per_row, _), flags in zip(self._queued, held, strict=True):
            flagged, start = every[start : start + len(flags)], start + len(flags)
            if flagged.any():
                counts = _counted(array, kind, per_row, flagged)
                found += [(name, int(count)) for name, count in zip(names, counts, strict=True) if count]
        if found:
            raise CheckpointError(non_finite_message(where, found))
