"""Batch invariance of the model's sums on the CPU (`pallas_kernels.numerics`): a row's value is the same to the
bit whatever other rows, kept axes or zero padding are computed with it, in code compiled as a user's run is
(XLA's default optimization; the tests' processes otherwise compile unoptimized)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import numerics

pytestmark = pytest.mark.slow

OPTIMIZED = {"xla_backend_optimization_level": 3}  # XLA's default


def optimized(fn, *args):
    """fn(*args) compiled with XLA's default optimization."""
    return np.asarray(jax.jit(fn).lower(*args).compile(OPTIMIZED)(*args))


@pytest.fixture
def rng():
    seed = int(np.random.default_rng().integers(1 << 31))
    print(f"seed {seed}")
    return np.random.default_rng(seed)


def test_a_rows_total_does_not_depend_on_the_other_rows_or_the_padding(rng):
    """A row of K values summed alone, and among M - 1 random rows under random kept axes with trailing zeros
    appended: the same bits every time, and the float64 sum to fp32 rounding."""
    for _ in range(12):
        size = int(rng.integers(2, 5000))
        row = rng.standard_normal(size).astype(np.float32)
        alone = optimized(numerics.total, row[None])[0]
        assert abs(float(alone) - row.astype(np.float64).sum()) <= 1e-5 * np.abs(row).sum()
        rows, kept = int(rng.integers(2, 130)), int(rng.integers(1, 4))
        many = rng.standard_normal((kept, rows, size + int(rng.integers(0, 300)))).astype(np.float32)
        many[..., size:] = 0
        at = int(rng.integers(kept)), int(rng.integers(rows))
        many[at][:size] = row
        assert optimized(numerics.total, many)[at] == alone


def test_matmul_and_softmax_rows_do_not_depend_on_the_row_count(rng):
    """einsum rows (a GEMV against GEMMs of 4 and 64 rows, at the model's hidden width) and batched attention-shaped
    einsums (batch and query counts), softmax and log-softmax rows: alone and among others, the same bits."""
    hidden, out = 4608, int(rng.integers(16, 97))
    weight = jnp.asarray(rng.standard_normal((hidden, out)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((64, hidden)), jnp.bfloat16)

    def project(x):
        return numerics.einsum("mk,kn->mn", x, weight, jnp.float32)

    whole = optimized(project, x)
    for rows in (1, 4):
        np.testing.assert_array_equal(optimized(project, x[:rows]), whole[:rows])
    reference = np.asarray(x, np.float64) @ np.asarray(weight, np.float64)
    np.testing.assert_allclose(whole, reference, rtol=1e-4, atol=1e-3)

    q = jnp.asarray(rng.standard_normal((6, 8, 4, 16)), jnp.float32)  # [batch, queries, heads, dim]
    k = jnp.asarray(rng.standard_normal((6, 129, 4, 16)), jnp.float32)

    def scores(q, k):
        return numerics.einsum("bqhd,bkhd->bhqk", q, k)

    full = optimized(scores, q, k)
    np.testing.assert_array_equal(optimized(scores, q[:1, :1], k[:1]), full[:1, :, :1])
    for fn in (numerics.softmax, numerics.log_softmax):
        np.testing.assert_array_equal(optimized(fn, full[:1, :1, :1]), optimized(fn, full)[:1, :1, :1])
    np.testing.assert_allclose(optimized(numerics.softmax, full), jax.nn.softmax(full, axis=-1), rtol=1e-6)
    np.testing.assert_allclose(optimized(numerics.log_softmax, full), jax.nn.log_softmax(full, axis=-1), atol=1e-5)
