"""Checks made while loading: NaN / Inf in any weight or scale is refused, naming the tensor and its count.

Each poisoned checkpoint is an edited copy of a fixture (or of a synthetic checkpoint) with one value made
non-finite, in a tensor and at a position drawn from a fresh seed (printed on failure)."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from checkpoint_edits import edited_copy
from paths import PARITY, REPO

from inkling_jax.checkpoint import CheckpointError, load_causal_lm
from inkling_jax.checkpoint.finite import E4M3_CODES, E8M0_CODES, FLOAT, FiniteCheck
from inkling_jax.checkpoint.safetensors_io import CheckpointFiles
from inkling_jax.checkpoint.synthetic import write_checkpoint
from inkling_jax.config import load_config
from inkling_jax.sharding import make_mesh

PLAIN = PARITY / "tiny_text" / "original"  # fp32, plain experts: one segment of two blocks (rows i and i + 6)
MIXED = PARITY / "tiny_text_mixed" / "original"  # fp32, NVFP4 layers 0-7 (two sidecar namings), MXFP8 8-11
MXFP8 = PARITY / "tiny_text_mxfp8" / "original"  # fp32, MXFP8 experts: E4M3 or U8 values, U8 or E8M0 scales

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
NOT_LOADED = re.compile(r".*(_input_scale|\.input_amax|\.original_shape)")
GLOBAL_SCALE = re.compile(r".*mlp\.experts\.w(13|2)_weight(_scale_2|\.scale2)")
EXPERT_WEIGHT = re.compile(r".*mlp\.experts\.w(13|2)_weight")
BLOCK_SCALE = re.compile(r".*mlp\.experts\.w(13|2)_weight(_scale|\.scale)")
FINDING = re.compile(r"tensor '([^']+)' holds (\d+) non-finite values?")


def _is_dense(name: str, dtype: np.dtype) -> bool:
    float_dtype = dtype in (np.float32, ml_dtypes.bfloat16)
    return float_dtype and not (NOT_LOADED.fullmatch(name) or GLOBAL_SCALE.fullmatch(name))


# each kind of tensor poisoned: which tensors are of the kind, and its NaN codes (None: a float, NaN / +-Inf)
E4M3_NANS, E8M0_NANS = (0x7F, 0xFF), (0xFF,)
KINDS = {
    "dense": (_is_dense, None),
    "mxfp8 values": (lambda name, dtype: bool(EXPERT_WEIGHT.fullmatch(name)) and dtype in (E4M3, np.uint8), E4M3_NANS),
    "e8m0 scale": (lambda name, dtype: bool(BLOCK_SCALE.fullmatch(name)) and dtype in (E8M0, np.uint8), E8M0_NANS),
    "nvfp4 block scale": (lambda name, dtype: bool(BLOCK_SCALE.fullmatch(name)) and dtype == E4M3, E4M3_NANS),
    "nvfp4 global scale": (lambda name, dtype: bool(GLOBAL_SCALE.fullmatch(name)), None),
}


def _of_kind(checkpoint: Path, kind: str) -> list[str]:
    files = CheckpointFiles(checkpoint)
    return [name for name in files.names() if KINDS[kind][0](name, files.entry(name).dtype)]


def _poison(array: np.ndarray, rng: np.random.Generator, nans: tuple[int, ...] | None, count: int = 1) -> np.ndarray:
    """`array` with `count` of its values, at distinct random positions, made NaN or Inf: a float's NaN / +-Inf,
    else one of the byte codes `nans` (E4M3 values, whether stored as E4M3 or U8: 0x7F / 0xFF; E8M0: 0xFF)."""
    array = array.copy()
    flat = array.reshape(-1)
    positions = rng.choice(flat.size, count, replace=False)
    if nans is None:
        flat[positions] = rng.choice(np.array([np.nan, np.inf, -np.inf], np.float32), count)
    else:
        flat.view(np.uint8)[positions] = rng.choice(nans, count)
    return array


def _findings(error: CheckpointError) -> dict[str, int]:
    return {name: int(count) for name, count in FINDING.findall(str(error))}


@pytest.fixture(scope="module")
def bf16_mixed(tmp_path_factory) -> Path:
    """Synthetic: bf16 dense weights, NVFP4 layers 0-7 and MXFP8 8-11 (ModelOpt names)."""
    out = tmp_path_factory.mktemp("bf16_mixed")
    return write_checkpoint(PLAIN / "config.json", out, seed=5, experts="mixed", nvfp4_layers=range(8))


@pytest.fixture
def rng() -> tuple[int, np.random.Generator]:
    seed = np.random.SeedSequence().entropy
    return seed, np.random.default_rng(seed)


def _checkpoint(which: str, bf16_mixed: Path) -> Path:
    return {"plain": PLAIN, "mixed": MIXED, "mxfp8": MXFP8, "bf16 mixed": bf16_mixed}[which]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("which", "kind", "dtype"),
    [
        ("plain", "dense", jnp.float32),
        ("bf16 mixed", "dense", jnp.bfloat16),
        ("mxfp8", "mxfp8 values", jnp.bfloat16),
        ("mxfp8", "e8m0 scale", jnp.bfloat16),
        ("mixed", "nvfp4 block scale", jnp.float32),
        ("bf16 mixed", "nvfp4 global scale", jnp.bfloat16),
    ],
)
def test_a_non_finite_value_is_refused_naming_its_tensor(which, kind, dtype, bf16_mixed, rng, tmp_path):
    seed, generator = rng
    checkpoint = _checkpoint(which, bf16_mixed)
    name = str(generator.choice(_of_kind(checkpoint, kind)))
    poisoned = edited_copy(checkpoint, tmp_path, lambda t: {**t, name: _poison(t[name], generator, KINDS[kind][1])})
    with pytest.raises(CheckpointError) as error:
        load_causal_lm(poisoned, dtype)
    assert str(error.value) == f"{poisoned}: tensor {name!r} holds 1 non-finite value", f"seed {seed}"


def test_every_offending_tensor_is_named_with_its_count(rng, tmp_path):
    """Layers i and i + 6 of the plain fixture are two rows of one stacked parameter: each is named apart."""
    seed, generator = rng
    position, count = int(generator.integers(6)), generator.integers(1, 6, size=3)
    files = CheckpointFiles(PLAIN)
    layer = f"model.llm.layers.{position}."
    suffixes = sorted(name.removeprefix(layer) for name in files.names() if name.startswith(layer))
    suffix = str(generator.choice(suffixes))
    rows = [f"model.llm.layers.{layer}.{suffix}" for layer in (position, position + 6)]
    expected = dict(zip([*rows, "model.llm.embed.weight"], map(int, count), strict=True))
    edit = lambda t: {**t, **{name: _poison(t[name], generator, None, n) for name, n in expected.items()}}  # noqa: E731
    with pytest.raises(CheckpointError) as error:
        load_causal_lm(edited_copy(PLAIN, tmp_path, edit), jnp.float32)
    assert _findings(error.value) == expected, f"seed {seed}: {error.value}"


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["tp4", "dp2tp4"])
def test_sharded_loads_are_checked_across_their_shards(spec, rng, tmp_path):
    seed, generator = rng
    name, count = str(generator.choice(_of_kind(MXFP8, "e8m0 scale"))), int(generator.integers(1, 9))
    poisoned = edited_copy(MXFP8, tmp_path, lambda t: {**t, name: _poison(t[name], generator, E8M0_NANS, count)})
    with pytest.raises(CheckpointError) as error:
        load_causal_lm(poisoned, jnp.bfloat16, make_mesh(spec, load_config(MXFP8).text))
    assert _findings(error.value) == {name: count}, f"seed {seed}: {error.value}"


@pytest.mark.slow
@pytest.mark.parametrize("which", ["plain", "mixed", "mxfp8", "bf16 mixed"])
def test_clean_checkpoints_load(which, bf16_mixed):
    load_causal_lm(_checkpoint(which, bf16_mixed), jnp.bfloat16)


@pytest.mark.parametrize(
    ("kind", "dtype", "nans"),
    [(E4M3_CODES, E4M3, {0x7F, 0xFF}), (E4M3_CODES, np.uint8, {0x7F, 0xFF}), (E8M0_CODES, np.uint8, {0xFF})],
)
def test_every_code_of_a_format_is_judged_right(kind, dtype, nans):
    """Each of the 256 codes in a row of its own: exactly the format's NaN codes are named."""
    codes = np.arange(256, dtype=np.uint8).reshape(256, 1, 1).repeat(3, axis=1).view(dtype)
    check = FiniteCheck()
    check.add(jnp.asarray(codes), kind, [f"code {code}" for code in range(256)])
    with pytest.raises(CheckpointError) as error:
        check.raise_if_any("codes")
    assert _findings(error.value) == {f"code {code}": 3 for code in sorted(nans)}


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_float_specials_are_judged_right(dtype, rng):
    seed, generator = rng
    info = np.finfo(dtype)
    values = [np.nan, np.inf, -np.inf, float(info.max), float(-info.max), float(info.smallest_subnormal), 0.0, -0.0]
    rows = np.array(generator.permutation(values), dtype).reshape(-1, 1)
    check = FiniteCheck()
    check.add(jnp.asarray(rows), FLOAT, [str(float(value)) for value in rows[:, 0]])
    with pytest.raises(CheckpointError) as error:
        check.raise_if_any("specials")
    assert _findings(error.value) == {"nan": 1, "inf": 1, "-inf": 1}, f"seed {seed}"


@pytest.mark.slow
def test_two_processes_both_refuse_a_value_only_one_of_them_holds(rng, tmp_path):
    """tp4 over two processes of two devices: the second holds experts 4-7 of the MXFP8 fixture's 8. A NaN in one
    of them is found there and named by both processes (their flags and counts are gathered), which exit 2."""
    seed, generator = rng
    name = str(generator.choice(_of_kind(MXFP8, "e8m0 scale")))

    def edit(tensors: dict) -> dict:
        scales = tensors[name].copy()
        expert, row, block = int(generator.integers(4, 8)), *(int(generator.integers(n)) for n in scales.shape[1:])
        scales.view(np.uint8)[expert, row, block] = 0xFF
        return {**tensors, name: scales}

    poisoned = edited_copy(MXFP8, tmp_path, edit)
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "a", "prompt_token_ids": [1, 2, 3], "max_tokens": 2}) + "\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    flags = "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags, "PYTHONPATH": str(REPO)}
    commands = [
        [sys.executable, "-m", "inkling_jax.offline", "--checkpoint", str(poisoned), "--input",
         str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"), "--mesh", "tp4",
         "--coordinator-address", address, "--num-processes", "2", "--process-id", str(rank)]
        for rank in range(2)
    ]  # fmt: skip
    processes = [subprocess.Popen(c, env=env, stderr=subprocess.PIPE, text=True) for c in commands]
    errors = [p.communicate(timeout=300)[1] for p in processes]
    assert [p.returncode for p in processes] == [2, 2], errors
    for stderr in errors:
        lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
        assert lines == [f"error: {poisoned}: tensor {name!r} holds 1 non-finite value"], f"seed {seed}: {stderr}"
