"""How an op's entry point chooses its implementation (`pallas_kernels.backends`)."""

import types

import jax

from pallas_kernels.backends import Backends, references_only


def test_within_references_only_auto_takes_the_reference():
    ops = Backends("op", "apply", types.ModuleType("reference"))
    ops.register("kernel", types.ModuleType("kernel"), platform=jax.default_backend(), takes=lambda *operands: True)
    ops.register("elsewhere", types.ModuleType("elsewhere"), platform="nowhere", takes=lambda *operands: True)
    assert ops.choose("auto") == "kernel"
    with references_only():
        assert ops.choose("auto") == "reference" and ops.choose("kernel") == "kernel"  # a named one stays named
        with references_only():
            pass
        assert ops.choose("auto") == "reference"  # the inner exit leaves the outer in force
    assert ops.choose("auto") == "kernel"
