"""Lazy safetensors reading (single file or sharded with an index) and writing, any dtype.

Tensors are memory-mapped one at a time (each its own mapping, released with its last view) and handed
out as numpy arrays, or slices of them; bfloat16 and the float8 formats come back as ml_dtypes arrays,
which the `safetensors` numpy API cannot represent.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class SafetensorsError(ValueError):
    """A checkpoint file that cannot be read as safetensors; the message names file and tensor."""


class Entry(NamedTuple):
    """One tensor's header entry, validated."""

    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def _entry(path: Path, name: str, raw: object, data_size: int) -> Entry:
    """Validate a header entry: known dtype, non-negative integer shape, a byte range that holds it."""
    try:
        dtype_name, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]  # type: ignore[index]
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise TypeError(f"shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise TypeError(f"data_offsets {offsets!r}")
    except (KeyError, TypeError) as error:
        raise SafetensorsError(f"{path}: tensor {name!r} has a malformed header entry ({error})") from error
    dtype = DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise SafetensorsError(f"{path}: tensor {name!r} has unsupported dtype {dtype_name!r}")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size or end - begin != math.prod(shape) * dtype.itemsize:
        raise SafetensorsError(
            f"{path}: tensor {name!r} byte range {begin}..{end} does not hold {shape} of {dtype_name}"
        )
    return Entry(dtype, tuple(shape), begin, end)


class _File:
    def __init__(self, path: Path):
        self.path = path
        try:
            size = path.stat().st_size
            with path.open("rb") as f:
                prefix = f.read(8)
                (header_size,) = struct.unpack("<Q", prefix) if len(prefix) == 8 else (None,)
                if header_size is None or header_size > size - 8:
                    raise SafetensorsError(f"{path} is not a safetensors file (bad header size)")
                header = json.loads(f.read(header_size))
        except OSError as error:
            raise SafetensorsError(f"cannot read {path}: {error}") from error
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise SafetensorsError(f"{path}: header is not JSON: {error}") from error
        if not isinstance(header, dict):
            raise SafetensorsError(f"{path}: header is not a JSON object")
        header.pop("__metadata__", None)
        self.data_start = 8 + header_size
        data_size = size - self.data_start
        self.entries = {name: _entry(path, name, raw, data_size) for name, raw in header.items()}

    def read(self, name: str) -> np.ndarray:
        """A read-only memory map of one tensor's bytes: unmapped, its pages out of this process's
        resident memory, once the last view of it is dropped."""
        entry = self.entries[name]
        if entry.nbytes == 0:
            return np.empty(entry.shape, entry.dtype)
        return np.memmap(self.path, entry.dtype, "r", self.data_start + entry.begin, entry.shape)


def _weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
        raise SafetensorsError(f"{index} has no valid 'weight_map': {error!r}") from error
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise SafetensorsError(f"{index}: 'weight_map' must map tensor names to file names")
    return weight_map


class CheckpointFiles:
    """The tensors of a checkpoint directory (or one .safetensors file), read lazily by name."""

    def __init__(self, path: str | Path):
        path = Path(path)
        self._where: dict[str, _File] = {}
        if path.is_file():
            single = _File(path)
            self._where = dict.fromkeys(single.entries, single)
            return
        index = path / INDEX_FILE
        if index.exists():
            files: dict[str, _File] = {}
            for name, file in _weight_map(index).items():
                if file not in files:
                    if not (path / file).is_file():
                        raise SafetensorsError(f"{index} names {file} for {name!r}, which does not exist")
                    files[file] = _File(path / file)
                if name not in files[file].entries:
                    raise SafetensorsError(f"{index} puts {name!r} in {file}, which does not hold it")
                self._where[name] = files[file]
        elif (path / SINGLE_FILE).exists():
            single = _File(path / SINGLE_FILE)
            self._where = dict.fromkeys(single.entries, single)
        else:
            raise SafetensorsError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")

    def names(self) -> list[str]:
        return sorted(self._where)

    def entry(self, name: str) -> Entry:
        """dtype, shape and byte range of a tensor, from the header alone."""
        return self._where[name].entries[name]

    def read(self, name: str, index: tuple[slice, ...] = ()) -> np.ndarray:
        """A tensor, or its `index` slice, as a view of the memory-mapped file: only the pages the
        caller then touches are read from disk."""
        tensor = self._where[name].read(name)
        return tensor[index] if index else tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


class TensorSpec(NamedTuple):
    """What a streamed tensor will be: its name, dtype and shape."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


Chunks = Callable[[TensorSpec], Iterator[np.ndarray]]


def write_streamed(path: str | Path, specs: Sequence[TensorSpec], chunks: Chunks) -> None:
    """Write one safetensors file whose tensors arrive as chunks (consecutive row-major pieces), so that
    no more than a chunk is in memory at a time."""
    header: dict[str, dict] = {}
    offset = 0
    for spec in specs:
        header[spec.name] = {
            "dtype": _NAMES[np.dtype(spec.dtype)],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with Path(path).open("wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for spec in specs:
            written = 0
            for chunk in chunks(spec):
                chunk = np.asarray(chunk)
                if chunk.dtype != np.dtype(spec.dtype):
                    raise ValueError(f"chunk of {spec.name!r} has dtype {chunk.dtype}, declared {spec.dtype}")
                f.write(chunk.tobytes())
                written += chunk.nbytes
            if written != spec.nbytes:
                raise ValueError(f"{spec.name!r}: wrote {written} bytes, declared {spec.nbytes}")


def split_by_bytes(specs: Sequence[TensorSpec], shard_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive groups of tensors of about `shard_bytes` each (a larger tensor gets its own)."""
    shards: list[list[TensorSpec]] = [[]]
    for spec in specs:
        if shards[-1] and sum(s.nbytes for s in shards[-1]) + spec.nbytes > shard_bytes:
            shards.append([])
        shards[-1].append(spec)
    return shards


def write_sharded_streamed(directory: str | Path, shards: Sequence[Sequence[TensorSpec]], chunks: Chunks) -> None:
    """Write each group of tensors as one shard file, plus model.safetensors.index.json."""
    directory = Path(directory)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_streamed(directory / file, shard, chunks)
        weight_map.update(dict.fromkeys((spec.name for spec in shard), file))
    total = sum(spec.nbytes for shard in shards for spec in shard)
    (directory / INDEX_FILE).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )


def _in_memory(tensors: Mapping[str, np.ndarray]) -> tuple[list[TensorSpec], Chunks]:
    arrays = {name: np.asarray(array) for name, array in tensors.items()}
    specs = [TensorSpec(name, array.dtype, array.shape) for name, array in arrays.items()]
    return specs, lambda spec: iter([arrays[spec.name]])


def write_safetensors(path: str | Path, tensors: Mapping[str, np.ndarray]) -> None:
    """Write numpy (and ml_dtypes) arrays as one safetensors file."""
    write_streamed(path, *_in_memory(tensors))


def write_sharded(directory: str | Path, tensors: Mapping[str, np.ndarray], num_shards: int) -> None:
    """Write tensors over `num_shards` files plus model.safetensors.index.json."""
    specs, chunks = _in_memory(tensors)
    write_sharded_streamed(directory, [specs[i::num_shards] for i in range(num_shards)], chunks)
