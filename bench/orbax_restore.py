"""Restore from Orbax vs. reconversion from safetensors, on a mid-size synthetic checkpoint.

    python -m bench.orbax_restore [--work DIR] [--repeats 3] [--out FILE.json]

Writes a synthetic checkpoint (mixed NVFP4 / MXFP8 experts, original layout, sharded), then times
`load_causal_lm` (read, de-interleave, check and place every tensor) against `orbax_io.restore` of the
same parameters saved with Orbax. Both read from the page cache after the first pass; the first
(cold) pass is reported separately.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from inkling_jax.checkpoint.loader import load_causal_lm, parameter_bytes
from inkling_jax.checkpoint.orbax_io import restore, save
from inkling_jax.checkpoint.synthetic import write_checkpoint

MID_SIZE = {
    "model_type": "inkling2_text", "vocab_size": 32768, "unpadded_vocab_size": 32000, "hidden_size": 1024,
    "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
    "swa_num_attention_heads": 8, "swa_num_key_value_heads": 2, "swa_head_dim": 128, "moe_intermediate_size": 512,
    "n_routed_experts": 64, "num_experts_per_tok": 8, "eos_token_id": 2,
}  # fmt: skip


def _timed(load) -> tuple[float, object]:
    start = time.perf_counter()
    model = load()
    jax.block_until_ready(jax.tree.leaves(model))
    return time.perf_counter() - start, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, help="scratch directory (default: a temporary one)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp())
    (work / "config.json").write_text(json.dumps(MID_SIZE))
    start = time.perf_counter()
    safetensors = write_checkpoint(work / "config.json", work / "safetensors", experts="mixed", shard_bytes=256 << 20)
    write_s = time.perf_counter() - start
    checkpoint_bytes = json.loads((safetensors / "model.safetensors.index.json").read_text())["metadata"]["total_size"]

    convert = lambda: load_causal_lm(safetensors, jnp.bfloat16)[1]  # noqa: E731
    convert_cold, model = _timed(convert)
    orbax_dir = work / "orbax"
    shutil.rmtree(orbax_dir, ignore_errors=True)
    start = time.perf_counter()
    save(model, safetensors / "config.json", orbax_dir)
    save_s = time.perf_counter() - start
    restore_cold, restored = _timed(lambda: restore(orbax_dir)[1])
    ids = jnp.asarray([[1, 2, 3, 4]], jnp.int32)
    same = bool(np.array_equal(np.asarray(model(ids)), np.asarray(restored(ids))))
    convert_s = [_timed(convert)[0] for _ in range(args.repeats)]
    restore_s = [_timed(lambda: restore(orbax_dir)[1])[0] for _ in range(args.repeats)]
    result = {
        "device": str(jax.devices()[0]),
        "checkpoint_bytes": checkpoint_bytes,
        "device_bytes": parameter_bytes(model),
        "write_synthetic_s": round(write_s, 2),
        "orbax_save_s": round(save_s, 2),
        "convert_cold_s": round(convert_cold, 2),
        "restore_cold_s": round(restore_cold, 2),
        "convert_median_s": round(float(np.median(convert_s)), 2),
        "restore_median_s": round(float(np.median(restore_s)), 2),
        "restored_logits_identical": same,
    }
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps({"command": "python -m bench.orbax_restore", **result}, indent=2) + "\n")
    if args.work is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
