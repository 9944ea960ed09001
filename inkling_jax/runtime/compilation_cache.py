"""The compiled programs' caches: `--compilation-cache DIR | none`.

A server or batch job compiles every step shape at start-up. With the cache on, two caches share DIR:

- `DIR/executables/`: the engine's step programs as serialized executables (`inkling_jax.runtime.executable_cache`),
  keyed by the code, versions, devices, mesh, model, options and argument shapes. A later process that matches
  loads each one without tracing, lowering or compiling it: a restart's warm-up takes seconds beyond the weights.
- `DIR` itself: JAX's persistent compilation cache, keyed by the lowered program, for every other program (and for
  the steps when the executable cache cannot serve them, e.g. on several processes): it skips XLA's compile, not
  the tracing and lowering before it.

On by default in `~/.cache/inkling_jax/xla` (under `$XDG_CACHE_HOME` when set); the `INKLING_JAX_COMPILATION_CACHE`
environment variable changes the default (a directory, or `none`); `none` turns both off. Neither cache evicts:
delete DIR (or DIR/executables) to reclaim its space.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import jax

ENVIRONMENT = "INKLING_JAX_COMPILATION_CACHE"
EXECUTABLES = "executables"  # the executable cache's subdirectory


def default_directory() -> str:
    """The flag's default: $INKLING_JAX_COMPILATION_CACHE, else inkling_jax/xla under the user's cache dir."""
    if os.environ.get(ENVIRONMENT):
        return os.environ[ENVIRONMENT]
    return str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "inkling_jax" / "xla")


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compilation-cache",
        default=default_directory(),
        metavar="DIR|none",
        help="cache of compiled programs: the step programs' executables in DIR/executables, "
        "JAX's persistent compilation cache in DIR (default: %(default)s; none: off)",
    )


def enable(directory: str) -> Path | None:
    """Cache every program this process compiles from now on in `directory` ("none": leave the cache off),
    whatever its compile time or size; call before the first compilation. Returns the directory used."""
    if directory == "none":
        return None
    path = Path(directory).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def executables(directory: Path | None) -> Path | None:
    """The executable cache's directory (the engine's `executable_cache`) in the cache `enable` returned; None
    when that is off."""
    return None if directory is None else directory / EXECUTABLES
