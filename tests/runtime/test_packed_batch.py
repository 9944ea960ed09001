"""The packed host batch: every array of a StepBatch comes out of the one buffer bit for bit, split by replica."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from inkling_jax.runtime.packed_batch import BatchLayout
from inkling_jax.sampling import SamplingParams
from inkling_jax.sharding import DATA, MODEL
from inkling_jax.step import StepBatch

REPLICAS, SLOTS, TOKENS, LANES, PAGES = 2, 6, 10, 4, 3  # TOKENS and LANES over all replicas


def random_batch(rng: np.random.Generator) -> StepBatch:
    """A host batch of fresh random values of every kind a StepBatch holds, float specials included."""

    def ints(size, shape=None):
        return rng.integers(-(2**31), 2**31 - 1, size if shape is None else shape, dtype=np.int32, endpoint=True)

    def flags():
        return rng.random(SLOTS) < 0.5

    def floats():
        values = rng.standard_normal(SLOTS).astype(np.float32)
        values[:3] = [np.nan, -0.0, np.inf]
        return rng.permutation(values)

    sampling = SamplingParams(
        floats(),
        ints(SLOTS),
        floats(),
        floats(),
        floats(),
        floats(),
        floats(),
        rng.integers(0, 2**32, SLOTS, dtype=np.uint32),
        ints(SLOTS),
    )
    return StepBatch(ints(TOKENS), ints(SLOTS), ints(SLOTS), ints(LANES), ints(LANES), ints(LANES), flags(), flags(),
                     flags(), flags(), flags(), flags(), flags(), ints(None, (SLOTS, PAGES)), sampling)  # fmt: skip


def bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x if x.dtype == bool else x.view(np.uint32)


def test_every_array_comes_back_bit_for_bit_on_its_replica():
    """Packed on the host, placed split by replica over a dp2 mesh and unpacked in a jitted program: each array
    equals the host's in value and bits (NaN, -0.0, inf, full-range int32 and uint32), and each replica's row of
    the buffer holds only its own slots', tokens' and lanes' values."""
    rng = np.random.default_rng()
    batch = random_batch(rng)
    layout = BatchLayout.of(batch, REPLICAS)
    packed = layout.pack(batch)
    assert packed.dtype == np.int32 and packed.shape == (REPLICAS, layout.words)
    mesh = Mesh(np.asarray(jax.devices()[:REPLICAS]).reshape(REPLICAS, 1), (DATA, MODEL))
    on_mesh = jax.device_put(packed, NamedSharding(mesh, P(DATA)))
    with jax.set_mesh(mesh):
        unpacked = jax.jit(layout.unpack)(on_mesh)
    for got, want in zip(jax.tree.leaves(unpacked), jax.tree.leaves(batch), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(bits(got), bits(want))
    # replica 1's row: the second half of every array, in the batch's order
    rows = [bits(leaf).astype(np.uint32).reshape(REPLICAS, -1)[1] for leaf in jax.tree.leaves(batch)]
    np.testing.assert_array_equal(packed[1].view(np.uint32), np.concatenate(rows))


def test_a_batch_of_another_shape_is_refused():
    rng = np.random.default_rng()
    batch = random_batch(rng)
    layout = BatchLayout.of(batch, REPLICAS)
    wider = StepBatch(
        *[
            np.zeros((SLOTS, PAGES + 1), np.int32) if name == "page_table" else getattr(batch, name)
            for name in StepBatch.__dataclass_fields__
        ]
    )
    with pytest.raises(ValueError, match=r"shape \(6, 4\) where the layout has \(3, 3\)"):
        layout.pack(wider)
    with pytest.raises(ValueError, match="does not pack over 4 replicas"):
        BatchLayout.of(batch, 4)
