"""Loading straight into shards on 8 simulated CPU devices (tests/conftest.py): the same bits and shardings
as an unsharded load followed by `shard_model`, read slice by slice, for Orbax too."""

import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from checkpoint_edits import edited_copy
from flax import nnx
from numpy.lib.array_utils import byte_bounds
from paths import PARITY

from inkling_jax.checkpoint import CheckpointError, load_causal_lm, load_model
from inkling_jax.checkpoint.loader import parameter_paths
from inkling_jax.checkpoint.orbax_io import save
from inkling_jax.checkpoint.safetensors_io import CheckpointFiles
from inkling_jax.checkpoint.synthetic import write_checkpoint
from inkling_jax.config import load_config
from inkling_jax.sharding import MODEL, make_mesh, parameter_shardings, shard_model

MIXED = PARITY / "tiny_text_mixed" / "original"  # NVFP4 layers 0-9, MXFP8 10-11, interleaved w13
MESHES = ["tp4", "dp2tp4"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Plain and quantized (mixed NVFP4 / MXFP8) experts in both layouts; random weights throughout."""
    out = tmp_path_factory.mktemp("mixed_transformers")
    config = PARITY / "tiny_text" / "hf" / "config.json"
    return {
        "plain_transformers": PARITY / "tiny_text" / "hf",
        "plain_original": PARITY / "tiny_text" / "original",
        "mixed_original": MIXED,
        "mixed_transformers": write_checkpoint(config, out, seed=11, experts="mixed", layout="transformers"),
    }


@pytest.fixture(scope="module")
def unsharded(checkpoints):
    return {name: load_causal_lm(path, jnp.bfloat16)[1] for name, path in checkpoints.items()}


def _mesh(checkpoint: Path, spec: str):
    return make_mesh(spec, load_config(checkpoint).text)


def _bits(array) -> bytes:
    return np.asarray(array).tobytes()


def assert_placed_like(got: nnx.Module, want: nnx.Module, mesh) -> None:
    """Every parameter of `got` has the sharding the rules give it and the bits of `want` sharded."""
    shardings = parameter_paths(parameter_shardings(got, mesh))
    placed = parameter_paths(nnx.state(shard_model(want, mesh)))
    params = parameter_paths(nnx.state(got))
    assert params.keys() == placed.keys()
    for path, variable in params.items():
        array, reference = variable[...], placed[path][...]
        assert array.sharding == shardings[path] == reference.sharding, path
        assert array.dtype == reference.dtype and array.shape == reference.shape, path
        shards = sorted(array.addressable_shards, key=lambda s: s.device.id)
        references = sorted(reference.addressable_shards, key=lambda s: s.device.id)
        for shard, expected in zip(shards, references, strict=True):
            assert shard.index == expected.index, path
            assert _bits(shard.data) == _bits(expected.data), (path, shard.device)


@pytest.mark.slow
@pytest.mark.parametrize("spec", MESHES)
@pytest.mark.parametrize("name", ["plain_transformers", "plain_original", "mixed_original", "mixed_transformers"])
def test_sharded_load_equals_unsharded_load_then_shard_model(checkpoints, unsharded, name, spec):
    mesh = _mesh(checkpoints[name], spec)
    _, model = load_causal_lm(checkpoints[name], jnp.bfloat16, mesh)
    assert_placed_like(model, unsharded[name], mesh)


@pytest.mark.parametrize("spec", ["tp4", pytest.param("dp2tp4", marks=pytest.mark.slow)])
def test_each_shard_reads_only_its_slice_and_each_slice_is_read_once(monkeypatch, spec):
    """Record the byte range (within its tensor) of every slice the loader cuts from the memory-mapped
    files, which is all it touches: an expert-sharded tensor is asked for exactly its tp shards, each
    once even when dp replicas hold it (de-interleaved w13 included); head- and vocabulary-sharded rows
    likewise; a replicated tensor is read whole, once."""
    requests: list[tuple[str, int, int]] = []
    read = CheckpointFiles.read

    def recording_read(self, name, index=()):
        view = read(self, name, index)
        entry = self.entry(name)
        tensor = np.empty(entry.shape, entry.dtype)  # the tensor's bytes, laid out as in the file
        (start, _), (low, high) = byte_bounds(tensor), byte_bounds(tensor[index] if index else tensor)
        assert view.shape == np.shape(tensor[index] if index else tensor)
        requests.append((name, low - start, high - start))
        return view

    monkeypatch.setattr(CheckpointFiles, "read", recording_read)
    mesh = _mesh(MIXED, spec)
    load_causal_lm(MIXED, jnp.bfloat16, mesh)
    tp, files = mesh.shape[MODEL], CheckpointFiles(MIXED)

    def ranges(name: str) -> list[tuple[int, int]]:
        return sorted((low, high) for n, low, high in requests if n == name)

    def shards(name: str, parts: int) -> list[tuple[int, int]]:
        size = files.entry(name).nbytes
        return [(i * size // parts, (i + 1) * size // parts) for i in range(parts)]

    experts = [n for n in files.names() if re.fullmatch(r".*\.mlp\.experts\.w(13|2)_weight([._]scale)?", n)]
    assert len(experts) == 12 * 2 * 2  # data and block scales of w13 and w2 in 12 layers
    for name in experts:
        assert ranges(name) == shards(name, tp), name
    for name in files.names():  # one float per expert, stored in several shapes: read whole
        if re.fullmatch(r".*\.mlp\.experts\.w(13|2)_weight(_scale_2|\.scale2)", name):
            assert set(ranges(name)) == set(shards(name, 1)), name
    for name in ("model.llm.layers.3.attn.wq_du.weight", "model.llm.embed.weight", "model.llm.unembed.weight"):
        assert ranges(name) == shards(name, tp), name
    for name in ("model.llm.layers.3.mlp.gate.weight", "model.llm.layers.3.attn.wk_dv.weight"):
        assert ranges(name) == shards(name, 1), name


NV_SCALE = "model.llm.layers.1.mlp.experts.w13_weight_scale"
NV_GLOBAL = "model.llm.layers.1.mlp.experts.w13_weight_scale_2"
MX_SCALE = "model.llm.layers.11.mlp.experts.w2_weight_scale"


def _nan_in_last_expert(t):
    t[MX_SCALE][-1, 3, 0] = 255  # E8M0 NaN, in the last device's shard only
    return t


def _nan_nv_scale(t):
    t[NV_SCALE][5, 0, 1] = np.float32(np.nan)
    return t


def _zero_global_scale(t):
    t[NV_GLOBAL][6] = 0.0
    return t


@pytest.mark.slow
@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_nan_in_last_expert, f"tensor '{MX_SCALE}' holds 1 non-finite value$"),
        (_nan_nv_scale, f"tensor '{NV_SCALE}' holds 1 non-finite value$"),
        (_zero_global_scale, f"global scale '{NV_GLOBAL}' must be finite and positive"),
    ],
)
def test_scale_checks_run_on_every_shard(tmp_path, edit, message):
    checkpoint = edited_copy(MIXED, tmp_path, edit)
    with pytest.raises(CheckpointError, match=message):
        load_causal_lm(checkpoint, jnp.bfloat16, _mesh(checkpoint, "tp4"))


@pytest.mark.slow
def test_one_global_scale_for_all_experts_reaches_every_shard(tmp_path):
    checkpoint = edited_copy(MIXED, tmp_path, lambda t: {**t, NV_GLOBAL: t[NV_GLOBAL][:1].copy()})
    mesh = _mesh(checkpoint, "tp4")
    _, model = load_causal_lm(checkpoint, jnp.bfloat16, mesh)
    assert_placed_like(model, load_causal_lm(checkpoint, jnp.bfloat16)[1], mesh)
    shared = model.model.layers[1].mlp.experts.gate_up_proj.global_scale[...]
    assert np.unique(np.asarray(shared)).size == 1


@pytest.mark.slow
def test_orbax_restores_straight_into_shards(checkpoints, unsharded, tmp_path):
    """Save a tp4-sharded model, restore it onto dp2tp4 through `load_model`: same bits, the rules' shardings."""
    checkpoint = checkpoints["mixed_transformers"]
    _, sharded = load_model(checkpoint, jnp.bfloat16, _mesh(checkpoint, "tp4"))
    saved = save(sharded, checkpoint / "config.json", tmp_path / "orbax")
    mesh = _mesh(saved, "dp2tp4")
    _, restored = load_model(saved, jnp.bfloat16, mesh)
    assert_placed_like(restored, unsharded["mixed_transformers"], mesh)
