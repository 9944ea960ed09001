"""Meshes and parameter partitioning on 8 simulated CPU devices (tests/conftest.py)."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from inkling_jax.checkpoint import load_causal_lm
from inkling_jax.forward import greedy_continuation, logits_fn
from inkling_jax.sharding import MeshError, make_mesh, parse_mesh, shard_model

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "parity"


@pytest.fixture(scope="module")
def reference():
    return dict(np.load(FIXTURES / "tiny_text" / "reference.npz"))


@pytest.fixture(scope="module", params=["tiny_text", "tiny_text_mixed"])
def model(request):
    layout = "hf" if request.param == "tiny_text" else "original"
    return load_causal_lm(FIXTURES / request.param / layout, jnp.float32)[1]


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


@pytest.mark.parametrize("spec", ["tp2", "tp4", "dp2tp2", "dp2tp4"])
def test_meshes_give_the_same_logits_and_greedy_continuation(model, reference, spec):
    ids = jnp.asarray(reference["input_ids"][None], jnp.int32)
    want = np.asarray(logits_fn(model)(ids))
    sharded = shard_model(model, make_mesh(spec, model.config))
    got = np.asarray(logits_fn(sharded)(ids))
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
    prompt = reference["greedy_prompt"].tolist()
    assert greedy_continuation(sharded, prompt, 8) == greedy_continuation(model, prompt, 8)


def test_partitioning_follows_the_rules(model):
    sharded = shard_model(model, make_mesh("tp4", model.config))
    layer = sharded.model.layers[5]  # a full-attention layer
    attention = layer.self_attn
    assert attention.q_proj.weight[...].sharding.spec == P("model", None)
    assert attention.o_proj.weight[...].sharding.spec == P(None, "model")
    assert attention.k_proj.weight[...].sharding.spec == P(None, None)  # 2 KV heads: replicated at tp4
    assert layer.mlp.gate.weight[...].sharding.spec == P(None, None)
    assert sharded.model.embed_tokens.weight[...].sharding.spec == P("model", None)
    assert sharded.lm_head.weight[...].sharding.spec == P("model", None)
    experts = jax.tree.leaves(layer.mlp.experts.weights())
    assert all(leaf.sharding.spec[0] == "model" for leaf in experts)  # data, scales (and global) by expert
    assert all(leaf.addressable_shards[0].data.shape[0] == 2 for leaf in experts)  # 8 experts / 4
    tp2 = shard_model(model, make_mesh("tp2", model.config)).model.layers[5].self_attn
    assert tp2.k_proj.weight[...].sharding.spec == P("model", None)  # 2 KV heads split at tp2
