"""Helper for tests that break a checkpoint on purpose."""

import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

from inkling_jax.checkpoint.safetensors_io import CheckpointFiles, write_safetensors


def edited_copy(checkpoint: Path, tmp_path: Path, edit: Callable[[dict], dict]) -> Path:
    """A single-file copy of `checkpoint` whose tensors pass through `edit(dict) -> dict`."""
    files = CheckpointFiles(checkpoint)
    tensors = edit({name: np.array(files.read(name)) for name in files.names()})
    out = tmp_path / "edited"
    out.mkdir()
    shutil.copy(checkpoint / "config.json", out / "config.json")
    write_safetensors(out / "model.safetensors", tensors)
    return out
