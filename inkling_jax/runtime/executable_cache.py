"""Compiled step programs kept on disk as serialized executables, so that a restart neither traces, lowers nor
compiles them.

JAX's persistent compilation cache (`inkling_jax.runtime.compilation_cache`) skips only XLA's compile: its key is
the lowered program, so a process still traces the step and lowers it (Mosaic GPU kernels included) before it can
look. This cache is looked up before tracing: an entry is the executable `jax.experimental.serialize_executable`
makes of a compiled step, filed under a key of everything that decides the program without building it:

- the software: jax, jaxlib, flax, numpy, ml_dtypes and the JAX plugins' versions, Python's, and a digest of every
  .py file of `inkling_jax` and `pallas_kernels` (the code that defines the step);
- the process: JAX's configuration (less its logging, cache and debugging-output settings), XLA_FLAGS and
  LIBTPU_INIT_ARGS;
- the devices: the backend's platform and version, each mesh device's id, kind and compute capability in the
  mesh's order, the mesh's axis names and shape, the device and process counts;
- the program: its name, static options (width, speculative, num_top, ...), the model's graph definition (its
  structure and every static attribute, the config among them), and the arguments' tree structure and each
  leaf's shape, dtype, weak type and sharding.

A mismatch anywhere is a miss (the program is compiled and stored under the new key); the directory keeps every
entry until it is deleted. An entry that cannot be read back (truncated, corrupt, from another build) is logged,
deleted and compiled again; entries are written to a temporary file and renamed, so a reader never sees half of
one. A backend that cannot serialize its executables turns the cache off for the process (logged once). Only
single-process runs use it (a multi-host program's executable is not one process's to store). Programs compiled
while it is on bypass JAX's persistent cache (`ExecutableCache.compile`): an executable read back from there does
not re-serialize whole on every backend, so what is stored is always XLA's own output.

Entries are pickles: load only directories you wrote yourself.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import io
import logging
import os
import pickle
import re
import sys
import threading
import uuid
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from pathlib import Path

import jax
from jax.experimental import serialize_executable
from jax.experimental.compilation_cache import compilation_cache as persistent_cache
from jax.sharding import Mesh

logger = logging.getLogger(__name__)

MAGIC = b"inkling_jax executable v1\n"
SUFFIX = ".exe"
PACKAGES = (
    "jax",
    "jaxlib",
    "flax",
    "numpy",
    "ml_dtypes",
    "jax-cuda12-plugin",
    "jax-cuda12-pjrt",
    "jax-cuda13-plugin",
    "jax-cuda13-pjrt",
    "libtpu",
)
ENVIRONMENT = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
# JAX settings that cannot change a compiled program: where caches and logs go, and what gets printed
UNRELATED_CONFIG = re.compile(r"cache|log|dump|pprint|traceback|explain|timeout|mtls|transfer_guard")
ROOTS = ("inkling_jax", "pallas_kernels")  # the packages whose code defines the step


@functools.cache
def source_digest() -> str:
    """sha256 over every .py file of the packages that define the step (paths and contents, in path order);
    computed once per process."""
    digest = hashlib.sha256()
    for root in ROOTS:
        package = Path(__import__(root).__file__).resolve().parent
        for path in sorted(package.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            digest.update(f"{root}/{path.relative_to(package).as_posix()}\0".encode())
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def _software() -> str:
    return repr(
        {
            "python": sys.version,
            "packages": {package: _version(package) for package in PACKAGES},
            "jax": jax.__version__,
            "source": source_digest(),
        }
    )


def _process() -> str:
    config = {name: repr(value) for name, value in sorted(jax.config.values.items())}
    config = {name: value for name, value in config.items() if not UNRELATED_CONFIG.search(name)}
    return repr({"config": config, "environment": {name: os.environ.get(name) for name in ENVIRONMENT}})


def _devices(mesh: Mesh) -> str:
    devices = list(mesh.devices.flat)
    client = devices[0].client
    return repr(
        {
            "platform": client.platform,
            "platform_version": client.platform_version,
            "devices": [(d.id, d.platform, d.device_kind, getattr(d, "compute_capability", None)) for d in devices],
            "axes": tuple(mesh.axis_names),
            "shape": tuple(mesh.devices.shape),
            "axis_types": repr(getattr(mesh, "axis_types", None)),
            "device_count": jax.device_count(),
            "processes": jax.process_count(),
        }
    )


def _leaf(x: object) -> tuple:
    return (tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)), repr(x.sharding))


def signature(args: object) -> str:
    """The arguments as the program sees them: tree structure, and per leaf shape, dtype, weak type, sharding."""
    leaves, tree = jax.tree.flatten(args)
    return repr((str(tree), [_leaf(x) for x in leaves]))


def program_key(name: str, mesh: Mesh, options: dict[str, object], static: object, args: object) -> str:
    """The entry's file name for program `name` on `mesh` with static `options`, the static part of the function
    (`static`, e.g. its graph definition: whose repr must not depend on object identity) and the arguments `args`
    (arrays or ShapeDtypeStructs, as the program is called): what decides the program, in any process."""
    parts = (
        MAGIC.decode(),
        name,
        _software(),
        _process(),
        _devices(mesh),
        repr(sorted(options.items())),
        hashlib.sha256(repr(static).encode()).hexdigest(),
        signature(args),
    )
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()
    label = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-")
    return f"{label}-{digest}{SUFFIX}"


class ProgramTable:
    """Compiled programs by key for the engines of one process to share: the `capacity` most recently used. Bounded,
    since each program keeps its machine code mapped (an XLA:CPU step program some thousands of memory mappings, of
    the 65,530 Linux allows a process by default) and its device buffers; an engine keeps the programs it runs."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._programs: OrderedDict[Hashable, jax.stages.Compiled] = OrderedDict()
        self._lock = threading.Lock()  # engines look up and store from their compile threads

    def get(self, key: Hashable) -> jax.stages.Compiled | None:
        """The program under `key`, now the most recently used; None if the table has none."""
        with self._lock:
            if key in self._programs:
                self._programs.move_to_end(key)
            return self._programs.get(key)

    def put(self, key: Hashable, program: jax.stages.Compiled) -> jax.stages.Compiled:
        """Keep `program` under `key`, dropping the least recently used beyond the capacity; returns it."""
        with self._lock:
            self._programs[key] = program
            self._programs.move_to_end(key)
            while len(self._programs) > self.capacity:
                self._programs.popitem(last=False)
        return program

    def clear(self) -> None:
        with self._lock:
            self._programs.clear()

    def __len__(self) -> int:
        return len(self._programs)


class ExecutableCache:
    """Serialized executables in `directory` (created on first store)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory).expanduser()
        self.off = jax.process_count() > 1
        if self.off:
            logger.info("executable cache off: %d processes (each compiles its own step programs)", jax.process_count())

    def load(self, key: str, args: object, devices: Sequence[jax.Device]) -> jax.stages.Compiled | None:
        """The executable stored under `key`, loaded on `devices` (the program's device assignment, in order), or
        None: no entry, or one that cannot be used (logged and deleted). `args` is how it will be called: an entry
        of another tree structure is not loaded."""
        if self.off:
            return None
        path = self.directory / key
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as error:
            logger.warning("executable cache: cannot read %s (%s): compiling instead", path, error)
            return None
        try:
            compiled = _decode(blob, key, args, devices)
        except Exception as error:  # (any failure to read an entry back is a miss)
            logger.warning(
                "executable cache: %s is unusable (%s: %s): deleted, compiling instead",
                path,
                type(error).__name__,
                error,
            )
            path.unlink(missing_ok=True)
            return None
        return compiled

    def compile(self, lowered: jax.stages.Lowered, options: dict[str, object] | None = None) -> jax.stages.Compiled:
        """`lowered.compile(options)` (XLA options added to the jit's), with JAX's persistent compilation cache
        bypassed while this cache is on: an executable read back from there does not serialize whole on every
        backend (on CPU a copy of one lacks compiled functions and fails when it runs: "Function ... not found"),
        so what is stored is always fresh from XLA."""
        if self.off:
            return lowered.compile(options or None)
        with _BYPASS:
            return lowered.compile(options or None)

    def store(self, key: str, compiled: jax.stages.Compiled) -> bool:
        """Write `compiled` under `key` (atomically); False if this backend cannot serialize it (the cache is then
        off for this process, logged once) or the write failed (logged)."""
        if self.off:
            return False
        try:
            payload, in_tree, out_tree = serialize_executable.serialize(compiled)
            body = pickle.dumps(
                {"key": key, "payload": payload, "in_tree": in_tree, "out_tree": out_tree},
                protocol=pickle.HIGHEST_PROTOCOL,
            )
        except Exception as error:  # (a backend or program that cannot be serialized)
            _serialization_failed(error)
            self.off = True
            return False
        blob = MAGIC + hashlib.sha256(body).digest() + len(body).to_bytes(8, "little") + body
        temporary = self.directory / f".partial-{os.getpid()}-{uuid.uuid4().hex}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with open(temporary, "xb") as file:  # the umask's permissions, as the compilation cache's files get
                file.write(blob)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, self.directory / key)
        except OSError as error:
            logger.warning("executable cache: cannot write %s (%s)", self.directory / key, error)
            temporary.unlink(missing_ok=True)
            return False
        return True


class _PersistentCacheOff:
    """JAX's persistent compilation cache off while any compile for an executable cache runs (several may run at
    once, one per step shape): the first to enter turns it off, the last to leave turns it back as it was."""

    def __init__(self):
        self._lock = threading.Lock()
        self._inside = 0
        self._enabled = False

    def __enter__(self) -> None:
        with self._lock:
            if not self._inside:
                self._enabled = jax.config.jax_enable_compilation_cache
                jax.config.update("jax_enable_compilation_cache", False)
                persistent_cache.reset_cache()  # JAX decides once whether its cache is used: decide again, off
            self._inside += 1

    def __exit__(self, *_: object) -> None:
        with self._lock:
            self._inside -= 1
            if not self._inside:
                jax.config.update("jax_enable_compilation_cache", self._enabled)
                persistent_cache.reset_cache()


_BYPASS = _PersistentCacheOff()
_warned = []  # the serialization failure is logged once per process


def _serialization_failed(error: Exception) -> None:
    if _warned:
        return
    _warned.append(error)
    logger.warning(
        "executable cache off: this backend cannot serialize the step programs (%s: %s)", type(error).__name__, error
    )


def _decode(blob: bytes, key: str, args: object, devices: Sequence[jax.Device]) -> jax.stages.Compiled:
    header = len(MAGIC) + 32 + 8
    if blob[: len(MAGIC)] != MAGIC:
        raise ValueError("not an executable cache entry of this version")
    checksum, size = blob[len(MAGIC) : len(MAGIC) + 32], int.from_bytes(blob[len(MAGIC) + 32 : header], "little")
    body = blob[header:]
    if len(body) != size:
        raise ValueError(f"truncated: {len(body)} of {size} bytes")
    if hashlib.sha256(body).digest() != checksum:
        raise ValueError("checksum mismatch")
    entry = pickle.load(io.BytesIO(body))
    if entry["key"] != key:
        raise ValueError("stored under another key")
    expected = jax.tree.structure((tuple(args), {}))
    if entry["in_tree"] != expected:
        raise ValueError("its arguments' tree structure differs")
    return serialize_executable.deserialize_and_load(
        entry["payload"],
        entry["in_tree"],
        entry["out_tree"],
        backend=devices[0].client,
        execution_devices=list(devices),
    )
