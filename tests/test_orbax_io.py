"""Orbax checkpoints: round trips (plain experts too)."""

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from inkling_jax.checkpoint import load_causal_lm, load_model
from inkling_jax.checkpoint.loader import parameter_paths
from inkling_jax.checkpoint.orbax_io import MARKER, save

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "parity"
PLAIN = FIXTURES / "tiny_text" / "original"


def _bits(model: nnx.Module) -> dict[str, bytes]:
    return {path: np.asarray(v[...]).tobytes() for path, v in parameter_paths(nnx.state(model)).items()}


def test_plain_experts_round_trip(tmp_path):
    _, model = load_causal_lm(PLAIN, jnp.float32)
    saved = save(model, PLAIN / "config.json", tmp_path / "plain")
    assert json.loads((saved / MARKER).read_text()) == {"dtype": "float32", "expert_formats": [None] * 12}
    assert _bits(load_model(saved, jnp.float32)[1]) == _bits(model)
