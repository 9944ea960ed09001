"""Orbax checkpoints: round trips (plain experts too), the NaN check and progress of a restore, progress of a save,
and bad directories named in one line (the conversion command exits 2)."""

import json
import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from paths import PARITY

from inkling_jax.checkpoint import CheckpointError, load_causal_lm, load_model, orbax_io, progress
from inkling_jax.checkpoint.finite import value_kind
from inkling_jax.checkpoint.loader import parameter_bytes, parameter_paths
from inkling_jax.model.stack import stacked_rows

PLAIN = PARITY / "tiny_text" / "original"
MIXED = PARITY / "tiny_text_mixed" / "original"
FINDING = re.compile(r"tensor '([^']+)' holds (\d+) non-finite values?")


@pytest.fixture(scope="module")
def mixed() -> nnx.Module:
    return load_causal_lm(MIXED, jnp.bfloat16)[1]


@pytest.fixture(scope="module")
def saved(mixed, tmp_path_factory) -> Path:
    return orbax_io.save(mixed, MIXED / "config.json", tmp_path_factory.mktemp("orbax") / "saved")


@pytest.fixture
def logs(caplog, monkeypatch) -> pytest.LogCaptureFixture:
    """The records of `inkling_jax`'s loggers at INFO (wherever an earlier test sent them)."""
    monkeypatch.setattr(logging.getLogger("inkling_jax"), "propagate", True)
    caplog.set_level(logging.INFO, logger="inkling_jax")
    return caplog


def _bits(model: nnx.Module) -> dict[str, bytes]:
    return {path: np.asarray(v[...]).tobytes() for path, v in parameter_paths(nnx.state(model)).items()}


@pytest.mark.slow
def test_plain_experts_round_trip(tmp_path):
    _, model = load_causal_lm(PLAIN, jnp.float32)
    saved = orbax_io.save(model, PLAIN / "config.json", tmp_path / "plain")
    assert json.loads((saved / orbax_io.MARKER).read_text()) == {"dtype": "float32", "expert_formats": [None] * 12}
    assert _bits(load_model(saved, jnp.float32)[1]) == _bits(model)


@pytest.mark.slow
def test_restore_reports_progress_group_by_group(mixed, saved, logs, monkeypatch):
    monkeypatch.setattr(orbax_io, "RESTORE_GROUP_BYTES", 0)
    monkeypatch.setattr(orbax_io, "RESTORE_GROUPS", 7)
    monkeypatch.setattr(progress, "INTERVAL_S", 0.0)
    _, restored = orbax_io.restore(saved)
    assert _bits(restored) == _bits(mixed)
    mine = [r for r in logs.records if r.getMessage().startswith(f"restoring {saved}:")]
    lines, last = mine[:-1], mine[-1]
    parameters, nbytes = len(parameter_paths(nnx.state(mixed))), parameter_bytes(mixed)
    assert 7 <= len(lines) <= 8 and all(f"/{parameters} tensors" in r.getMessage() for r in lines)
    assert [r.tensors_done for r in lines] == sorted({r.tensors_done for r in lines})
    assert (lines[-1].tensors_done, lines[-1].bytes_done) == (parameters, nbytes)
    assert f"done, {parameters} tensors" in last.getMessage() and f"({nbytes:,} bytes)" in last.getMessage()


def test_save_reports_the_parameters_bytes(mixed, logs, tmp_path):
    out = orbax_io.save(mixed, MIXED / "config.json", tmp_path / "again")
    last = [r for r in logs.records if r.getMessage().startswith(f"saving {out}: done")]
    assert len(last) == 1 and last[0].bytes_done == parameter_bytes(mixed)
    assert f"({parameter_bytes(mixed):,} bytes)" in last[0].getMessage()


@pytest.mark.slow
def test_restore_refuses_non_finite_values_naming_the_stacked_row(mixed, tmp_path):
    """One random value of a random parameter (float, E4M3 or E8M0 codes) made non-finite before saving."""
    seed = np.random.SeedSequence().entropy
    rng = np.random.default_rng(seed)
    variables = parameter_paths(nnx.state(mixed))
    rows = stacked_rows(mixed.config, mixed.model.expert_formats(), list(variables))
    candidates = [path for path in rows if value_kind(path, variables[path].dtype) is not None]
    path = str(rng.choice(candidates))
    original = variables[path][...]
    row = int(rng.choice([row for row, name in rows[path].items() if name is not None]))
    values = np.array(original)
    position = (row, *(int(rng.integers(n)) for n in values.shape[1:]))
    if value_kind(path, values.dtype) == "float":
        values[position] = rng.choice([np.nan, np.inf, -np.inf])
    else:
        values.view(np.uint8)[position] = 0xFF
    variables[path].set_value(jnp.asarray(values))
    try:
        poisoned = orbax_io.save(mixed, MIXED / "config.json", tmp_path / "poisoned")
    finally:
        variables[path].set_value(original)
    with pytest.raises(CheckpointError) as error:
        load_model(poisoned, jnp.bfloat16)
    named = {name: int(count) for name, count in FINDING.findall(str(error.value))}
    assert named == {f"{path}[{row}] ({rows[path][row]})": 1}, f"seed {seed}: {error.value}"


def _damaged(saved: Path, tmp_path: Path, how: str) -> Path:
    if how == "missing":
        return tmp_path / "nothing here"
    if how == "a file":
        (tmp_path / "file").write_text("not a checkpoint")
        return tmp_path / "file"
    if how == "safetensors, not Orbax":
        return MIXED
    copy = tmp_path / "copy"
    shutil.copytree(saved, copy)
    if how == "no parameters":
        shutil.rmtree(copy / orbax_io.PARAMS)
    elif how == "no config":
        (copy / "config.json").unlink()
    elif how == "unreadable marker":
        (copy / orbax_io.MARKER).write_text("{")
    elif how == "damaged data":
        for file in (copy / orbax_io.PARAMS).rglob("d/*"):
            file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    return copy


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("missing", "does not exist"),
        ("a file", "is not a directory"),
        ("safetensors, not Orbax", "is not an Orbax checkpoint of inkling_jax \\(no inkling_jax.json\\)"),
        ("no parameters", "its Orbax parameters \\(params/\\) are missing"),
        ("no config", "is not an Orbax checkpoint of inkling_jax \\(no config.json\\)"),
        ("unreadable marker", "unreadable inkling_jax.json"),
        ("damaged data", "cannot restore the Orbax parameters: "),
    ],
)
def test_bad_directories_are_named(saved, tmp_path, how, message):
    directory = _damaged(saved, tmp_path, how)
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(directory.absolute()))}:? {message}"):
        orbax_io.restore(directory)


def _convert(checkpoint: Path, out: Path) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "inkling_jax.checkpoint.orbax_io",
        "--checkpoint",
        str(checkpoint),
        "--out",
        str(out),
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def _convert_here(checkpoint: Path, out: Path, capsys: pytest.CaptureFixture) -> subprocess.CompletedProcess:
    """The conversion command's main() in this process: its exit status, stdout and stderr. A bad directory is
    named before anything loads, so a process of its own would add only its start (the module's entry point is run
    as a process by `test_the_command_converts_with_progress`)."""
    logger = logging.getLogger("inkling_jax")
    state = list(logger.handlers), logger.level, logger.propagate
    capsys.readouterr()
    try:
        code = orbax_io.main(["--checkpoint", str(checkpoint), "--out", str(out)])
        captured = capsys.readouterr()
    finally:
        logger.handlers[:], logger.level, logger.propagate = state  # main() sends the package's logs to stderr
    return subprocess.CompletedProcess([], code, captured.out, captured.err)


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("missing", "is not a checkpoint directory"),
        ("empty", "no config file at"),
        ("unreadable", "cannot read"),
        ("existing --out", "already exists: an Orbax checkpoint is written to a new directory"),
    ],
)
def test_the_command_names_a_bad_directory_in_one_line(tmp_path, capsys, how, message):
    checkpoint, out = tmp_path / "checkpoint", tmp_path / "out"
    if how == "empty":
        checkpoint.mkdir()
    elif how == "unreadable":
        shutil.copytree(PLAIN, checkpoint)
        (checkpoint / "model.safetensors").unlink()
        (checkpoint / "model.safetensors").mkdir()
    elif how == "existing --out":
        checkpoint, out = PLAIN, tmp_path
    result = _convert_here(checkpoint, out, capsys)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and re.search(message, errors[0]), result.stderr


@pytest.mark.slow
def test_the_command_converts_with_progress(tmp_path):
    result = _convert(PLAIN, tmp_path / "converted")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(tmp_path / "converted")
    assert re.search(rf"loading {PLAIN}: done, \d+ tensors", result.stderr)
    assert re.search(rf"saving {tmp_path / 'converted'}: done, [\d.]+ [KMG]B \([\d,]+ bytes\)", result.stderr)
