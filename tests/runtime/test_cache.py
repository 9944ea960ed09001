"""Decode-state sizing: the documented bytes per sequence, budgets, and the allocated state."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec
from paths import REPO

from inkling_jax.cache import (
    ROUND_ROWS,
    CacheLayout,
    bytes_per_sequence,
    init_state,
    landed_on_boundaries,
    layout_for_budget,
    record_boundaries,
    ring_size,
)
from inkling_jax.config import load_config, parse_config
from inkling_jax.sharding import state_specs
from pallas_kernels.ragged_paged_attention.blocks import ring_block

FULL = load_config(REPO / "configs" / "inkling2_small.json").text
MiB = 2**20


@pytest.mark.parametrize(
    ("context", "tp", "total_mib"),
    [
        (8192, 1, 499.1),
        (131072, 1, 4339.1),
        (1048576, 1, 33011.1),
        (8192, 4, 126.7),
        (131072, 4, 1086.7),
        (1048576, 4, 8254.7),
    ],
)
def test_full_model_bytes_per_sequence(context, tp, total_mib):
    """bf16 state of the 594B model with 512-token prefill chunks, per device (docs/engine.md's table)."""
    parts = bytes_per_sequence(FULL, context, max_chunk=512, tp=tp)
    kv_token = 2 * (8 // tp) * 128 * 2  # K and V, the device's KV heads, head dim 128, bf16
    assert parts["full_attention_kv"] == 8 * context * kv_token  # 8 full layers, whole 128-token pages
    assert parts["sliding_window_kv"] == 40 * (1024 + 512) * kv_token  # ring: window + chunk
    assert parts["conv_states"] == 48 * 3 * (2 * (8 // tp) * 128 + 2 * 4608) * 2
    assert round(parts["total"] / MiB, 1) == total_mib


TINY = parse_config(
    {"model_type": "inkling2_text", "vocab_size": 64, "unpadded_vocab_size": 60, "hidden_size": 16,
     "num_hidden_layers": 3, "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding"], "num_attention_heads": 4,
     "num_key_value_heads": 2, "head_dim": 8, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2,
     "swa_head_dim": 8, "sliding_window_size": 8, "rel_extent": 10, "moe_intermediate_size": 8,
     "n_routed_experts": 4, "num_experts_per_tok": 2, "eos_token_id": 3}
).text  # fmt: skip


def test_layout_fills_the_budget_and_the_state_matches_it():
    budget = 3 * MiB
    layout = layout_for_budget(TINY, budget, max_num_seqs=4, max_context=512, max_chunk=16, dtype=jnp.float32)
    state = init_state(TINY, layout, jnp.float32)
    assert state.nbytes <= budget
    page_bytes = 1 * 128 * 2 * 2 * 8 * 4  # one full layer, K and V, 2 heads of 8, fp32
    assert budget - state.nbytes < page_bytes + state.page_table.nbytes + state.lengths.nbytes * 2
    assert state.kv.sliding_k.shape == (2, 4, 2, 8 + 16, 8)
    assert state.kv.full_k.shape == (1, layout.num_pages, 2, 128, 8)
    assert state.kv.conv_attention.shape == (3, 4, 3, 16)


@pytest.mark.parametrize("chunk", [64, 100, 512])
def test_rings_longer_than_a_page_tile_into_128_key_blocks(chunk):
    """Whatever the chunk, the attention kernels find 128-key blocks in the ring (1024 + 64 = 1088 alone would
    give 68-key blocks, which the GPU kernel does not take); a ring within one page is left as it is."""
    ring = ring_size(FULL, chunk)
    assert ring >= 1024 + chunk and ring % 128 == 0 and ring - (1024 + chunk) < 128
    assert ring_block(ring, 128) == 128
    assert ring_size(TINY, 16) == 8 + 16


def test_too_small_a_budget_names_what_it_lacks():
    with pytest.raises(ValueError, match=r"holds \d+ pages .*needs 8"):
        layout_for_budget(TINY, 50_000, max_num_seqs=4, max_context=1024, max_chunk=16)


def test_state_fields_are_separate_buffers_and_can_be_donated():
    state = init_state(TINY, CacheLayout(max_num_seqs=2, num_pages=4, max_pages_per_seq=2, max_chunk=8))
    step = jax.jit(lambda s: dataclasses.replace(s, lengths=s.lengths + 1), donate_argnums=0)
    state = step(state)
    assert state.lengths.tolist() == [1, 1]


@pytest.mark.parametrize("with_draft", [False, True])
def test_no_state_array_is_zero_sized(with_draft):
    """XLA turns a zero-sized input of the data-parallel step's shard_map into an unused one, and Shardy's pass that
    drops a manual computation's unused inputs segfaults now and then: every array of the state holds something."""
    config = load_config(REPO / "configs" / "proxy_h200.json")  # the real model's shapes and its draft
    layout = CacheLayout(max_num_seqs=4, num_pages=8, max_pages_per_seq=4, max_chunk=8)
    draft = config.draft if with_draft else None
    state = jax.eval_shape(lambda: init_state(config.text, layout, draft=draft, replicas=2))
    assert all(leaf.size > 0 for leaf in jax.tree.leaves(state))
    assert (state.drafts is not None) == with_draft
    if with_draft:
        assert state.draft_probs.shape == (2 * ROUND_ROWS, config.draft.block_size, config.text.unpadded_vocab_size)


def test_boundaries_keep_the_convolution_states_where_a_length_lands_on_a_page_boundary():
    """Only the slots whose length reached a multiple of the page in the step keep their states, at the boundary's
    parity; the ring keeps the window and two pages so that the window before the last boundary outlives it."""
    layout = CacheLayout(max_num_seqs=4, num_pages=8, max_pages_per_seq=4, max_chunk=8, boundaries=True)
    assert layout.ring(TINY) == 384  # window 8 + two pages, in whole pages
    state = init_state(TINY, layout, jnp.float32)
    rng = np.random.default_rng(5)
    kv = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), state.kv)
    before, after = jnp.array([120, 250, 256, 383]), jnp.array([128, 256, 256, 384])  # slot 2 did not move
    kept = record_boundaries(state.boundaries, kv, after, landed_on_boundaries(before, after))
    for stream in ("k", "v", "attention", "mlp"):
        got, conv = np.asarray(getattr(kept, stream)), np.asarray(getattr(kv, f"conv_{stream}"))
        np.testing.assert_array_equal(got[:, 0, 1], conv[:, 0])  # 128: parity 1
        np.testing.assert_array_equal(got[:, 1, 0], conv[:, 1])  # 256: parity 0
        np.testing.assert_array_equal(got[:, 3, 1], conv[:, 3])  # 384: parity 1
        assert not got[:, 2].any() and not got[:, 0, 0].any() and not got[:, 1, 1].any()
    specs = state_specs(state, TINY, 2)
    assert specs.boundaries.k == PartitionSpec(None, "data", None, None, "model")
    assert specs.boundaries.mlp == PartitionSpec(None, "data")
