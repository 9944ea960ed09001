"""Shared test setup: CPU JAX with 8 host devices (multi-device tests), compiled without LLVM's optimisations
(the tests' programs are tiny and compile-bound: a quarter off the suite; IEEE semantics are the same)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
FLAGS = " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + FLAGS).strip()
