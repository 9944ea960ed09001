"""gRPC serving for inkling_jax (issue 6)."""
