"""Baseline: whole-sequence forward of the pure-jnp model at full Inkling 2 Small width.

Builds the full config with fewer layers (random bf16 weights made on the device: the whole model does
not fit one GPU), runs one prefill of T tokens and reports the median time and the time per layer. It
measures the reference path that the kernels will replace; nothing asserts on speed.

    python -m bench.forward_reference --layer-types hybrid_sliding,hybrid --tokens 2048 [--out FILE.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from inkling_jax.config import load_config
from inkling_jax.forward import logits_fn
from inkling_jax.model.text import CausalLM

FULL_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "inkling2_small.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layer-types", default="hybrid_sliding,hybrid", help="comma-separated layer kinds")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    text = load_config(FULL_CONFIG).text
    layer_types = tuple(args.layer_types.split(","))
    text = dataclasses.replace(text, num_hidden_layers=len(layer_types), layer_types=layer_types)
    build = lambda: CausalLM(text, jnp.bfloat16, nnx.Rngs(0))  # noqa: E731
    graphdef, _ = nnx.split(nnx.eval_shape(build))
    state = jax.jit(lambda: nnx.split(build())[1])()
    forward = logits_fn(nnx.merge(graphdef, state))
    ids = jax.random.randint(jax.random.key(1), (1, args.tokens), 0, text.unpadded_vocab_size)

    start = time.perf_counter()
    logits = jax.block_until_ready(forward(ids))
    compile_and_first = time.perf_counter() - start
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        jax.block_until_ready(forward(ids))
        times.append(time.perf_counter() - start)
    median = float(np.median(times))
    result = {
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "layer_types": list(layer_types),
        "tokens": args.tokens,
        "finite": bool(jnp.isfinite(logits).all()),
        "compile_and_first_s": round(compile_and_first, 3),
        "median_s": round(median, 4),
        "ms_per_layer": round(1e3 * median / len(layer_types), 3),
        "tokens_per_s": round(args.tokens / median, 1),
    }
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
