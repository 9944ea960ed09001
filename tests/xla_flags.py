"""The XLA flags the suite's processes run under (tests/conftest.py sets them before JAX starts), and the
environment of a child process that should compile as a user's run does."""

import os

DEVICES = "--xla_force_host_platform_device_count=8"  # multi-device tests on one CPU
UNOPTIMIZED = "--xla_backend_optimization_level=0"  # the tests' programs are tiny and compile-bound
UNVERIFIED = "--xla_disable_hlo_passes=hlo-verifier"  # XLA's checks of its own passes: a tenth of each compile
# an engine's compiler_options where a test runs many steps of it: LLVM's optimisations back on for its step
# programs (they lengthen each compile, and pay for it only over many steps)
OPTIMIZED_STEPS = {"xla_backend_optimization_level": 2}


def optimized_environment() -> dict[str, str]:
    """os.environ with XLA's default optimization: for a child process whose time goes to running its programs
    rather than compiling them (a server under load, a user's run)."""
    flags = os.environ.get("XLA_FLAGS", "").replace(UNOPTIMIZED, "").split()
    return {**os.environ, "XLA_FLAGS": " ".join(flags)}
