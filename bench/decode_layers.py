"""Decode steps of a full-width slice of Inkling 2 Small through the engine, on one device or tensor parallel
over several: time per layer against the bytes each device must read for it.

    python -m bench.decode_layers [--layers 6 3] [--batch 1 64] [--context 1024] [--experts mxfp8]
        [--mesh tp1] [--repeats 10] [--config FILE] [--out FILE.json]

Each slice (`--layers` layers of the full config's widths, its 5:1 layer pattern from layer 0, all 384 experts
stored as `--experts`) is built directly on the devices, each parameter in the shards `--mesh` gives it (a
tpN mesh: heads, experts and the vocabulary split N ways); the engine lays the experts out for the platform's
kernels. Every slot gets a `--context`-token random prompt (prefill chunks of 64), then plain greedy decode
steps (one token per slot) are timed (`bench.timing.device_ms`: CUPTI's kernels on one GPU; the wall clock of
back-to-back steps on several, whose collectives the time then includes), median of `repeats`.
The time per layer is the difference between two slices' step times over their difference in layers (the
embedding, final norm, LM head and sampling cancel out), and so are the bytes a device must read for a layer:
its shards of the attention, router and norm parameters, of the KV its queries see, and of the distinct experts
the batch is routed to, counted at the number expected under uniform routing, E * (1 - (1 - k / E)^B) (the
expert bench's random routing). The whole model's step (all the config's layers) is estimated from the two
slices, and from it the decode tokens/s per device.
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
from jax.sharding import Mesh

from bench.e2e import prefill_random
from bench.timing import device_ms
from inkling_jax.cache import kv_bytes_per_token
from inkling_jax.checkpoint.dummy import random_model
from inkling_jax.checkpoint.synthetic import expert_formats
from inkling_jax.config import load_config
from inkling_jax.model.text import CausalLM
from inkling_jax.runtime.engine import Engine
from inkling_jax.sharding import DATA, MODEL, make_mesh
from inkling_jax.step import step_fn

FULL_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "inkling2_small.json"
CHUNK = 64
COPY_TB_S = 4.3


def build(config, layers: int, experts: str, mesh: Mesh) -> CausalLM:
    """A random slice of `layers` layers, built under jit directly into its shards on `mesh`."""
    text = dataclasses.replace(config.text, num_hidden_layers=layers, layer_types=config.text.layer_types[:layers])
    config = dataclasses.replace(config, text=text, draft=None)
    return random_model(config, jnp.bfloat16, mesh, expert_formats(config, experts, None))


def shard_bytes(module: nnx.Module) -> int:
    """The bytes of `module`'s parameters one device holds (every device holds the same)."""
    return sum(leaf.addressable_shards[0].data.nbytes for leaf in jax.tree.leaves(nnx.state(module)))


def slice_bytes(model: CausalLM, batch: int, context: int, tp: int) -> dict[str, float]:
    """Per device: the slice's layers' non-expert parameter bytes, expected distinct experts' bytes and KV
    bytes (bf16, the heads one device's cache keeps)."""
    text = model.config
    layers = text.num_hidden_layers
    total = shard_bytes(model.model.segments)
    expert_total = sum(shard_bytes(place.mlp.experts) for stack in model.model.segments for place in stack.positions)
    experts, top_k = text.n_routed_experts, text.num_experts_per_tok
    distinct = experts * (1 - (1 - top_k / experts) ** batch)
    kv = 0
    for layer in range(layers):
        sliding = text.is_sliding(layer)
        keys = min(context, text.sliding_window_size) if sliding else context
        kv += batch * keys * kv_bytes_per_token(text, sliding, jnp.bfloat16, tp)
    return {
        "other_params": total - expert_total,
        "experts": expert_total * distinct / experts,
        "kv": kv,
        "distinct_experts": distinct,
    }


def step_ms(model: CausalLM, mesh: Mesh, batch: int, context: int, repeats: int) -> float:
    """Device time of one decode step for `batch` slots after `context`-token prompts."""
    engine = Engine.create(model, mesh, max_num_seqs=batch, chunk=CHUNK, max_context=context + 4 * repeats + 64)
    slots = engine.slots
    table = np.arange(slots * engine.max_pages, dtype=np.int32).reshape(slots, engine.max_pages)
    everyone, idle = np.ones(slots, bool), [None] * slots
    prefill_random(engine, everyone, context, table, idle, np.random.default_rng(0))
    decode = engine.host_batch(
        np.zeros((slots, 1), np.int32), np.ones(slots, np.int32), idle, table, feedback=everyone, emit=everyone
    )
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
    parser.add_argument("--mesh", default="tp1", help="tpN: tensor parallel over N devices")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--config", type=Path, default=FULL_CONFIG)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    config = load_config(args.config)
    mesh = make_mesh(args.mesh, config.text)
    if mesh.shape[DATA] > 1:
        parser.error(f"--mesh {args.mesh}: decode is measured per replica, so the mesh is tpN")
    tp = mesh.shape[MODEL]
    more, fewer = sorted(args.layers, reverse=True)
    if more == fewer:
        parser.error(f"--layers {more} {fewer}: the two slices need different layer counts")
    times, sizes = {}, {}
    for layers in (more, fewer):
        model = build(config, layers, args.experts, mesh)
        for batch in args.batch:
            times[layers, batch] = step_ms(model, mesh, batch, args.context, args.repeats)
            sizes[layers, batch] = slice_bytes(model, batch, args.context, tp)
            print(f"{layers} layers, batch {batch}: {times[layers, batch]:.3f} ms a step", file=sys.stderr, flush=True)
        del model
    rows = []
    for batch in args.batch:
        per_layer_ms = (times[more, batch] - times[fewer, batch]) / (more - fewer)
        size = {k: (sizes[more, batch][k] - sizes[fewer, batch][k]) / (more - fewer) for k in sizes[more, batch]}
        must_read = size["other_params"] + size["experts"] + size["kv"]
        model_step_ms = times[fewer, batch] + (config.text.num_hidden_layers - fewer) * per_layer_ms
        rows.append(
            {
                "batch": batch,
                "step_ms": {str(n): times[n, batch] for n in (more, fewer)},
                "per_layer_ms": per_layer_ms,
                "distinct_experts": sizes[more, batch]["distinct_experts"],
                "bytes_per_layer_per_device": must_read,
                "expert_bytes_per_layer_per_device": size["experts"],
                "pct_of_copy": 100 * must_read / per_layer_ms / 1e9 / COPY_TB_S,
                "model_step_ms_estimate": model_step_ms,
                "tokens_per_s_per_device": batch / model_step_ms * 1e3 / tp,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    report = {
        "command": "python -m bench.decode_layers " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": jax.devices()[0].device_kind,
        "devices": tp,
        "context": args.context,
        "experts": args.experts,
        "rows": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
