"""The decode-state pieces a speculative step needs: convolution windows that commit any prefix of a
verify pass, and the draft's context K/V in the page pool."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from model_configs import TINY, four_layers
from paths import TINY_TEXT

from inkling_jax.cache import (
    CONV_STREAMS,
    ROUND_ROWS,
    CacheLayout,
    bytes_per_sequence,
    commit_conv,
    init_state,
    layout_for_budget,
)
from inkling_jax.checkpoint import load_causal_lm
from inkling_jax.checkpoint.synthetic import write_checkpoint
from inkling_jax.model.attention import read_draft_context, write_draft_context
from inkling_jax.model.chunk import Chunk
from inkling_jax.model.short_conv import committed_history, conv_window
from inkling_jax.sharding import DATA, MODEL, state_specs

FIXTURE = TINY_TEXT / "hf"
SLOTS, VERIFY = 4, 8  # the verify width: anchor + 7 drafts
TAPS = 4  # the tiny models' convolution kernel size


def test_committed_history_is_the_window_slice():
    history = jnp.arange(2 * 3 * 2, dtype=jnp.float32).reshape(2, 3, 2)
    x = 100 + jnp.arange(2 * 5 * 2, dtype=jnp.float32).reshape(2, 5, 2)
    window = conv_window(history, x)
    assert window.shape == (2, 8, 2)
    got = committed_history(window, jnp.array([0, 4]), 3)
    np.testing.assert_array_equal(got[0], history[0])  # nothing kept: the old history
    np.testing.assert_array_equal(got[1], window[1, 4:7])
    np.testing.assert_array_equal(got[1], x[1, 1:4])  # the 3 latest of the 4 kept inputs


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """The step of the tiny parity model's config in four layers (random weights; every kind of layer and block, a
    third of twelve layers' compile), jitted once per (width, windows)."""
    folder = tmp_path_factory.mktemp("four_layers")
    config = four_layers(FIXTURE / "config.json", folder / "config.json")
    model = load_causal_lm(write_checkpoint(config, folder / "checkpoint", experts="fp32", seed=8), jnp.float32)[1]
    graphdef, params = nnx.split(model)

    @functools.partial(jax.jit, static_argnames="windows")
    def run(params, kv, tokens, lengths, counts, page_table, windows=False):
        chunk = Chunk.uniform(lengths, counts, page_table, tokens.shape[1], kernel_size=model.config.conv_kernel_size)
        return nnx.merge(graphdef, params).step(tokens.reshape(-1), kv, chunk, windows=windows)

    return model.config, functools.partial(run, params)


def _conv_states(kv):
    return {s: np.asarray(getattr(kv, f"conv_{s}")) for s in CONV_STREAMS}


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_verify_then_commit_equals_feeding_the_committed_tokens(target, seed):
    """8 tokens fed and c[s] committed == only the first c[s] fed: conv states bit-identical, and the
    next step (K/V past the committed length stale in one, absent in the other) gives the same logits."""
    text, run = target
    rng = np.random.default_rng(seed)
    state = init_state(text, CacheLayout(SLOTS, SLOTS, 1, VERIFY), jnp.float32)
    page_table = jnp.arange(SLOTS, dtype=jnp.int32)[::-1].reshape(SLOTS, 1)
    vocab = text.unpadded_vocab_size

    def tokens():
        return jnp.asarray(rng.integers(0, vocab, (SLOTS, VERIFY)), jnp.int32)

    prompt = jnp.asarray([0, 2, 5, 8], jnp.int32)  # a slot without history too
    zeros = jnp.zeros(SLOTS, jnp.int32)
    _, kv = run(state.kv, tokens(), zeros, prompt, page_table)

    commit = jnp.asarray(rng.integers(1, VERIFY + 1, SLOTS), jnp.int32).at[0].set(VERIFY).at[1].set(1)
    drafts = tokens()
    _, verified, windows = run(kv, drafts, prompt, jnp.full(SLOTS, VERIFY, jnp.int32), page_table, windows=True)
    for s in CONV_STREAMS:  # the window starts with the history before the pass
        np.testing.assert_array_equal(getattr(windows, s)[:, :, : text.conv_kernel_size - 1], getattr(kv, f"conv_{s}"))
    every = jnp.ones(SLOTS, bool)
    committed = commit_conv(verified, windows, commit, every)
    _, direct = run(kv, drafts, prompt, commit, page_table)

    assert verified.windows is None and direct.windows is None
    got, want = _conv_states(committed), _conv_states(direct)
    for s in CONV_STREAMS:
        np.testing.assert_array_equal(got[s], want[s], err_msg=s)
    all_kept = _conv_states(commit_conv(verified, windows, jnp.full(SLOTS, VERIFY, jnp.int32), every))
    for s in CONV_STREAMS:  # committing everything is what the pass itself left
        np.testing.assert_array_equal(all_kept[s], _conv_states(verified)[s], err_msg=s)
    some = jnp.asarray([True, False, True, False])
    partly = _conv_states(commit_conv(verified, windows, commit, some))
    for s in CONV_STREAMS:  # slots outside the mask keep what the pass left
        np.testing.assert_array_equal(partly[s][:, ::2], want[s][:, ::2], err_msg=s)
        np.testing.assert_array_equal(partly[s][:, 1::2], _conv_states(verified)[s][:, 1::2], err_msg=s)

    follow = tokens()
    lengths, counts = prompt + commit, jnp.asarray([1, 3, 8, 2], jnp.int32)
    after_commit, _ = run(committed, follow, lengths, counts, page_table)
    after_direct, _ = run(direct, follow, lengths, counts, page_table)
    np.testing.assert_array_equal(after_commit, after_direct)


@pytest.mark.slow
def test_step_without_windows_is_unchanged(target):
    text, run = target
    state = init_state(text, CacheLayout(SLOTS, SLOTS, 1, VERIFY), jnp.float32)
    page_table = jnp.arange(SLOTS, dtype=jnp.int32).reshape(SLOTS, 1)
    ids = jnp.asarray(np.random.default_rng(3).integers(0, 500, (SLOTS, VERIFY)), jnp.int32)
    counts, zeros = jnp.asarray([8, 3, 1, 0], jnp.int32), jnp.zeros(SLOTS, jnp.int32)
    plain_logits, plain = run(state.kv, ids, zeros, counts, page_table)
    logits, kv, _ = run(state.kv, ids, zeros, counts, page_table, windows=True)
    np.testing.assert_array_equal(plain_logits, logits)
    for want, got in zip(jax.tree.leaves(plain), jax.tree.leaves(kv), strict=True):
        np.testing.assert_array_equal(want, got)


DRAFT = {
    "num_hidden_layers": 2,
    "block_size": 4,
    "target_layer_ids": [0, 2],
    "mask_token_id": 5,
    "markov_rank": 6,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 24,
}


@pytest.fixture(scope="module")
def drafted(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_state")
    (root / "tiny.json").write_text(json.dumps(TINY))
    path = write_checkpoint(root / "tiny.json", root / "ckpt", seed=3, experts="fp32", draft=DRAFT)
    return load_causal_lm(path, jnp.float32)


@pytest.mark.slow
def test_draft_pool_shape_sizes_and_sharding(drafted):
    config, _ = drafted
    text, draft = config.text, config.draft
    layout = CacheLayout(max_num_seqs=2, num_pages=6, max_pages_per_seq=3, max_chunk=8)
    state = init_state(text, layout, jnp.float32, draft=draft)
    assert state.kv.draft_k.shape == state.kv.draft_v.shape == (2, 6, 2, 128, 8)
    plain = init_state(text, layout, jnp.float32)
    kept = ROUND_ROWS * draft.block_size * (text.unpadded_vocab_size + 1) * 4  # the constrained rounds' drafts and q
    assert plain.kv.draft_k is None and state.nbytes - plain.nbytes == 2 * 2 * 6 * 128 * 2 * 8 * 4 + kept

    parts = bytes_per_sequence(text, 300, max_chunk=8, dtype=jnp.float32, draft=draft)
    assert parts["draft_context_kv"] == 3 * 128 * 2 * 2 * 2 * 8 * 4  # 3 pages, 2 layers, K and V, 2 heads of 8
    assert bytes_per_sequence(text, 300, max_chunk=8, dtype=jnp.float32)["draft_context_kv"] == 0
    budget = 2**21
    sizes = {"max_num_seqs": 2, "max_context": 256, "max_chunk": 8, "dtype": jnp.float32}
    with_draft = layout_for_budget(text, budget, **sizes, draft=draft)
    assert with_draft.num_pages < layout_for_budget(text, budget, **sizes).num_pages
    assert init_state(text, with_draft, jnp.float32, draft=draft).nbytes <= budget

    assert state_specs(state, text, 2).kv.draft_k == P(None, DATA, MODEL)  # by page, then 2 heads split 2 ways
    assert state_specs(state, text, 4).kv.draft_v == P(None, DATA, None)  # heads whole on every device
    assert state_specs(plain, text, 2).kv.draft_k is None


@functools.partial(nnx.jit, static_argnames="capture")
def context_kv(model, ids: jax.Array, positions: jax.Array, capture: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """The draft's context K and V [layers, B, T, Hkv, D] from a whole-sequence forward's features at the `capture`
    layers (one program a shape, not each operation compiled on its own)."""
    _, _, captured = model.model(ids, positions, capture=list(capture))
    return model.dspark.context_kv(model.dspark.context_features(captured), positions)


@pytest.mark.slow
def test_block_from_the_pool_equals_the_block_from_features(drafted):
    """Draft context K/V committed a verify chunk at a time (per-slot commits, garbage around) and read
    back through the page tables give the same draft block as K/V computed from the features at once."""
    config, model = drafted
    draft = model.dspark
    length, page = 13, 4
    layout = CacheLayout(max_num_seqs=2, num_pages=8, max_pages_per_seq=4, max_chunk=VERIFY, page_size=page)
    kv = init_state(config.text, layout, jnp.float32, draft=config.draft).kv
    kv = dataclasses.replace(kv, draft_k=kv.draft_k + 9.0, draft_v=kv.draft_v - 9.0)  # garbage everywhere
    page_table = jnp.asarray([[7, 2, 5, 0], [1, 6, 3, 4]], jnp.int32)

    ids = jax.random.randint(jax.random.key(0), (2, length + VERIFY), 0, config.text.unpadded_vocab_size)
    positions = jnp.broadcast_to(jnp.arange(length + VERIFY, dtype=jnp.int32), ids.shape)
    k, v = context_kv(model, ids, positions, tuple(config.draft.target_layer_ids))  # [layers, 2, T, Hkv, D]

    commits = [(5, 1), (3, 8), (1, 4), (4, 0)]  # per round and slot; slot 1's last round idles
    lengths = jnp.zeros(2, jnp.int32)
    write = jax.jit(write_draft_context)
    for commit in commits:
        commit = jnp.asarray(commit, jnp.int32)
        index = lengths[:, None] + jnp.arange(VERIFY)[None, :]  # the verify chunk's 8 positions
        part_k, part_v = (jnp.take_along_axis(x, index[None, :, :, None, None], axis=2) for x in (k, v))
        flat_k, flat_v = (x.reshape(x.shape[0], 1, -1, *x.shape[3:]) for x in (part_k, part_v))
        kv = write(kv, flat_k, flat_v, Chunk.uniform(lengths, commit, page_table, VERIFY, kernel_size=TAPS))
        lengths = lengths + commit
    assert lengths.tolist() == [length, length]

    pool_k, pool_v, pool_positions = jax.jit(read_draft_context)(kv, page_table)
    assert pool_k.shape == (2, 2, 4 * page, 2, 8)
    np.testing.assert_array_equal(pool_k[:, :, :length], k[:, :, :length])
    np.testing.assert_array_equal(pool_v[:, :, :length], v[:, :, :length])
    assert np.all(np.asarray(pool_k[:, :, length:]) == 9.0)  # nothing uncommitted was written

    anchors = jnp.asarray([11, 42], jnp.int32)
    embed = model.model.embed_tokens
    block_hidden = nnx.jit(lambda draft, *args: draft.block_hidden(*args))  # one program a shape
    from_pool = block_hidden(draft, anchors, lengths, pool_k, pool_v, pool_positions, embed)
    direct = block_hidden(draft, anchors, lengths, k[:, :, :length], v[:, :, :length], positions[:, :length], embed)
    np.testing.assert_allclose(from_pool, direct, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_engine_steps_keep_the_draft_context(drafted):
    """Prefill in chunks and a decode step through the engine's step fill the draft pool with the
    context K/V of every position fed, as computed from a whole-sequence forward."""
    config, model = drafted
    text = config.text
    layout = CacheLayout(max_num_seqs=2, num_pages=4, max_pages_per_seq=2, max_chunk=VERIFY)
    state = init_state(text, layout, jnp.float32, draft=config.draft)
    page_table = jnp.asarray([[3, 0], [1, 2]], jnp.int32)
    ids = jax.random.randint(jax.random.key(5), (2, 13), 0, text.unpadded_vocab_size)
    kv, lengths = state.kv, jnp.zeros(2, jnp.int32)
    step = jax.jit(model.step)
    for start, width in ((0, VERIFY), (VERIFY, 4), (12, 1)):
        counts = jnp.full(2, width, jnp.int32)
        tokens = jnp.pad(ids[:, start : start + width], ((0, 0), (0, VERIFY - width)))
        _, kv = step(tokens.reshape(-1), kv, Chunk.uniform(lengths, counts, page_table, VERIFY, kernel_size=TAPS))
        lengths = lengths + counts
    positions = jnp.broadcast_to(jnp.arange(13, dtype=jnp.int32), ids.shape)
    k, _ = context_kv(model, ids, positions, tuple(config.draft.target_layer_ids))
    pool_k, _, _ = jax.jit(read_draft_context)(kv, page_table)
    np.testing.assert_allclose(pool_k[:, :, :13], k, rtol=2e-5, atol=2e-5)
