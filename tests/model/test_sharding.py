"""Meshes, parameter partitioning and expert parallelism on 8 simulated CPU devices (tests/conftest.py). The meshes'
logits are checked on four-layer models (`model_configs.four_layers`: every kind of layer and block, a third of
twelve layers' compile): the parity model's config with random weights, and the wide-headed one."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from model_configs import WIDE_HEADS, four_layers
from paths import PARITY

from inkling_jax.checkpoint import load_causal_lm
from inkling_jax.checkpoint.synthetic import write_checkpoint
from inkling_jax.forward import greedy_continuation, logits_fn
from inkling_jax.sharding import MeshError, make_mesh, parse_mesh, shard_model


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(PARITY / "tiny_text" / "reference.npz"))


def load_fixture(name: str):
    layout = "hf" if name == "tiny_text" else "original"
    return load_causal_lm(PARITY / name / layout, jnp.float32)[1]


@pytest.fixture(scope="module", params=["tiny_text", "tiny_text_mixed"])
def model(request):
    return load_fixture(request.param)


def test_mesh_specs_parse_and_bad_ones_are_named(model):
    assert parse_mesh("tp4") == (1, 4) and parse_mesh("dp2tp4") == (2, 4)
    with pytest.raises(MeshError, match="not of the form"):
        parse_mesh("tp")
    with pytest.raises(MeshError, match="needs 16 devices, 8 are available"):
        make_mesh("dp2tp8", model.config)
    with pytest.raises(MeshError, match="tp8 does not divide num_attention_heads"):
        make_mesh("tp8", model.config)  # 4 query heads
    with pytest.raises(MeshError, match="tp3 does not divide"):
        make_mesh("tp3", model.config)


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """WIDE_HEADS in four layers, NVFP4 and MXFP8 experts."""
    work = tmp_path_factory.mktemp("wide_heads")
    (work / "wide.json").write_text(json.dumps(WIDE_HEADS))
    config = four_layers(work / "wide.json", work / "config.json")
    checkpoint = write_checkpoint(config, work / "checkpoint", experts="mixed")
    model = load_causal_lm(checkpoint, jnp.float32)[1]
    positions = [position for segment in model.model.segments for position in segment.positions]
    assert {position.mlp.experts.weights()[0].format for position in positions} == {"nvfp4", "mxfp8"}
    return model


@pytest.fixture(scope="module")
def four_layer_parity(tmp_path_factory):
    """The parity model's config (4 query heads, 2 KV heads) in four layers, random fp32 weights."""
    work = tmp_path_factory.mktemp("four_layers")
    config = four_layers(PARITY / "tiny_text" / "hf" / "config.json", work / "config.json")
    return write_checkpoint(config, work / "checkpoint", experts="fp32", seed=4)


def assert_mesh_matches_one_device(model, spec, ids, prompt):
    want = np.asarray(logits_fn(model)(ids))
    mesh = make_mesh(spec, model.config)
    sharded = shard_model(model, mesh)
    with jax.set_mesh(mesh):  # the MoE layers run expert-parallel under it
        got = np.asarray(logits_fn(sharded)(ids))
        continuation = greedy_continuation(sharded, prompt, 8)
    assert np.abs(got - want).max() / np.abs(want).max() < 5e-5  # fp32, sums split across devices
    assert continuation == greedy_continuation(model, prompt, 8)


# the parity fixture at tp4 (one query head a device); data parallelism and quantized (mixed NVFP4 / MXFP8)
# experts under a mesh: the wide model's cases below
@pytest.mark.slow
def test_tp4_gives_the_same_logits_and_greedy_continuation(reference, four_layer_parity):
    ids = jnp.asarray(reference["input_ids"][None], jnp.int32)
    model = load_causal_lm(four_layer_parity, jnp.float32)[1]
    assert_mesh_matches_one_device(model, "tp4", ids, reference["greedy_prompt"].tolist())


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["tp2", "tp8", "dp2tp4"])
def test_meshes_up_to_tp8_give_the_same_logits_and_greedy_continuation(wide_model, spec):
    rng = np.random.default_rng(8)
    ids = jnp.asarray(rng.integers(0, 500, (2, 24)), jnp.int32)
    assert_mesh_matches_one_device(wide_model, spec, ids, rng.integers(0, 500, 9).tolist())


@pytest.mark.slow
@pytest.mark.parametrize(("spec", "kv_axis"), [("tp4", None), ("tp2", "model")])
def test_fused_projections_shard_by_head(reference, four_layer_parity, spec, kv_axis):
    """The engine's fused attention projections under a mesh: the query side's by head, sliding layers' K and V by
    KV head while tp divides them (2 KV heads: split at tp2, replicated at tp4); the one-device logits and greedy
    continuation."""
    from inkling_jax.model.attention import fuse_attention_projections

    model = fuse_attention_projections(load_causal_lm(four_layer_parity, jnp.float32)[1])
    sharded = shard_model(model, make_mesh(spec, model.config))
    attentions = [position.self_attn for position in sharded.model.segments[0].positions]
    sliding = next(attention for attention in attentions if attention.sliding)
    assert sliding.query_side.weight[...].sharding.spec == P(None, "model", None, None)
    assert sliding.key_value.weight[...].sharding.spec == P(None, kv_axis, None, None)
    ids = jnp.asarray(reference["input_ids"][None], jnp.int32)
    assert_mesh_matches_one_device(model, spec, ids, reference["greedy_prompt"].tolist())


@pytest.mark.slow
def test_experts_run_on_their_own_devices(wide_model):
    """Under tp8 each device multiplies only its 2 experts: the expert weights are never gathered,
    and the combine is a reduce-scatter."""
    mesh = make_mesh("tp8", wide_model.config)
    sharded = shard_model(wide_model, mesh)
    ids = jnp.asarray(np.random.default_rng(9).integers(0, 500, (1, 16)), jnp.int32)
    with jax.set_mesh(mesh):
        graphdef, state = nnx.split(sharded)
        compiled = jax.jit(lambda state, ids: nnx.merge(graphdef, state)(ids)).lower(state, ids).compile().as_text()
    gathers = [line for line in compiled.splitlines() if "all-gather(" in line]
    assert not any(f"[{shape}]" in line for line in gathers for shape in ("16,64,64", "16,64,32"))
    assert "reduce-scatter(" in compiled


def test_partitioning_follows_the_rules(model):
    sharded = shard_model(model, make_mesh("tp4", model.config))
    stack = sharded.model.segments[-1]  # blocks of 6 layers: each place's parameters stacked [blocks, ...]
    layer = stack.positions[5]  # the full-attention layers
    attention = layer.self_attn
    assert attention.q_proj.weight[...].sharding.spec == P(None, "model", None)
    assert attention.o_proj.weight[...].sharding.spec == P(None, None, "model")
    assert attention.k_proj.weight[...].sharding.spec == P(None, None, None)  # 2 KV heads: replicated at tp4
    assert layer.mlp.gate.weight[...].sharding.spec == P(None, None, None)
    assert sharded.model.embed_tokens.weight[...].sharding.spec == P("model", None)
    assert sharded.lm_head.weight[...].sharding.spec == P("model", None)
    experts = jax.tree.leaves(layer.mlp.experts.weights())
    assert all(leaf.sharding.spec[:2] == (None, "model") for leaf in experts)  # data, scales (and global) by expert
    blocks = stack.segment.blocks
    assert all(leaf.addressable_shards[0].data.shape[:2] == (blocks, 2) for leaf in experts)  # 8 experts / 4
    tp2 = shard_model(model, make_mesh("tp2", model.config)).model.segments[0].positions[5].self_attn
    assert tp2.k_proj.weight[...].sharding.spec == P(None, "model", None)  # 2 KV heads split at tp2
