"""Peak host memory while loading a checkpoint straight into shards, against loading whole then sharding.

    python -m bench.sharded_load [--layers 24] [--mesh tp8] [--work DIR] [--out FILE.json]

Writes a synthetic checkpoint (bf16 experts, original layout: w13 rows are de-interleaved on load) of
several GB whose largest tensor is a few percent of it, then loads it in fresh processes on 8 simulated
CPU devices, where device buffers live in host memory too:

- `sharded`: `load_causal_lm(..., mesh=make_mesh(--mesh))`, each parameter built from its shards' slices;
- `whole_then_shard`: `load_causal_lm` onto one device, then `shard_model` (what `generate --mesh` does).

A background thread samples /proc/self/status every 2 ms. The transient overhead is the largest excess
of anonymous RSS (RssAnon, over the process's before loading) over the bytes of parameters placed so far
(sum of their shards' nbytes): the memory the load uses beyond what it keeps. It must stay near the
largest tensor, not the model. File-backed RSS (the mapped checkpoint pages) is reported apart.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

CONFIG = {
    "model_type": "inkling2_text",
    "vocab_size": 32768,
    "unpadded_vocab_size": 32000,
    "hidden_size": 1024,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "swa_num_attention_heads": 8,
    "swa_num_key_value_heads": 2,
    "swa_head_dim": 128,
    "moe_intermediate_size": 512,
    "n_routed_experts": 64,
    "num_experts_per_tok": 8,
    "eos_token_id": 2,
}
MODES = ("sharded", "whole_then_shard")


def _status() -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of this process, in bytes."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                fields[key] = int(value.split()[0]) * 1024
    return fields


class Sampler(threading.Thread):
    """Samples memory every `interval` s; `held` is the parameter bytes placed so far, set by the loader hook."""

    def __init__(self, baseline: dict[str, int], interval: float = 0.002):
        super().__init__(daemon=True)
        self.baseline, self.interval, self.held = baseline, interval, 0
        self.peak = dict.fromkeys(("VmRSS", "RssAnon", "RssFile", "overhead"), 0)
        self.stopped = threading.Event()

    def sample(self) -> None:
        status = _status()
        for key in ("VmRSS", "RssAnon", "RssFile"):
            self.peak[key] = max(self.peak[key], status[key])
        self.peak["overhead"] = max(self.peak["overhead"], status["RssAnon"] - self.baseline["RssAnon"] - self.held)

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            self.sample()


def _shard_bytes(array) -> list[int]:
    return [shard.data.nbytes for shard in array.addressable_shards]


def measure(checkpoint: Path, mode: str, spec: str) -> dict:
    """Load `checkpoint` the way `mode` says and report memory; runs in a fresh process."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from inkling_jax.checkpoint import loader
    from inkling_jax.checkpoint.safetensors_io import CheckpointFiles
    from inkling_jax.config import load_config
    from inkling_jax.sharding import make_mesh, shard_model

    mesh = make_mesh(spec, load_config(checkpoint).text)
    jax.block_until_ready(jax.device_put(jnp.zeros(8), jax.devices()[1]))  # runtime up before the baseline
    sampler = Sampler(_status())
    placed = loader._placed

    def counted(*args, **kwargs):
        array = placed(*args, **kwargs)
        sampler.held += sum(_shard_bytes(array))
        return array

    loader._placed = counted
    sampler.start()
    start = time.perf_counter()
    if mode == "sharded":
        _, model = loader.load_causal_lm(checkpoint, jnp.bfloat16, mesh)
    else:
        _, whole = loader.load_causal_lm(checkpoint, jnp.bfloat16)
        model = shard_model(whole, mesh)
        del whole
    leaves = jax.tree.leaves(nnx.state(model))
    jax.block_until_ready(leaves)
    seconds = time.perf_counter() - start
    sampler.stopped.set()
    sampler.join()
    sampler.sample()
    files = CheckpointFiles(checkpoint)
    shards = [size for leaf in leaves for size in _shard_bytes(leaf)]
    after = _status()
    return {
        "mode": mode,
        "load_s": round(seconds, 2),
        "parameter_bytes_held": sum(shards),
        "largest_tensor_bytes": max(files.entry(name).nbytes for name in files.names()),
        "largest_shard_bytes": max(shards),
        "baseline_rss_anon": sampler.baseline["RssAnon"],
        "peak_rss": sampler.peak["VmRSS"],
        "peak_rss_anon": sampler.peak["RssAnon"],
        "peak_rss_file": sampler.peak["RssFile"],
        "rss_after_load": after["VmRSS"],
        "rss_anon_after_load": after["RssAnon"],
        "transient_overhead": sampler.peak["overhead"],
        "peak_anon_over_final_params": sampler.peak["RssAnon"] - sampler.baseline["RssAnon"] - sum(shards),
    }


def _measured(checkpoint: Path, mode: str, spec: str) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    command = [sys.executable, "-m", "bench.sharded_load", "--measure", str(checkpoint), mode, "--mesh", spec]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if result.returncode:
        raise RuntimeError(f"{mode} load failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--mesh", default="tp8")
    parser.add_argument("--work", type=Path, help="scratch directory (default: a temporary one under /tmp)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--measure", nargs=2, metavar=("CHECKPOINT", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(Path(args.measure[0]), args.measure[1], args.mesh)))
        return

    from inkling_jax.checkpoint.synthetic import write_checkpoint

    work = args.work or Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        (work / "config.json").write_text(json.dumps({**CONFIG, "num_hidden_layers": args.layers}))
        start = time.perf_counter()
        checkpoint = write_checkpoint(work / "config.json", work / "checkpoint", experts="bf16")
        write_s = time.perf_counter() - start
        index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
        runs = {mode: _measured(checkpoint, mode, args.mesh) for mode in MODES}
    finally:
        shutil.rmtree(work)
    result = {
        "command": "python -m bench.sharded_load " + " ".join(sys.argv[1:]),
        "mesh": args.mesh,
        "devices": "8 simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)",
        "config": {**CONFIG, "num_hidden_layers": args.layers, "experts": "bf16", "layout": "original"},
        "checkpoint_bytes": index["metadata"]["total_size"],
        "write_synthetic_s": round(write_s, 1),
        **runs,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
