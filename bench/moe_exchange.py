"""Expert-parallel token exchange: reduce-scatter + all-gather (what the model uses) vs. all-to-all.

    python -m bench.moe_exchange [--tokens 64 1024] [--tp 4 8] [--repeats 5] [--hidden 1024 --inner 256
        --experts 64] [--out FILE.json]

Both run one MoE layer's routed experts with the experts split over the mesh's `model` axis and the
tokens replicated on every device (the residual stream is replicated within a TP group):

- reduce-scatter (`inkling_jax.model.moe.expert_parallel`): every device runs its own experts on all
  the token copies routed to them, the fp32 partial sums are reduce-scattered over tokens, rounded
  once and all-gathered.
- all-to-all: device d takes tokens [d N/tp, (d+1) N/tp), sends each token copy to its expert's
  device (fixed-capacity buffers of N/tp * k rows per destination, so no copy is ever dropped),
  receives fp32 expert outputs back, combines them and all-gathers.

Reported per configuration: the time of one jitted call (median of `repeats`), the bytes each device
sends through collectives (from the compiled HLO's collective operand shapes) and whether the two
agree with the unsharded op. Needs `XLA_FLAGS=--xla_force_host_platform_device_count=8` on CPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.lib.mlir import ir
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from inkling_jax.model.moe import expert_parallel
from inkling_jax.sharding import MODEL
from pallas_kernels.moe import moe_experts
from pallas_kernels.numerics import round_to

TOP_K = 8
CAPS = {"gate_cap": 30.0, "up_cap": 30.0}


def all_to_all_exchange(run, mesh: Mesh, x, gate_up, down, experts, weights) -> jax.Array:
    """The same op as `expert_parallel`, exchanging token copies with two all-to-alls."""
    tp, (tokens, top_k) = mesh.shape[MODEL], experts.shape
    share = tokens // tp
    capacity = share * top_k  # a device's whole share could route to one destination

    def local(x, gate_up, down, experts, weights):
        per_device = gate_up.shape[0]
        me = jax.lax.axis_index(MODEL)
        mine = jax.lax.dynamic_slice_in_dim(x, me * share, share)  # [share, H]
        ids = jax.lax.dynamic_slice_in_dim(experts, me * share, share).reshape(-1)  # [share * k]
        destination = ids // per_device
        order = jnp.argsort(destination)
        start = jnp.searchsorted(destination[order], jnp.arange(tp))
        slot = jnp.arange(capacity) - start[destination[order]]  # position within its destination's buffer
        send_rows = (
            jnp.zeros((tp, capacity, x.shape[1]), x.dtype).at[destination[order], slot].set(mine[order // top_k])
        )
        send_ids = jnp.full((tp, capacity), -1, jnp.int32).at[destination[order], slot].set(ids[order] % per_device)
        rows = jax.lax.all_to_all(send_rows, MODEL, 0, 0, tiled=True).reshape(-1, x.shape[1])
        local_ids = jax.lax.all_to_all(send_ids, MODEL, 0, 0, tiled=True).reshape(-1, 1)
        out = run(rows, gate_up, down, local_ids, jnp.ones(local_ids.shape, jnp.float32), out_dtype=jnp.float32)
        back = jax.lax.all_to_all(out.reshape(tp, capacity, -1), MODEL, 0, 0, tiled=True)
        copies = back[destination[order], slot]  # [share * k, H] fp32, in `order`
        scale = jax.lax.dynamic_slice_in_dim(weights, me * share, share).reshape(-1)[order]
        combined = jnp.zeros((share, x.shape[1]), jnp.float32).at[order // top_k].add(copies * scale[:, None])
        return jax.lax.all_gather(round_to(combined, x.dtype), MODEL, axis=0, tiled=True)

    return jax.shard_map(
        local, mesh=mesh, in_specs=(P(), P(MODEL), P(MODEL), P(), P()), out_specs=P(), check_vma=False
    )(x, gate_up, down, experts, weights)


_COLLECTIVES = ("stablehlo.all_gather", "stablehlo.reduce_scatter", "stablehlo.all_to_all")
_TENSOR = re.compile(r"tensor<((?:\d+x)*)(bf16|f32|i32)>")
_ITEM_BYTES = {"bf16": 2, "f32": 4, "i32": 4}


def tensor_bytes(mlir_type: object) -> int:
    dims, dtype = _TENSOR.fullmatch(str(mlir_type)).groups()
    return _ITEM_BYTES[dtype] * int(np.prod([int(d) for d in dims.split("x") if d]))


def collective_bytes(lowered: jax.stages.Lowered, tp: int) -> dict[str, int]:
    """Bytes each device sends per collective, from the program's own types (XLA:CPU widens bf16
    collectives to f32, accelerators do not): (tp - 1) / tp of each collective's full buffer."""
    sent: dict[str, int] = {}

    def count(op: ir.Operation) -> ir.WalkResult:
        if op.name in _COLLECTIVES:
            full = max(tensor_bytes(value.type) for value in (*op.operands, *op.results))
            kind = op.name.removeprefix("stablehlo.")
            sent[kind] = sent.get(kind, 0) + full * (tp - 1) // tp
        return ir.WalkResult.ADVANCE

    lowered.compiler_ir("stablehlo").operation.walk(count)
    return sent


def measure(tokens: int, tp: int, repeats: int, hidden: int, inner: int, experts: int) -> dict:
    mesh = Mesh(np.asarray(jax.devices()[:tp]), (MODEL,))
    keys = jax.random.split(jax.random.key(tokens * 10 + tp), 5)
    x = jax.random.normal(keys[0], (tokens, hidden), jnp.bfloat16)
    gate_up = (jax.random.normal(keys[1], (experts, 2 * inner, hidden)) * 0.03).astype(jnp.bfloat16)
    down = (jax.random.normal(keys[2], (experts, hidden, inner)) * 0.03).astype(jnp.bfloat16)
    _, experts = jax.lax.top_k(jax.random.normal(keys[3], (tokens, experts)), TOP_K)
    weights = jax.nn.softmax(jax.random.normal(keys[4], (tokens, TOP_K)))
    run = functools.partial(moe_experts, **CAPS)
    want = np.asarray(run(x, gate_up, down, experts, weights).astype(jnp.float32))
    on_experts = NamedSharding(mesh, P(MODEL))
    args = (x, jax.device_put(gate_up, on_experts), jax.device_put(down, on_experts), experts, weights)
    result = {"tokens": tokens, "tp": tp}
    for name, exchange in (("reduce_scatter", expert_parallel), ("all_to_all", all_to_all_exchange)):
        fn = jax.jit(functools.partial(exchange, run, mesh))
        lowered = fn.lower(*args)
        got = np.asarray(fn(*args).astype(jnp.float32))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - start)
        result[name] = {
            "median_ms": round(statistics.median(times) * 1e3, 2),
            "bytes_sent_per_device": collective_bytes(lowered, tp),
            "max_abs_diff_vs_unsharded": float(np.abs(got - want).max()),
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--tp", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inner", type=int, default=256)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = {
        "command": "python -m bench.moe_exchange " + " ".join(
            [f"--tokens {' '.join(map(str, args.tokens))}", f"--tp {' '.join(map(str, args.tp))}",
             f"--repeats {args.repeats} --hidden {args.hidden} --inner {args.inner} --experts {args.experts}"]),
        "backend": jax.default_backend(),
        "shape": {"hidden": args.hidden, "inner": args.inner, "experts": args.experts, "top_k": TOP_K,
                  "dtype": "bfloat16"},
        "runs": [measure(tokens, tp, args.repeats, args.hidden, args.inner, args.experts)
                 for tokens in args.tokens for tp in args.tp],
    }  # fmt: skip
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
