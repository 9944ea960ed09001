"""JAX's persistent compilation cache for the step programs: `--compilation-cache DIR | none`.

A server or batch job compiles every step shape at start-up; with the cache on, a later process with the
same model shapes, mesh, flags and JAX version reads the compiled programs from DIR instead of compiling
them again. On by default in `~/.cache/inkling_jax/xla` (under `$XDG_CACHE_HOME` when set); the
`INKLING_JAX_COMPILATION_CACHE` environment variable changes the default (a directory, or `none`).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import jax

ENVIRONMENT = "INKLING_JAX_COMPILATION_CACHE"


def default_directory() -> str:
    """The flag's default: $INKLING_JAX_COMPILATION_CACHE, else inkling_jax/xla under the user's cache dir."""
    if os.environ.get(ENVIRONMENT):
        return os.environ[ENVIRONMENT]
    return str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "inkling_jax" / "xla")


def add_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compilation-cache", default=default_directory(), metavar="DIR|none",
                        help="JAX's persistent compilation cache for the step programs (default: %(default)s; "
                             "none: off)")  # fmt: skip


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
