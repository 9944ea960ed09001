"""Decode steps of a full-width slice of Inkling 2 Small on one device, through the engine: time per layer
against the bytes a layer must read.

    python -m bench.decode_layers [--layers 6 3] [--batch 1 64] [--context 1024] [--experts mxfp8]
        [--repeats 10] [--config FILE] [--out FILE.json]

Each slice (`--layers` layers of the full config's widths, its 5:1 layer pattern from layer 0, all 384 experts
stored as `--experts`) is built directly on device; the engine lays the experts out for the platform's kernels.
Every slot gets a `--context`-token random prompt (prefill chunks of 64), then plain greedy decode steps (one
token per slot) are timed: device time of the whole step (CUPTI on GPU, every kernel), median of `repeats`.
The time per layer is the difference between two slices' step times over their difference in layers (the
embedding, final norm, LM head and sampling cancel out), and so are the bytes a layer must read: its attention,
router and norm parameters, the KV its queries see, and the distinct experts the batch is routed to, counted at
the number expected under uniform routing, E * (1 - (1 - k / E)^B) (the expert bench's random routing).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.timing import device_ms
from inkling_jax.checkpoint.synthetic import expert_formats
from inkling_jax.config import load_config
from inkling_jax.engine import Engine, host_batch
from inkling_jax.model.text import CausalLM
from inkling_jax.sharding import make_mesh
from inkling_jax.step import step_fn

FULL_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "inkling2_small.json"
CHUNK = 64
COPY_TB_S = 4.3


def build(config, layers: int, experts: str) -> CausalLM:
    """A random slice of `layers` layers, built under jit on the default device."""
    text = dataclasses.replace(config.text, num_hidden_layers=layers, layer_types=config.text.layer_types[:layers])
    config = dataclasses.replace(config, text=text)
    formats = expert_formats(config, experts, None)

    def make() -> CausalLM:
        return CausalLM(text, jnp.bfloat16, nnx.Rngs(0), formats)

    graphdef, _ = nnx.split(nnx.eval_shape(make))
    return nnx.merge(graphdef, jax.jit(lambda: nnx.split(make())[1])())


def slice_bytes(model: CausalLM, batch: int, context: int) -> dict[str, float]:
    """The slice's layers' non-expert parameter bytes, expected distinct experts' bytes and KV bytes."""
    text = model.config
    layers = text.num_hidden_layers
    _, params = nnx.split(model.model.layers)
    total = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(params))
    expert_total = sum(
        leaf.size * leaf.dtype.itemsize
        for layer in model.model.layers
        for leaf in jax.tree.leaves(nnx.split(layer.mlp.experts)[1])
    )
    experts, top_k = text.n_routed_experts, text.num_experts_per_tok
    distinct = experts * (1 - (1 - top_k / experts) ** batch)
    kv = 0
    for layer in range(layers):
        _, kv_heads, dim = text.attention_dims(layer)
        keys = min(context, text.sliding_window_size) if text.is_sliding(layer) else context
        kv += 2 * batch * keys * kv_heads * dim * 2  # K and V, bf16
    return {"other_params": total - expert_total, "experts": expert_total * distinct / experts, "kv": kv,
            "distinct_experts": distinct}  # fmt: skip


def step_ms(model: CausalLM, batch: int, context: int, repeats: int) -> float:
    """Device time of one decode step for `batch` slots after `context`-token prompts."""
    engine = Engine.create(
        model, make_mesh("tp1", model.config), max_num_seqs=batch, chunk=CHUNK, max_context=context + 4 * repeats + 64
    )
    slots, rng = engine.slots, np.random.default_rng(0)
    table = np.arange(slots * engine.max_pages, dtype=np.int32).reshape(slots, engine.max_pages)
    everyone, idle = np.ones(slots, bool), [None] * slots
    for start in range(0, context, CHUNK):
        count = min(CHUNK, context - start)
        tokens = rng.integers(0, model.config.unpadded_vocab_size, (slots, CHUNK)).astype(np.int32)
        counts = np.full(slots, count, np.int32)
        first, last = start == 0, start + CHUNK >= context
        engine.fetch(engine.step(host_batch(tokens, counts, idle, table, reset=everyone if first else None,
                                            is_prompt=everyone, emit=everyone if last else None)))  # fmt: skip
    decode = host_batch(np.zeros((slots, 1), np.int32), np.ones(slots, np.int32), idle, table, feedback=everyone,
                        emit=everyone)  # fmt: skip
    on_mesh = jax.tree.map(
        lambda host: jax.make_array_from_callback(host.shape, engine.by_slot, lambda i: host[i]), decode
    )
    step = jax.jit(functools.partial(step_fn, engine.graphdef))  # the engine's step without donation: repeatable
    with jax.set_mesh(engine.mesh):
        return device_ms(step, engine.params, engine.state, on_mesh, engine.previous, repeats=repeats)[0]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs=2, default=[6, 3])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--experts", default="mxfp8", choices=("mxfp8", "mixed"))  # bf16: 147 GB for 6
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--config", type=Path, default=FULL_CONFIG)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    config = load_config(args.config)
    times, sizes = {}, {}
    for layers in args.layers:
        model = build(config, layers, args.experts)
        for batch in args.batch:
            times[layers, batch] = step_ms(model, batch, args.context, args.repeats)
            sizes[layers, batch] = slice_bytes(model, batch, args.context)
            print(f"{layers} layers, batch {batch}: {times[layers, batch]:.3f} ms a step", file=sys.stderr, flush=True)
        del model
    more, fewer = max(args.layers), min(args.layers)
    rows = []
    for batch in args.batch:
        per_layer_ms = (times[more, batch] - times[fewer, batch]) / (more - fewer)
        size = {k: (sizes[more, batch][k] - sizes[fewer, batch][k]) / (more - fewer) for k in sizes[more, batch]}
        must_read = size["other_params"] + size["experts"] + size["kv"]
        rows.append({
            "batch": batch, "step_ms": {str(n): times[n, batch] for n in args.layers},
            "per_layer_ms": per_layer_ms, "distinct_experts": sizes[more, batch]["distinct_experts"],
            "bytes_per_layer": must_read, "expert_bytes_per_layer": size["experts"],
            "pct_of_copy": 100 * must_read / per_layer_ms / 1e9 / COPY_TB_S,
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    report = {
        "command": "python -m bench.decode_layers " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": jax.devices()[0].device_kind, "context": args.context, "experts": args.experts, "rows": rows,
    }  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
