"""One engine step shape on a dummy model: how long it takes to come up and where a step's device time goes.

    python -m bench.step_profile [--config configs/proxy_h200.json] [--width 1] [--slots 64] [--active 1 64]
        [--repeats 5] [--options JSON [JSON ...]] [--dump DIR]

Builds the config's model with random weights on one device (`--load-format dummy`'s builder), the engine over
it with `--slots` slots, and the step of `--width` tokens per slot; prints the time to build the weights, to
lower the step (tracing and kernel lowering, in Python), to build its Mosaic GPU kernels (`kernel_builds`, as the
engine does) and to compile it (XLA); then for each `--active` count (slots with tokens, the others idle, as in a
server with that many requests) the wall time per step issued back to back, the host's time to dispatch one step
whose arguments are already on the device, on an idle device (XLA's launch of its kernels and the call's own
work; not building or sending the batch), and on a GPU the steps' timeline (`bench.timeline`: per step the span
of its kernels, the time the device was busy and idle, the kernel time by kind) and, from the same trace, the
step's kernels: their count, their sum, the kernels grouped by name, longest first, and per layer (`per_layer`: a
layer's wall time, kernels and kernel time by kind, averaged over the layers of each expert format). Copies of
parameters or state show up there as memcpy and dynamic-slice kernels.

Each `--active` count runs the program the engine picks for it (up to 8 active slots of more: the 8-token decode
program), lowered once. Each `--options` is a set of XLA options (a JSON object) that lowering is compiled with
(default: the options the engine gives the shape); each program's first step from a zeroed state is checked
against the first program's: its top log-probabilities' largest difference. `--dump` writes each program's
optimized HLO and, on a GPU, one step's kernels in launch order with their start and duration (to map kernels to
the HLO's fusions).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import re
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench.timeline import Kernel, kind_of, layout, trace_kernels
from inkling_jax.checkpoint.dummy import dummy_model
from inkling_jax.config import load_config
from inkling_jax.runtime.engine import Engine, StepShape, shape_compiler_options
from inkling_jax.runtime.requests import MAX_LOGPROBS
from inkling_jax.sharding import make_mesh

PROXY = Path(__file__).resolve().parents[1] / "configs" / "proxy_h200.json"


def _seconds(start: float) -> str:
    return f"{time.perf_counter() - start:.1f} s"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=PROXY)
    parser.add_argument("--width", type=int, default=1, help="tokens per slot in the step (1: decode)")
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--active", type=int, nargs="+", default=[1, 64], help="slots with tokens in the step")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--options", type=json.loads, nargs="+", help="XLA option sets, each a JSON object")
    parser.add_argument("--dump", type=Path, help="folder for each program's optimized HLO and kernels in order")
    args = parser.parse_args(argv)
    config = load_config(args.config)
    mesh = make_mesh("tp1", config.text)
    start = time.perf_counter()
    model = dummy_model(config, jnp.bfloat16, mesh)
    jax.block_until_ready(nnx.state(model))
    print(f"weights built on the device: {_seconds(start)}", flush=True)
    with jax.set_mesh(mesh):
        chunk = args.width if args.width > 1 else 64  # a prompt lane per slot of `width` tokens
        engine = Engine.create(
            model,
            mesh,
            max_num_seqs=args.slots,
            chunk=chunk,
            max_context=2048,
            max_num_batched_tokens=args.slots * args.width + 1,
            num_top=MAX_LOGPROBS,
        )
        table = np.arange(args.slots * engine.max_pages, dtype=np.int32).reshape(args.slots, -1)
        vocab = config.text.unpadded_vocab_size
        tokens = np.random.default_rng(0).integers(0, vocab, (args.slots, args.width), dtype=np.int32)

        def on_mesh(active: int) -> tuple[StepShape, tuple]:
            """The engine's program shape for `active` slots with tokens, and its arguments."""
            real = np.arange(args.slots) < active
            counts = np.where(real, args.width, 0).astype(np.int32)
            return engine.arguments(engine.host_batch(tokens, counts, [None] * args.slots, table, emit=real))

        by_shape: dict[StepShape, list[int]] = collections.defaultdict(list)  # the engine's program for each count
        for active in sorted(args.active):
            by_shape[on_mesh(active)[0]].append(active)
        zeroed = jax.jit(lambda state: jax.tree.map(jnp.zeros_like, state), donate_argnums=0)
        for decode, actives in by_shape.items():
            flat, shape = decode.tokens, f"step [{args.slots} slots, {decode.tokens} tokens]"
            start = time.perf_counter()
            arguments = on_mesh(actives[-1])[1]
            leaves, _, first, _, images, masks, rounds = arguments
            lowered = engine._lower(arguments, decode)
            print(f"{shape}: lowered in {_seconds(start)}", flush=True)
            if engine._kernels is not None:
                start = time.perf_counter()
                built = engine._kernels.build(lowered)
                print(f"{shape}: {built} Mosaic GPU kernels built in {_seconds(start)}", flush=True)
            first_logprobs = None
            for number, options in enumerate(args.options or [shape_compiler_options(jax.default_backend(), decode)]):
                start = time.perf_counter()
                compiled = lowered.compile(options or None)
                print(f"{shape} with {json.dumps(options)}: compiled by XLA in {_seconds(start)}", flush=True)
                engine.state = zeroed(engine.state)
                emitted, engine.state = compiled(leaves, engine.state, first, engine.previous, images, masks, rounds)
                logprobs = np.asarray(emitted.logprobs)  # the top ones are searched only where a slot asks
                if first_logprobs is None:
                    first_logprobs = logprobs
                print(
                    f"first step's log-probabilities against the first program's: largest difference "
                    f"{np.abs(logprobs - first_logprobs).max():.3g}",
                    flush=True,
                )
                name = f"{flat}_tokens_options_{number}"
                if args.dump:
                    args.dump.mkdir(parents=True, exist_ok=True)
                    (args.dump / f"{name}.hlo").write_text(compiled.as_text())
                profile(compiled, engine, on_mesh, actives, args.repeats, args.dump and args.dump / name)
                del compiled


def profile(compiled, engine: Engine, on_mesh, actives: list[int], repeats: int, dump: Path | None) -> None:
    """Wall time per step issued back to back, and the step's kernels on a GPU, for each count of active slots
    (written in launch order to `dump`_`active`_active.json when given)."""
    for active in actives:
        leaves, _, batch, _, images, masks, rounds = on_mesh(active)[1]

        # the state is donated: each step takes the last one's
        def step(leaves=leaves, batch=batch, images=images, masks=masks, rounds=rounds):
            emitted, engine.state = compiled(leaves, engine.state, batch, engine.previous, images, masks, rounds)
            return emitted

        dispatch = []
        for _ in range(5):  # the host's own cost of a step: its dispatch on an idle device
            called = time.perf_counter()
            emitted = step()
            dispatch.append(time.perf_counter() - called)
            jax.block_until_ready(emitted)
        start, steps = time.perf_counter(), 20
        for _ in range(steps):
            emitted = step()
        jax.block_until_ready(emitted)
        wall = (time.perf_counter() - start) / steps * 1e3
        print(
            f"{active} active: wall time per step, back to back: {wall:.2f} ms; a dispatch on an idle device: "
            f"{np.median(dispatch[2:]) * 1e3:.2f} ms",
            flush=True,
        )
        if jax.default_backend() == "gpu":
            kernels = traced_kernels(step, repeats)
            for line in layout(kernels, repeats).lines():
                print(f"{active} active: {line}", flush=True)
            report(kernels, repeats)
            first_run = sorted(kernels, key=lambda k: k.start_us)[: len(kernels) // repeats]
            for line in per_layer(first_run):
                print(f"{active} active: {line}", flush=True)
            if dump:
                start = first_run[0].start_us
                rows = [
                    {"name": k.name, "start_us": k.start_us - start, "duration_us": k.duration_us} for k in first_run
                ]
                Path(f"{dump}_{active}_active.json").write_text(json.dumps(rows))


def traced_kernels(step, runs: int) -> list[Kernel]:
    """The kernels of `runs` steps issued back to back under the profiler (one CUPTI session: a second one in the
    same process can abort it when its activity buffers overflow)."""
    jax.block_until_ready(step())
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            emitted = [step() for _ in range(runs)]
            jax.block_until_ready(emitted)
        return trace_kernels(Path(trace_dir))


def report(kernels: list[Kernel], runs: int) -> None:
    """The kernels' count and sum per run, and their groups by name (numbered instances together), longest first."""
    per_run = sum(k.duration_us for k in kernels) / 1e3 / runs
    print(f"kernels: {len(kernels) // runs}, {per_run:.3f} ms a step on the device", flush=True)
    groups: dict[str, list[float]] = collections.defaultdict(list)
    for kernel in kernels:
        groups[re.sub(r"[._]\d+$", "", kernel.name)].append(kernel.duration_us / 1e3 / runs)
    for name, times in sorted(groups.items(), key=lambda item: -sum(item[1]))[:30]:
        print(f"{sum(times):8.3f} ms {len(times) // runs:5d}x {name}", flush=True)


def per_layer(kernels: list[Kernel]) -> list[str]:
    """One step's kernels in launch order cut into layers at each layer's first expert kernel (gate_up's), so each
    piece holds a layer's experts and the next layer's attention: per expert format (the piece's first kernel's
    kind), the mean over its pieces of the wall time (from a piece's start to the next one's), the kernel count and
    the kernel time by kind (kernels side by side both counted). The pieces after the last layer's experts (the
    LM head, sampling) and before the first's are left out."""
    starts = [i for i, kernel in enumerate(kernels) if kernel.name.startswith("experts_") and "swiglu" in kernel.name]
    pieces: dict[str, list[tuple[float, list[Kernel]]]] = collections.defaultdict(list)
    for first, following in itertools.pairwise(starts):
        wall = kernels[following].start_us - kernels[first].start_us
        pieces[kind_of(kernels[first].name)].append((wall, kernels[first:following]))
    lines = []
    for fmt, layers in pieces.items():
        count = len(layers)
        by_kind: dict[str, float] = collections.defaultdict(float)
        for _, piece in layers:
            for kernel in piece:
                by_kind[kind_of(kernel.name)] += kernel.duration_us / count
        wall = sum(w for w, _ in layers) / count
        kernel_count = sum(len(piece) for _, piece in layers) / count
        kinds = ", ".join(f"{kind} {us:.1f}" for kind, us in sorted(by_kind.items(), key=lambda item: -item[1]))
        lines.append(f"per layer, {fmt} ({count}): wall {wall:.1f} us, {kernel_count:.1f} kernels; us by kind: {kinds}")
    return lines


if __name__ == "__main__":
    main()
