"""A load reports its progress: tensors and bytes done (adding up to the checkpoint's, counted here from the
files' own headers), the rate and the time left, then a last line with the totals; a bar on a terminal."""

import io
import json
import logging
import re
import struct
from pathlib import Path

import jax.numpy as jnp
import pytest
from paths import TINY_TEXT

from inkling_jax.checkpoint import load_causal_lm, progress
from inkling_jax.checkpoint.synthetic import write_checkpoint

CONFIG = TINY_TEXT / "original" / "config.json"
PROGRESS = re.compile(r"loading (.+): (\d+)/(\d+) tensors, [\d.]+/[\d.]+ [KMG]B \(\d+%\), [\d.e+-]+ GB/s, .+ left")
LAST = re.compile(r"loading (.+): done, (\d+) tensors, [\d.]+ [KMG]B \(([\d,]+) bytes\) in [\d.]+ s, [\d.e+-]+ GB/s")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """Mixed NVFP4 / MXFP8 experts over several files; every tensor in it is loaded."""
    out = tmp_path_factory.mktemp("progress")
    return write_checkpoint(CONFIG, out, experts="mixed", shard_bytes=300_000)


def _headers(checkpoint: Path) -> tuple[int, int]:
    """(tensors, bytes of tensor data) of a checkpoint, from its files' headers."""
    tensors = nbytes = 0
    for file in sorted(checkpoint.glob("*.safetensors")):
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        tensors += len(header)
        nbytes += sum(end - begin for begin, end in (entry["data_offsets"] for entry in header.values()))
    return tensors, nbytes


@pytest.fixture
def logs(caplog, monkeypatch) -> pytest.LogCaptureFixture:
    """The records of `inkling_jax`'s loggers at INFO (wherever an earlier test sent them)."""
    monkeypatch.setattr(logging.getLogger("inkling_jax"), "propagate", True)
    caplog.set_level(logging.INFO, logger="inkling_jax")
    return caplog


def _load(checkpoint: Path, logs: pytest.LogCaptureFixture) -> tuple[list, list]:
    """Load; the progress lines and last lines of this load."""
    load_causal_lm(checkpoint, jnp.bfloat16)
    mine = [r for r in logs.records if r.getMessage().startswith(f"loading {checkpoint}:")]
    return [r for r in mine if PROGRESS.fullmatch(r.getMessage())], [r for r in mine if LAST.fullmatch(r.getMessage())]


def _steps(done: list[int]) -> list[int]:
    """What each line adds to the one before (to zero, for the first)."""
    return [after - before for before, after in zip([0, *done[:-1]], done, strict=True)]


@pytest.mark.slow
def test_lines_add_up_to_the_checkpoint(checkpoint, logs, monkeypatch):
    monkeypatch.setattr(progress, "INTERVAL_S", 0.0)  # a line for every parameter placed
    tensors, nbytes = _headers(checkpoint)
    lines, last = _load(checkpoint, logs)
    done = [int(PROGRESS.fullmatch(r.getMessage())[2]) for r in lines]
    assert {int(PROGRESS.fullmatch(r.getMessage())[3]) for r in lines} == {tensors}
    assert [r.tensors_done for r in lines] == done
    assert len(lines) > 10 and min(_steps(done)) > 0 and sum(_steps(done)) == tensors
    byte_steps = _steps([r.bytes_done for r in lines])
    assert min(byte_steps) > 0 and sum(byte_steps) == nbytes
    assert len(last) == 1
    match = LAST.fullmatch(last[0].getMessage())
    assert (int(match[2]), int(match[3].replace(",", ""))) == (tensors, nbytes)


@pytest.mark.slow
def test_without_a_terminal_a_line_every_tenth_of_the_bytes(checkpoint, logs, monkeypatch):
    monkeypatch.setattr(progress, "INTERVAL_S", float("inf"))
    _, nbytes = _headers(checkpoint)
    lines, last = _load(checkpoint, logs)
    assert 5 <= len(lines) <= 10 and min(_steps([r.bytes_done for r in lines])) >= nbytes / 10
    assert len(last) == 1 and last[0].bytes_done == nbytes


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_a_bar_and_the_last_line(checkpoint, logs, monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    monkeypatch.setattr(progress, "INTERVAL_S", 0.0)
    tensors, nbytes = _headers(checkpoint)
    lines, last = _load(checkpoint, logs)
    assert lines == [] and len(last) == 1 and last[0].bytes_done == nbytes
    bar = terminal.getvalue()
    assert f"loading {checkpoint}: 100%" in bar and f"{tensors}/{tensors} tensors" in bar and "B/s" in bar
