"""The flat step's token-to-slot map on random disjoint spans, against the spans read token by token."""

import jax
import numpy as np
import pytest

from inkling_jax.model.chunk import token_slots


def random_spans(rng: np.random.Generator, slots: int, tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint spans in a random slot order, some empty (with a start anywhere, even inside another span or past
    the end) and gaps between them."""
    starts, counts = rng.integers(0, tokens + 4, slots), np.zeros(slots, np.int64)
    at = int(rng.integers(0, 3))
    for slot in rng.permutation(slots):
        if at >= tokens or rng.random() < 0.3:
            continue
        count = int(rng.integers(1, min(9, tokens - at + 1)))
        starts[slot], counts[slot] = at, count
        at += count + int(rng.integers(0, 3))
    return starts.astype(np.int32), counts.astype(np.int32)


@pytest.mark.parametrize(("slots", "tokens"), [(1, 1), (3, 16), (16, 8), (40, 96), (300, 64)])
def test_each_token_gets_the_slot_whose_span_holds_it(slots, tokens):
    rng = np.random.default_rng(slots * 1000 + tokens)
    find = jax.jit(token_slots, static_argnums=2)
    for _ in range(20):
        starts, counts = random_spans(rng, slots, tokens)
        expected = np.full(tokens, slots)
        for slot in range(slots):
            expected[starts[slot] : starts[slot] + counts[slot]] = slot
        np.testing.assert_array_equal(find(starts, counts, tokens), expected)
