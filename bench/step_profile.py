"""One engine step shape on a dummy model: how long it takes to come up and where a step's device time goes.

    python -m bench.step_profile [--config configs/proxy_h200.json] [--width 1] [--slots 8] [--repeats 5]

Builds the config's model with random weights on one device (`--load-format dummy`'s builder), the engine over
it, and the step of `--width` tokens per slot for `--slots` slots; prints the time to build the weights, to
lower the step (tracing and kernel lowering, in Python) and to compile it (XLA), the wall time per step issued
back to back, then the step's kernels by CUPTI (on a GPU): their count, their sum, and the kernels grouped by
name, longest first. Copies of parameters or state show up there as memcpy and dynamic-slice kernels.
"""

from __future__ import annotations

import argparse
import collections
import functools
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.timing import kernels_ms
from inkling_jax.checkpoint.dummy import dummy_model
from inkling_jax.config import load_config
from inkling_jax.runtime.engine import Engine, host_batch
from inkling_jax.sharding import make_mesh
from inkling_jax.step import step_fn

PROXY = Path(__file__).resolve().parents[1] / "configs" / "proxy_h200.json"


def _seconds(start: float) -> str:
    return f"{time.perf_counter() - start:.1f} s"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=PROXY)
    parser.add_argument("--width", type=int, default=1, help="tokens per slot in the step (1: decode)")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    config = load_config(args.config)
    mesh = make_mesh("tp1", config.text)
    start = time.perf_counter()
    model = dummy_model(config, jnp.bfloat16, mesh)
    jax.block_until_ready(nnx.state(model))
    print(f"weights built on the device: {_seconds(start)}", flush=True)
    with jax.set_mesh(mesh):
        engine = Engine.create(model, mesh, max_num_seqs=args.slots, chunk=max(64, args.width), max_context=2048)
        every = np.ones(args.slots, bool)
        table = np.arange(args.slots * engine.max_pages, dtype=np.int32).reshape(args.slots, -1)
        tokens = np.zeros((args.slots, args.width), np.int32)
        batch = host_batch(tokens, np.full(args.slots, args.width, np.int32), [None] * args.slots, table, emit=every)
        on_mesh = jax.tree.map(lambda h: jax.make_array_from_callback(h.shape, engine.by_slot, lambda i: h[i]), batch)
        start = time.perf_counter()
        lowered = engine._step.lower(engine.params, engine.state, on_mesh, engine.previous, speculative=False)
        print(f"step [{args.slots}, {args.width}]: lowered in {_seconds(start)}", flush=True)
        start = time.perf_counter()
        compiled = lowered.compile()
        print(f"step [{args.slots}, {args.width}]: compiled by XLA in {_seconds(start)}", flush=True)
        state = engine.state
        for _ in range(3):
            emitted, state = compiled(engine.params, state, on_mesh, engine.previous)
        jax.block_until_ready(emitted)
        start, steps = time.perf_counter(), 20
        for _ in range(steps):
            emitted, state = compiled(engine.params, state, on_mesh, engine.previous)
        jax.block_until_ready(emitted)
        print(f"wall time per step, back to back: {(time.perf_counter() - start) / steps * 1e3:.2f} ms", flush=True)
        if jax.default_backend() != "gpu":
            return
        repeatable = jax.jit(functools.partial(step_fn, engine.graphdef))  # no donation: the same state each run
        kernels = kernels_ms(repeatable, engine.params, state, on_mesh, engine.previous, repeats=args.repeats)
    print(f"kernels: {len(kernels)}, {sum(ms for _, ms in kernels):.3f} ms a step on the device", flush=True)
    groups: dict[str, list[float]] = collections.defaultdict(list)
    for name, ms in kernels:
        groups[re.sub(r"[._]\d+$", "", name)].append(ms)
    for name, times in sorted(groups.items(), key=lambda item: -sum(item[1]))[:30]:
        print(f"{sum(times):8.3f} ms {len(times):5d}x {name}", flush=True)


if __name__ == "__main__":
    main()
