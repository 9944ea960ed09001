"""What the NaN / Inf check (`inkling_jax/checkpoint/finite.py`) adds to a load, on a synthetic checkpoint.

    python -m bench.load_check [--experts bf16|mixed] [--layers 12] [--mesh none|tp8] [--repeats 5]
        [--work DIR] [--out FILE.json]

Writes a synthetic checkpoint (hidden 1024, 64 experts of 512, vocab 32768; bf16 or mixed NVFP4 / MXFP8 experts;
reused from --work when it is there), then in a fresh process on 8 simulated CPU devices loads it, with the
page cache warm, alternately with the check and with it stubbed out (`loader.FiniteCheck`), timing too the
load's time inside the check's calls (dispatching each parameter's program, reading the flags at the end: what
the check adds to the load's wall time, whatever else runs on the machine), and times the check alone on the
loaded parameters. The first load with the check also compiles its programs (one per parameter shape, dtype and
sharding).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.sharded_load import CONFIG  # the same synthetic model's widths


def measure(checkpoint: Path, spec: str, repeats: int) -> dict:
    """Loads with and without the check, and the check alone; runs in a fresh process."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from inkling_jax.checkpoint import finite, loader
    from inkling_jax.config import load_config
    from inkling_jax.sharding import make_mesh

    mesh = None if spec == "none" else make_mesh(spec, load_config(checkpoint).text)

    in_load = [0.0]  # seconds the load spent in the check's calls: dispatching it, then reading the flags

    class Timed(finite.FiniteCheck):
        def add(self, *args) -> None:
            start = time.perf_counter()
            super().add(*args)
            in_load[0] += time.perf_counter() - start

        def raise_if_any(self, where: str) -> None:
            start = time.perf_counter()
            super().raise_if_any(where)
            in_load[0] += time.perf_counter() - start

    class Unchecked:
        def add(self, *_) -> None:
            pass

        def raise_if_any(self, *_) -> None:
            pass

    def load(check: type) -> tuple[float, nnx.Module]:
        loader.FiniteCheck = check
        in_load[0] = 0.0
        start = time.perf_counter()
        _, model = loader.load_causal_lm(checkpoint, jnp.bfloat16, mesh)
        jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
        return time.perf_counter() - start, model

    load(Unchecked)  # the page cache warm
    first, model = load(Timed)
    first_in_load = in_load[0]
    unchecked, checked, checks = [], [], []
    for _ in range(repeats):
        unchecked.append(load(Unchecked)[0])
        checked.append(load(Timed)[0])
        checks.append(in_load[0])
    variables = loader.parameter_paths(nnx.state(model))
    alone = []
    for _ in range(repeats):
        start = time.perf_counter()
        check = finite.FiniteCheck()
        for path, variable in variables.items():
            check.add(variable[...], finite.value_kind(path, variable.dtype), path)
        check.raise_if_any("bench")
        alone.append(time.perf_counter() - start)
    checked_bytes = sum(v.nbytes for p, v in variables.items() if finite.value_kind(p, v.dtype) is not None)
    programs = {
        (finite.value_kind(p, v.dtype), tuple(v.shape), str(v.dtype), str(v[...].sharding))
        for p, v in variables.items()
        if finite.value_kind(p, v.dtype) is not None
    }
    median = lambda values: round(statistics.median(values), 3)  # noqa: E731
    return {
        "mesh": spec,
        "parameters": len(variables),
        "parameter_bytes": loader.parameter_bytes(model),
        "checked_bytes": checked_bytes,
        "check_programs": len(programs),
        "first_load_with_check_s": round(first, 3),
        "first_check_in_load_s": round(first_in_load, 3),
        "load_without_check_s": [round(t, 3) for t in unchecked],
        "load_with_check_s": [round(t, 3) for t in checked],
        "check_in_load_s": [round(t, 3) for t in checks],
        "check_alone_s": [round(t, 3) for t in alone],
        "median_load_without_check_s": median(unchecked),
        "median_load_with_check_s": median(checked),
        "median_check_in_load_s": median(checks),
        "median_check_alone_s": median(alone),
        "check_alone_gb_per_s": round(checked_bytes / statistics.median(alone) / 1e9, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", choices=("bf16", "mixed"), default="bf16")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--mesh", nargs="+", default=["none", "tp8"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_load_check"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.mesh[0], args.repeats)))
        return

    from inkling_jax.checkpoint.synthetic import write_checkpoint

    config = {**CONFIG, "num_hidden_layers": args.layers}
    checkpoint = args.work / f"{args.experts}_{args.layers}"
    if not (checkpoint / "config.json").is_file():
        args.work.mkdir(parents=True, exist_ok=True)
        (args.work / "config.json").write_text(json.dumps(config))
        write_checkpoint(args.work / "config.json", checkpoint, experts=args.experts, shard_bytes=512 << 20)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    runs = []
    for spec in args.mesh:
        command = [
            sys.executable,
            "-m",
            "bench.load_check",
            "--measure",
            str(checkpoint),
            "--mesh",
            spec,
            "--repeats",
            str(args.repeats),
        ]
        result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if result.returncode:
            raise RuntimeError(f"{spec}: {result.stderr}")
        runs.append(json.loads(result.stdout.strip().splitlines()[-1]))
        print(json.dumps(runs[-1]))
    stored = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
    record = {
        "command": " ".join(["python -m bench.load_check", *sys.argv[1:]]),
        "config": config,
        "experts": args.experts,
        "checkpoint_bytes": stored,
        "runs": runs,
    }
    if args.out:
        args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
