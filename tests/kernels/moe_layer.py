"""The check both expert-kernel test files make of a MoE layer whose experts were laid out for a kernel: expert
parallelism over tp2 (conftest's 8 simulated devices) gives the single-device output."""

import jax
import numpy as np
from flax import nnx

from inkling_jax.sharding import make_mesh, shard_model


def assert_tp2_matches(layer: nnx.Module, text, x: jax.Array, want: np.ndarray) -> None:
    """The layer split over experts on a tp2 mesh (fp32 partial sums per device, added in another order)."""
    mesh = make_mesh("tp2", text)
    sharded = shard_model(layer, mesh)
    assert all(leaf.sharding.spec[0] == "model" for leaf in jax.tree.leaves(sharded.experts.weights()))
    with jax.set_mesh(mesh):
        graphdef, state = nnx.split(sharded)
        split = np.asarray(jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))(state, x), np.float32)
    np.testing.assert_allclose(split, want, rtol=2**-7, atol=2**-9 * np.abs(want).max())
