"""The engine's step programs as XLA compiles them for an H200, on a machine without a GPU: the kernels each step
launches, by kind, for counting and fusing them (a decode step's kernels per layer) without device time.

    JAX_PLATFORMS=cpu python -m bench.step_kernels [--config configs/proxy_h200.json] [--slots 64] [--out DIR]

Needs JAX's CUDA plugin (`pip install -e '.[gpu-aot]'`), which compiles for `bench.moe_gpu_hlo.H200_TARGET` with no
device. The model stays abstract (nothing is allocated); the process presents itself to the kernels' selection as an
sm90 GPU (`jax.default_backend`, `devices.on_hopper`), so every op takes the backend it takes on an H200 and the
Mosaic GPU kernels are lowered into the program. Each step shape is compiled with the engine's options for it. Not
the H200's program in every detail (`bench.moe_gpu_hlo` says where). Kernels are counted as a run launches them
(`kernel_kinds`: the layers' scan once per layer). `--out` keeps each program's optimized HLO.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import re
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from bench.moe_gpu_hlo import H200_TARGET, computations
from inkling_jax.cache import CacheLayout, init_state
from inkling_jax.checkpoint.quantized import configured_expert_formats
from inkling_jax.config import ModelConfig, load_config
from inkling_jax.model.attention import fuse_attention_projections
from inkling_jax.model.moe import lay_out_experts
from inkling_jax.model.text import CausalLM
from inkling_jax.runtime import engine as engines
from inkling_jax.runtime.requests import MAX_LOGPROBS
from inkling_jax.sharding import DATA, MODEL, parameter_shardings, state_shardings
from pallas_kernels import devices

PROXY = Path(__file__).resolve().parent.parent / "configs" / "proxy_h200.json"


def abstract_model(config: ModelConfig) -> nnx.Module:
    """The text model as the engine holds it on an H200 (experts in the GPU kernels' layout, attention projections
    fused), shapes only."""

    def build() -> nnx.Module:
        formats = configured_expert_formats("config", config.quantization, config.text.num_hidden_layers)
        model = CausalLM(config.text, jnp.bfloat16, nnx.Rngs(0), expert_formats=formats)
        lay_out_experts(model, "gpu")
        return fuse_attention_projections(model)

    return nnx.eval_shape(build)


def shape_planner(slots: int, chunk: int, pages: int) -> engines.Engine:
    """An Engine's planning of step shapes and batch layouts (one replica, no speculation) without its model or
    device state: the attributes `Engine.shapes`, `idle_batch` and `_layout` read."""
    planner = object.__new__(engines.Engine)
    planner.replicas, planner.slots, planner.slots_per_replica, planner.max_pages = 1, slots, slots, pages
    planner.gamma, planner.chunk, planner.speculative = 0, chunk, False
    planner.max_num_batched_tokens = engines.batched_tokens(None, slots, 0, chunk)
    planner.lane_width = min(engines.LANE, chunk)
    planner.lanes = -(-planner.max_num_batched_tokens // planner.lane_width)
    planner._layouts = {}
    return planner


KERNEL = re.compile(r"^\s+(?:ROOT )?%(?P<name>[\w.-]+) = \S.*? (?P<op>fusion|custom-call|copy|sort)\(")
LOOP = re.compile(r" while\(.*condition=%(?P<condition>[\w.-]+), body=%(?P<body>[\w.-]+).*\"n\":\"(?P<trips>\d+)\"")
BRANCHES = re.compile(
    r" conditional\(.*?(?:true_computation=%(?P<true>[\w.-]+), false_computation=%(?P<false>[\w.-]+)"
    r"|branch_computations=\{(?P<branches>[^}]+)\})"
)


def kernel_kinds(hlo: str) -> collections.Counter:
    """The kernels one run of the program launches, by kind (a fusion's kind as XLA names it, its name less the
    numbering; a custom call's target: Mosaic GPU kernels and cuBLAS gemms; or the operation): those of the entry
    computation, a loop's body and condition as many times as its known trip count (the layers' scan), and of a
    conditional the branch that launches the most."""
    bodies = computations(hlo)

    def launched(name: str) -> collections.Counter:
        kinds = collections.Counter()
        for line in bodies[name].splitlines():
            if kernel := KERNEL.match(line):
                kind = re.sub(r"[.\d]+$", "", kernel.group("name"))
                kinds[kind if kernel.group("op") == "fusion" else f"{kernel.group('op')} {kind}"] += 1
            elif loop := LOOP.search(line):
                for _ in range(int(loop.group("trips"))):
                    kinds += launched(loop.group("body")) + launched(loop.group("condition"))
            elif branch := BRANCHES.search(line):
                names = (
                    [branch.group("true"), branch.group("false")]
                    if branch.group("true")
                    else [name.strip().lstrip("%") for name in branch.group("branches").split(",")]
                )
                kinds += max((launched(name) for name in names), key=lambda counts: sum(counts.values()))
        return kinds

    return launched("ENTRY")


def as_gpu() -> contextlib.AbstractContextManager:
    """The process seen by the kernels' selection as an sm90 GPU."""
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(jax, "default_backend", lambda: "gpu"))
    stack.enter_context(mock.patch.object(devices, "on_hopper", lambda: True))
    return stack


def step_programs(config: ModelConfig, mesh: Mesh, slots: int, chunk: int, context: int) -> Iterator[tuple]:
    """(step shape, its optimized HLO) for every shape an engine of `slots` slots and `chunk`-token chunks runs,
    compiled for `mesh`'s device (call `as_gpu` first)."""
    text, replicated, by_slot = config.text, NamedSharding(mesh, P()), NamedSharding(mesh, P(DATA))

    def placed(x: jax.ShapeDtypeStruct, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    model = abstract_model(config)
    graphdef, params = nnx.split(model)
    leaves, tree = jax.tree.flatten(params)
    param_shardings = jax.tree.leaves(parameter_shardings(model, mesh), is_leaf=lambda x: isinstance(x, NamedSharding))
    pages = engines.pages_for(context)
    state = jax.eval_shape(
        functools.partial(init_state, text, CacheLayout(slots, slots * pages, pages, chunk), jnp.bfloat16, 1, None)
    )
    shardings = state_shardings(state, text, mesh)
    planner = shape_planner(slots, chunk, pages)
    options = {"num_top": MAX_LOGPROBS, "greedy_draft": False, "lane_width": planner.lane_width}
    step = jax.jit(
        functools.partial(engines._flat_step, graphdef, tree, **options),
        static_argnames=("speculative", "width", "layout", "rounds_layout"),
        donate_argnames="state",
        out_shardings=(replicated, shardings),
    )
    for shape in planner.shapes:
        batch_layout = planner._layout(shape)
        packed = batch_layout.pack(planner.idle_batch(shape))
        arguments = (
            [placed(x, s) for x, s in zip(leaves, param_shardings, strict=True)],
            jax.tree.map(placed, state, shardings),
            jax.ShapeDtypeStruct(packed.shape, packed.dtype, sharding=by_slot),
            jax.ShapeDtypeStruct((slots,), jnp.int32, sharding=replicated),
            jax.ShapeDtypeStruct((1, text.hidden_size), jnp.bfloat16, sharding=replicated),
            jax.ShapeDtypeStruct((slots, -(-text.unpadded_vocab_size // 32)), jnp.int32, sharding=by_slot),
            None,  # no draft: no constrained rounds
        )
        static = {"speculative": shape.speculative, "width": shape.width, "layout": batch_layout, "rounds_layout": None}
        with jax.set_mesh(mesh):
            lowered = step.trace(*arguments, **static).lower()
        yield shape, lowered.compile(engines.shape_compiler_options("gpu", shape)).as_text()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=PROXY)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=H200_TARGET, topology="1x1x1")
    except (RuntimeError, ValueError) as error:
        plugin = "JAX's CUDA plugin (pip install -e '.[gpu-aot]')"
        raise SystemExit(f"compiling for a GPU without one needs {plugin}: {error}") from error
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    config = load_config(args.config)
    layers = config.text.num_hidden_layers
    mesh = Mesh(np.asarray(topology.devices[:1]).reshape(1, 1), (DATA, MODEL))
    start = time.perf_counter()
    with as_gpu():
        for shape, hlo in step_programs(config, mesh, args.slots, args.chunk, args.context):
            kinds = kernel_kinds(hlo)
            total = sum(kinds.values())
            seconds = time.perf_counter() - start
            print(f"== step [{shape}]: {total} kernels, {total / layers:.1f} a layer (compiled at {seconds:.0f} s)")
            for kind, count in kinds.most_common():
                print(f"   {count:5d}  {count / layers:5.2f} a layer  {kind}")
            if args.out:
                (args.out / f"{shape.label}.hlo").write_text(hlo)


if __name__ == "__main__":
    main()
