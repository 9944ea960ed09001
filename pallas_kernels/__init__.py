"""Pallas kernels for inkling_jax: one folder per op, each with a pure-jnp reference.

Kernels never import the model; the model calls each op through its folder's entry point, and the engine readies
the kernels' runtimes through this package (`import_kernel_runtimes`).
"""

from pallas_kernels.platform import import_kernel_runtimes

__all__ = ["import_kernel_runtimes"]
