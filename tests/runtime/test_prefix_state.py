"""What a prefix cache saves where a sequence landed on a page boundary and restores into another slot
(`inkling_jax.cache`): the sequence resumed there, reading the first one's pages, computes bit for bit what the first
one computed; restored without its convolution states (zeros, a bug other engines shipped) it does not."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_configs import four_layers
from paths import TINY_CONFIG
from step_driver import Driver

from inkling_jax.cache import PAGE_SIZE, init_snapshots, restore_snapshot, save_snapshot
from inkling_jax.checkpoint import load_causal_lm
from inkling_jax.checkpoint.synthetic import write_checkpoint

WINDOW = 160  # over a page: the window before a boundary spans two pages, and before the first it starts before 0
WIDTH, LENGTH = 64, 300  # prefill pieces; a sequence of two pages and 44 tokens
save, restore = jax.jit(save_snapshot), jax.jit(restore_snapshot)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("window")
    config = json.loads(four_layers(TINY_CONFIG, folder / "four.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"sliding_window_size": WINDOW}))
    return load_causal_lm(write_checkpoint(folder / "config.json", folder / "hf", experts="fp32", seed=3), np.float32)[
        1
    ]


def feed(driver: Driver, slot: int, tokens: list[int], start: int, decode: int) -> list:
    """Feed `slot` tokens[start:] in pieces of WIDTH from `start`, then `decode` greedy tokens; each emitted step."""
    emitted = []
    for first in range(start, len(tokens), WIDTH):
        piece = tokens[first : first + WIDTH]
        last = first + WIDTH >= len(tokens)
        out = driver.run({slot: piece}, reset=(slot,) if first == 0 else (), emit=(slot,) if last else (),
                         prompt=(slot,))  # fmt: skip
        if last:
            emitted.append(out)
    for _ in range(decode):
        emitted.append(driver.run({slot: [int(emitted[-1].tokens[slot, 0])]}, emit=(slot,)))
    return [jax.tree.map(lambda x, s=slot: np.asarray(x[s]), out) for out in emitted]


@pytest.mark.slow
@pytest.mark.parametrize("boundary", [PAGE_SIZE, 2 * PAGE_SIZE])
def test_a_sequence_resumed_at_a_saved_boundary_computes_as_the_one_that_ran_through_it(model, boundary):
    rng = np.random.default_rng(boundary)
    tokens = rng.integers(0, model.config.unpadded_vocab_size, LENGTH).tolist()
    driver = Driver(model, width=WIDTH, pages=3, boundaries=True)
    through = feed(driver, 0, tokens, 0, decode=3)  # slot 0 lands on both boundaries and runs 47 tokens past them
    snapshots = save(driver.state, init_snapshots(driver.state, model.config, 2), 0, 1, boundary)

    shared = boundary // PAGE_SIZE
    table = np.array(driver.page_table)
    table[1, :shared] = table[0, :shared]  # slot 1 reads slot 0's pages before the boundary, writes its own after
    driver.page_table = jnp.asarray(table)
    prompt = np.zeros(driver.state.prompt_mask.shape[1], bool)
    prompt[tokens[:boundary]] = True
    counts = np.zeros(driver.state.output_counts.shape[1], np.int32)
    before = driver.state
    driver.state = restore(before, snapshots, 1, 1, boundary, prompt, counts)
    resumed = feed(driver, 1, tokens, boundary, decode=3)
    for want, got in zip(through, resumed, strict=True):
        for field in dataclasses.fields(want):
            np.testing.assert_array_equal(getattr(got, field.name), getattr(want, field.name), field.name)

    no_conv = dataclasses.replace(snapshots, **{n: jnp.zeros_like(getattr(snapshots, n)) for n in
                                                ("conv_k", "conv_v", "conv_attention", "conv_mlp")})  # fmt: skip
    driver.state = restore(before, no_conv, 2, 1, boundary, prompt, counts)
    table[2, :shared] = table[0, :shared]
    driver.page_table = jnp.asarray(table)
    zeroed = feed(driver, 2, tokens, boundary, decode=0)
    assert not np.array_equal(zeroed[0].logprobs, through[0].logprobs)
