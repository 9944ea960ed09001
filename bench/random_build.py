"""Time a random build (`--load-format dummy`) of a config: tracing and lowering, each program's compile, the run.

    python -m bench.random_build --config configs/proxy_h200.json [--mesh tp1] [--compile-only] [--single-program]
        [--out FILE.json]

`--compile-only` stops before running anything (the proxy's 30 GiB of weights need not fit the machine).
`--single-program` measures the whole constructor under one jit instead (what `random_model` did before it was
split into programs per layer signature), compiled but never run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from inkling_jax.checkpoint import dummy
from inkling_jax.checkpoint.quantized import configured_expert_formats
from inkling_jax.config import load_config
from inkling_jax.model.text import CausalLM
from inkling_jax.sharding import make_mesh, parameter_shardings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--mesh", default="tp1")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--single-program", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    config = load_config(args.config)
    formats = configured_expert_formats(str(args.config), config.quantization, config.text.num_hidden_layers)
    mesh, dtype = make_mesh(args.mesh, config.text), jnp.dtype(args.dtype)
    result: dict = {"config": str(args.config), "mesh": args.mesh, "device": jax.devices()[0].device_kind}

    start = time.perf_counter()
    if args.single_program:

        def make() -> CausalLM:
            return CausalLM(config.text, dtype, nnx.Rngs(0), formats, config.draft)

        shardings = parameter_shardings(nnx.eval_shape(make), mesh)
        programs = {("model",): jax.jit(lambda: nnx.split(make())[1], out_shardings=shardings).lower()}
    else:
        programs = dummy.plan_build(config, dtype, mesh, formats).programs
    result["trace_and_lower_s"] = round(time.perf_counter() - start, 2)
    compiles = {}
    for name, lowered in programs.items():
        start = time.perf_counter()
        lowered.compile()
        compiles[" ".join(map(str, name))] = round(time.perf_counter() - start, 2)
    result["compile_s"] = compiles
    result["compile_total_s"] = round(sum(compiles.values()), 2)
    if not (args.compile_only or args.single_program):
        start = time.perf_counter()
        jax.block_until_ready(nnx.state(dummy.random_model(config, dtype, mesh, formats)))
        result["build_s"] = round(time.perf_counter() - start, 2)  # from the start again: tracing, compile, run
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
