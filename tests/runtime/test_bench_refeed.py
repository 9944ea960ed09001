"""`bench.batch_invariance --engine`'s report: where two decode states first differ, per KVCache array, in model
layers and positions (planted differences in random states)."""

import dataclasses

import numpy as np
import pytest
from paths import TINY_CONFIG

from bench.batch_invariance import first_difference
from inkling_jax.config import TextConfig, load_config

LENGTH = 300  # tokens in the state


@dataclasses.dataclass
class Engine:
    text: TextConfig


@pytest.fixture
def engine() -> Engine:
    return Engine(load_config(TINY_CONFIG).text)  # 12 layers: sliding ones and full ones


def planted(shape: tuple[int, ...], entries: list[tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray]:
    decoded = np.random.default_rng().normal(size=shape).astype(np.float32)
    refed = decoded.copy()
    for entry in entries:
        refed[entry] += 1.0
    return decoded, refed


def test_equal_states_are_equal(engine):
    decoded = np.random.default_rng().normal(size=(2, 4, 2, 128, 8)).astype(np.float32)
    assert first_difference(engine, "full_k", decoded, decoded.copy(), LENGTH) == "equal"


def test_full_layers_pages_give_positions_and_layers(engine):
    full = [layer for layer in range(12) if not engine.text.is_sliding(layer)]
    # [full layers, pages, heads, page, dim]: page 2 offset 38 is position 294; page 1 offset 3 is 131
    decoded, refed = planted((len(full), 4, 2, 128, 8), [(1, 2, 0, 38, 5), (0, 1, 1, 3, 0), (0, 3, 0, 100, 0)])
    assert (
        first_difference(engine, "full_v", decoded, refed, LENGTH)
        == f"position 131, layer {full[0]} (2 layer-positions)"
    )


def test_sliding_rings_and_convolution_histories_give_positions(engine):
    sliding = [layer for layer in range(12) if engine.text.is_sliding(layer)]
    # rings [layers, slots, heads, 256, dim] after 300 tokens: slot 38 holds 294, slot 200 holds 200; slot 1 differs
    decoded, refed = planted((len(sliding), 2, 2, 256, 8), [(7, 0, 1, 38, 0), (4, 0, 0, 200, 3), (2, 1, 0, 5, 0)])
    assert (
        first_difference(engine, "sliding_k", decoded, refed, LENGTH)
        == f"position 200, layer {sliding[4]} (2 layer-positions)"
    )
    # histories [layers, slots, K - 1, channels]: the last three positions, 297 ... 299
    decoded, refed = planted((12, 2, 3, 16), [(9, 0, 1, 4), (11, 0, 0, 0)])
    assert first_difference(engine, "conv_mlp", decoded, refed, LENGTH) == "position 297, layer 11 (2 layer-positions)"
