"""Build random Inkling 2 layers with quantized experts directly on device (no file in between).

    python -m bench.build_on_device --layers 6 --experts mxfp8 [--config configs/inkling2_small.json] [--out FILE.json]

Uses the full config's widths with `--layers` layers (the 5:1 pattern from layer 0), builds the
parameters under jit (experts quantized one expert at a time), and reports build time and the bytes on
device against the same model with bf16 experts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from inkling_jax.checkpoint.loader import abstract_causal_lm, parameter_bytes
from inkling_jax.checkpoint.synthetic import expert_formats
from inkling_jax.config import load_config
from inkling_jax.model.text import CausalLM

FULL_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "inkling2_small.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=FULL_CONFIG)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--experts", choices=("mxfp8", "mixed"), default="mxfp8")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    config = load_config(args.config)
    text = dataclasses.replace(
        config.text, num_hidden_layers=args.layers, layer_types=config.text.layer_types[: args.layers]
    )
    config = dataclasses.replace(config, text=text)
    formats = expert_formats(config, args.experts, None)

    def build() -> CausalLM:
        return CausalLM(text, jnp.bfloat16, nnx.Rngs(0), formats)

    graphdef, _ = nnx.split(nnx.eval_shape(build))
    start = time.perf_counter()
    state = jax.jit(lambda: nnx.split(build())[1])()
    jax.block_until_ready(state)
    build_s = time.perf_counter() - start
    model = nnx.merge(graphdef, state)
    plain = sum(
        v.size * v.dtype.itemsize for v in jax.tree.leaves(nnx.split(abstract_causal_lm(config, jnp.bfloat16))[1])
    )
    result = {
        "device": str(jax.devices()[0].device_kind),
        "layers": args.layers,
        "experts": args.experts,
        "build_s": round(build_s, 2),
        "device_bytes": parameter_bytes(model),
        "bf16_experts_bytes": plain,
        "peak_bytes_in_use": (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use"),
    }
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
