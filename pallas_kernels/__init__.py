"""Pallas kernels for inkling_jax: one folder per op, each with a pure-jnp reference.

Kernels never import the model; the model calls each op through its folder's entry point.
"""
