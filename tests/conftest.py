"""Shared test setup: CPU JAX with 8 host devices (multi-device tests), compiled without LLVM's optimisations
(the tests' programs are tiny and compile-bound: a quarter off the suite; IEEE semantics are the same).

Compiled programs also go to a compilation cache private to this process (removed at exit; each of `make test`'s
two xdist workers has its own, and runs whole test files): each engine jits
its step afresh, so tests that build engines of the same shapes would otherwise compile the same program
again (a cache hit skips only XLA's compilation; tracing, lowering and every run are the test's own)."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
FLAGS = " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + FLAGS).strip()

import jax  # noqa: E402  (after XLA_FLAGS, which the backend reads once)

CACHE = tempfile.mkdtemp(prefix="inkling-jax-tests-")
atexit.register(shutil.rmtree, CACHE, ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)  # the engines' steps, not every small jit
