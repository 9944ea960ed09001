"""inkling_jax: an exact JAX/Pallas model of Inkling 2 Small, and what serving needs around it."""
