"""The DSpark draft: config, shapes, block attention masking, the RNN head's math, checkpoint names."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoint_edits import edited_copy
from flax import nnx
from model_configs import TINY

from inkling_jax.checkpoint import CheckpointError, load_causal_lm
from inkling_jax.checkpoint.loader import parameter_paths
from inkling_jax.checkpoint.safetensors_io import CheckpointFiles
from inkling_jax.checkpoint.synthetic import write_checkpoint
from inkling_jax.config import ConfigError, parse_config
from inkling_jax.model.attention import read_pages, write_pages
from inkling_jax.model.chunk import Chunk
from inkling_jax.model.draft import NoDraftError, require_draft
from inkling_jax.model.text import CausalLM

DRAFT = {
    "num_hidden_layers": 2,
    "block_size": 4,
    "target_layer_ids": [0, 2],
    "mask_token_id": 5,
    "markov_rank": 6,
    "intermediate_size": 24,
}
GAMMA, LAYERS, KV_HEADS, HEAD_DIM, RANK, HIDDEN, VOCAB = 4, 2, 2, 8, 6, 16, 60


def _config(**draft):
    return parse_config({**TINY, "dspark_config": {**DRAFT, **draft}})


@pytest.fixture(scope="module")
def model() -> CausalLM:
    """Random values everywhere (norm gains and biases included), drawn on the host: quicker than init."""
    config = _config()
    graphdef, state = nnx.split(nnx.eval_shape(lambda: CausalLM(config.text, jnp.float32, draft=config.draft)))
    rng = np.random.default_rng(11)

    def fill(path: str, variable: nnx.Variable) -> jax.Array:
        gain = path.endswith(("norm.weight", "layernorm.weight", "l2_clip.scale"))
        return jnp.asarray(gain + 0.3 * rng.normal(size=variable.shape), variable.dtype)

    for path, variable in parameter_paths(state).items():
        variable.set_value(fill(path, variable))
    return nnx.merge(graphdef, state)


def _context(model: CausalLM, length: int, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    """Context features [2, length, d] from random target layer outputs (drawn on the host), and their
    positions."""
    hidden = jnp.asarray(np.random.default_rng(seed).standard_normal((2, length, LAYERS, HIDDEN), np.float32))
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (2, length))
    return model.dspark.context_features(hidden), positions


def test_config_defaults_and_aliases():
    draft = parse_config({**TINY, "dspark_config": {"target_layer_ids": [1], "noise_token_id": 7}}).draft
    assert (draft.num_hidden_layers, draft.block_size, draft.markov_rank, draft.mask_token_id) == (5, 7, 256, 7)
    assert (draft.hidden_size, draft.num_attention_heads, draft.num_key_value_heads, draft.head_dim) == (16, 4, 2, 8)
    assert draft.intermediate_size == 64 and draft.rms_norm_eps == 1e-6 and draft.target_layer_ids == (1,)
    assert parse_config(TINY).draft is None
    wrapped = {
        "model_type": "inkling2",
        "text_config": TINY,
        "vision_config": {"text_hidden_size": 16},
        "image_token_id": 50,
        "dspark_config": DRAFT,
    }
    assert parse_config(wrapped).draft == _config().draft


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"mask_token_id": None}, "dspark_config.mask_token_id"),
        ({"mask_token_id": 60}, "dspark_config.mask_token_id"),
        ({"target_layer_ids": [0, 3]}, "dspark_config.target_layer_ids"),
        ({"target_layer_ids": [1, 1]}, "dspark_config.target_layer_ids"),
        ({"target_layer_ids": []}, "dspark_config.target_layer_ids"),
        ({"hidden_size": 32}, "dspark_config.hidden_size"),
        ({"num_key_value_heads": 3}, "dspark_config.num_key_value_heads"),
        ({"markov_head_type": "vanilla"}, "dspark_config.markov_head_type"),
        ({"sample_from_anchor": False}, "dspark_config.sample_from_anchor"),
        ({"block_size": 0}, "dspark_config.block_size"),
        ({"markov_rank": "big"}, "dspark_config.markov_rank"),
    ],
)
def test_config_errors_name_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        _config(**change)
    with pytest.raises(ConfigError, match="dspark_config"):
        parse_config({**TINY, "dspark_config": [1]})


@pytest.mark.slow
def test_shapes(model):
    @jax.jit  # one program (called eagerly, every operation of the draft compiles alone)
    def draft(c, positions):
        k, v = model.dspark.context_kv(c, positions)
        anchors = jnp.array([7, 8])
        h = model.dspark.block_hidden(anchors, jnp.array([9, 5]), k, v, positions, model.model.embed_tokens)
        state, bias = model.dspark.rnn_step(model.dspark.initial_state(h), anchors, h[:, 0])
        biases = model.dspark.block_biases(anchors, jnp.ones((2, GAMMA), jnp.int32), h)
        return k, v, h, model.logits(h), state, bias, biases, model.dspark.confidence(h[:, 0], anchors)

    c, positions = _context(model, 9)
    assert c.shape == (2, 9, HIDDEN)
    k, v, h, logits, state, bias, biases, confidence = draft(c, positions)
    assert k.shape == v.shape == (LAYERS, 2, 9, KV_HEADS, HEAD_DIM)
    assert h.shape == (2, GAMMA, HIDDEN) and h.dtype == jnp.float32
    assert logits.shape == (2, GAMMA, VOCAB)
    assert state.shape == (2, RANK) and bias.shape == (2, VOCAB)
    assert biases.shape == (2, GAMMA, VOCAB)
    assert confidence.shape == (2,) and bool(np.all((confidence > 0) & (confidence < 1)))


@pytest.mark.slow
def test_target_hidden_capture(model):
    ids = jax.random.randint(jax.random.key(1), (2, 6), 0, VOCAB)
    positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (2, 6))
    graphdef, state = nnx.split(model.model)

    @jax.jit
    def forward(state: nnx.State) -> tuple[jax.Array, ...]:
        text = nnx.merge(graphdef, state)
        x = text.embed_tokens(ids)
        sources = jnp.zeros((text.config.num_blocks, *x.shape), x.dtype)
        first, _, _ = text.layer(0)(x, sources, jnp.int32(0), positions)  # layer 0's output
        return text(ids, positions)[0], *text(ids, positions, capture=(2, 0))[::2], first

    hidden, captured_hidden, features, first = forward(state)
    np.testing.assert_array_equal(hidden, captured_hidden)
    assert features.shape == (2, 6, 2, HIDDEN)
    np.testing.assert_array_equal(features[:, :, 1], first)
    assert not np.allclose(features[:, :, 0], features[:, :, 1])


@pytest.mark.slow
def test_block_sees_only_context_before_the_anchor(model):
    c, positions = _context(model, 10)
    anchors, anchor_positions = jnp.array([4, 9]), jnp.array([6, 10])
    embed = model.model.embed_tokens

    @jax.jit
    def block(features):
        return model.dspark.block_hidden(
            anchors, anchor_positions, *model.dspark.context_kv(features, positions), positions, embed
        )

    base = block(c)
    later = c.at[0, 6:].add(5.0)  # slot 0's positions >= its anchor's
    np.testing.assert_array_equal(block(later), base)
    earlier = c.at[0, 5].add(5.0)
    assert not np.allclose(block(earlier)[0], base[0], atol=1e-4)
    np.testing.assert_array_equal(block(earlier)[1], base[1])  # slots are independent


@pytest.mark.slow
def test_block_is_non_causal_within_the_block(model):
    c, positions = _context(model, 5)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, GAMMA, HIDDEN), np.float32))
    block_positions = 5 + jnp.broadcast_to(jnp.arange(GAMMA, dtype=jnp.int32), (2, GAMMA))

    @jax.jit
    def layer(x):
        k, v = model.dspark.context_kv(c, positions)
        return model.dspark.layers[0](x, block_positions, k[0], v[0], jnp.ones((2, 5), bool))

    base = layer(x)
    perturbed = layer(x.at[:, -1].add(1.0))
    for slot in range(GAMMA):  # the last slot's input reaches every slot, the anchor's included
        assert not np.allclose(perturbed[:, slot], base[:, slot], atol=1e-4), slot


@pytest.mark.slow
def test_context_kv_stored_per_committed_chunk_equals_one_pass(model):
    """K/V computed as positions commit, stored in a page pool, read back: the same block as K/V
    computed in one pass, whatever sits in the pool at and after the anchor."""
    c, positions = _context(model, 12)
    k, v = model.dspark.context_kv(c, positions)
    page_size, pages_per_seq = 4, 4
    commits = ((0, 5), (5, 7), (7, 9))  # three commits of 5, 2 and 2 positions
    parts = [model.dspark.context_kv(c[:, start:stop], positions[:, start:stop]) for start, stop in commits]

    @jax.jit  # the pool's writes and reads as one program (called eagerly, every operation compiles alone)
    def stored_kv(parts):
        pool = jnp.full((LAYERS, 2 * pages_per_seq, KV_HEADS, page_size, HEAD_DIM), 9.0)  # garbage everywhere
        pools = [pool, pool]
        page_table = jnp.arange(2 * pages_per_seq, dtype=jnp.int32).reshape(2, pages_per_seq)[::-1]
        for (start, stop), (part_k, part_v) in zip(commits, parts, strict=True):
            width = stop - start
            chunk = Chunk.uniform(
                jnp.full((2,), start, jnp.int32), jnp.full((2,), width, jnp.int32), page_table, width, kernel_size=4
            )
            for layer in range(LAYERS):
                pools = [
                    write_pages(p, layer, part[layer].reshape(1, -1, *part.shape[3:]), chunk)
                    for p, part in zip(pools, (part_k, part_v), strict=True)
                ]
        read = Chunk.uniform(jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32), page_table, 1, kernel_size=4)
        stored = [jnp.stack([read_pages(p, layer, read)[0] for layer in range(LAYERS)]) for p in pools]
        return stored, read_pages(pools[0], 0, read)[1]

    stored, stored_positions = stored_kv(parts)
    np.testing.assert_array_equal(stored[0][:, :, :9], k[:, :, :9])
    anchors, at = jnp.array([3, 11]), jnp.array([9, 9])
    embed = model.model.embed_tokens
    from_pool = model.dspark.block_hidden(anchors, at, *stored, stored_positions, embed)
    one_pass = model.dspark.block_hidden(anchors, at, k, v, positions, embed)
    np.testing.assert_allclose(from_pool, one_pass, rtol=1e-6, atol=1e-6)


def _numpy_params(model):
    head = model.dspark.markov_head
    return (
        np.asarray(head.markov_w1.weight[...]),
        np.asarray(head.joint_proj.weight[...]),
        np.asarray(head.joint_proj.bias[...]),
        np.asarray(head.markov_w2.weight[...]),
    )


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def test_rnn_head_matches_a_numpy_loop(model):
    w1, wj, bj, w2 = _numpy_params(model)
    h = jax.random.normal(jax.random.key(4), (2, GAMMA, HIDDEN))
    anchors = jnp.array([7, 50])
    drafts = jax.random.randint(jax.random.key(5), (2, GAMMA), 0, VOCAB)
    got = np.asarray(model.dspark.block_biases(anchors, drafts, h))
    previous = np.concatenate([np.asarray(anchors)[:, None], np.asarray(drafts)], axis=1)
    state = np.zeros((2, RANK))
    for k in range(GAMMA):
        z = np.concatenate([state, w1[previous[:, k]], np.asarray(h[:, k])], axis=-1)
        a = z @ wj.T + bj
        gate, candidate, output = a[:, :RANK], a[:, RANK : 2 * RANK], a[:, 2 * RANK :]
        bias = np.tanh(output) @ w2.T  # from the old state
        state = _sigmoid(gate) * state + (1 - _sigmoid(gate)) * np.tanh(candidate)
        np.testing.assert_allclose(got[:, k], bias[:, :VOCAB], rtol=1e-5, atol=1e-5)


def test_confidence_matches_numpy(model):
    w1 = np.asarray(model.dspark.markov_head.markov_w1.weight[...])
    proj = model.dspark.confidence_head.proj
    h = np.asarray(jax.random.normal(jax.random.key(6), (3, HIDDEN)))
    prev = np.array([1, 20, 59])
    logit = np.concatenate([h, w1[prev]], axis=-1) @ np.asarray(proj.weight[...])[0] + np.asarray(proj.bias[...])[0]
    np.testing.assert_allclose(model.dspark.confidence(jnp.asarray(h), jnp.asarray(prev)), _sigmoid(logit), rtol=1e-5)


@pytest.mark.slow
def test_rnn_state_starts_at_zero_in_every_block(model):
    h = jax.random.normal(jax.random.key(7), (1, GAMMA, HIDDEN))
    anchor = jnp.array([12])
    first = model.dspark.block_biases(anchor, jnp.array([[1, 2, 3, 4]]), h)
    second = model.dspark.block_biases(anchor, jnp.array([[40, 41, 42, 43]]), h)
    np.testing.assert_array_equal(first[:, 0], second[:, 0])
    assert not np.allclose(first[:, 1], second[:, 1])
    state = model.dspark.initial_state(h)
    assert state.shape == (1, RANK) and state.dtype == jnp.float32
    np.testing.assert_array_equal(state, 0.0)
    for k, prev in enumerate([12, 1, 2, 3]):  # block_biases == the sequential steps from a zero state
        state, bias = model.dspark.rnn_step(state, jnp.array([prev]), h[:, k])
        np.testing.assert_allclose(bias, first[:, k], rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def draft_checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("draft")
    (root / "tiny.json").write_text(json.dumps(TINY))
    return write_checkpoint(root / "tiny.json", root / "ckpt", seed=5, experts="fp32", layout="original", draft=DRAFT)


def test_synthetic_draft_round_trips_bit_exactly(draft_checkpoint):
    config, model = load_causal_lm(draft_checkpoint, jnp.float32)
    assert config.draft == _config().draft and model.dspark is not None
    files = CheckpointFiles(draft_checkpoint)
    params = {p: v for p, v in parameter_paths(nnx.state(model)).items() if p.startswith("dspark.")}
    assert set(params) == {n for n in files.names() if n.startswith("dspark.")}
    assert len(params) == 9 + 11 * LAYERS
    for path, variable in params.items():
        stored = files.read(path)
        assert stored.shape == variable.shape and np.all(stored != 0), path
        np.testing.assert_array_equal(np.asarray(variable[...]), stored, err_msg=path)
    assert require_draft(model) == config.draft == require_draft(config)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda t: {n: a for n, a in t.items() if n != "dspark.layers.1.self_attn.k_norm.weight"},
            "missing tensors for dspark.layers.1.self_attn.k_norm.weight",
        ),
        (lambda t: {**t, "dspark.fc.weight": t["dspark.fc.weight"][:, :16]}, "'dspark.fc.weight' has shape"),
        (lambda t: {**t, "dspark.extra.weight": t["dspark.norm.weight"]}, "unexpected tensor 'dspark.extra.weight'"),
    ],
)
def test_broken_draft_tensors_are_named(draft_checkpoint, tmp_path, edit, message):
    with pytest.raises(CheckpointError, match=message):
        load_causal_lm(edited_copy(draft_checkpoint, tmp_path, edit), jnp.float32)


def test_draft_tensors_without_config_are_an_error(draft_checkpoint, tmp_path):
    copy = edited_copy(draft_checkpoint, tmp_path, lambda t: t)
    (copy / "config.json").write_text(json.dumps(TINY))
    message = "'dspark.* belongs to a DSpark draft, but config.json has no dspark_config"
    with pytest.raises(CheckpointError, match=message):
        load_causal_lm(copy, jnp.float32)


def test_require_draft_says_to_run_without_speculation():
    config = parse_config(TINY)
    message = (
        r"checkpoint /ckpt has no DSpark draft \(no dspark_config / dspark\.\* tensors\); run without --speculative"
    )
    with pytest.raises(NoDraftError, match=message):
        require_draft(config, "/ckpt")
    with pytest.raises(NoDraftError, match="no DSpark draft"):
        require_draft(nnx.eval_shape(lambda: CausalLM(config.text, jnp.float32)))
