"""What the TPU expert kernels (`pallas_kernels.moe.tpu`) do for one routed-experts call at Inkling 2 Small's
shapes, counted from their plan, and the least time that work can take on one TensorCore of a TPU v7x: no TPU is
at hand, so this model is what the kernels' plans are weighed by until one is.

    python -m bench.moe_tpu_plan [--tokens 1 8 64 512 4096] [--formats bf16 mxfp8 nvfp4] [--shards 1 4]

For each call (routing as `bench.moe_experts`: each token's 8 distinct experts uniformly at random; with
`--shards S`, shard 0 of S holding 384 / S experts, the other ids dropped there): the real visits and their tile
height TM; the rows the kernels multiply against the copies kept; each kernel's grid order as it chooses it
(`orders`, gate_up's then down's: C column tiles outside, V visits outside); the HBM bytes of each kernel (a block
fetched whenever its index changes from one grid step to the next: the weight blocks where the expert or the
column tile does, the rows where the visit does: gate_up's its copies' token rows, each a DMA of x laid out as
[T, H / 128, 128] in whole (16, 128) tiles, down's its row tile; the output tile every step) and of XLA's steps
around them (x relaid for those DMAs, the combine; NVFP4's gate_up is laid out in down's K order, so nothing
between the kernels); the MXU's multiply-adds. `shared/kept`: the rows megablox's plan would multiply per
kept copy (the sorted copies in shared tiles of up to 256 rows, each visited once per expert it meets; the TPU
kernels' plan below 8 copies per expert until the eleventh session).
`floor_ms`: each kernel at the slower of its bytes at 3.69 TB/s and its flops at bf16's 1153 TFLOP/s, XLA's steps
at their bytes: half a v7x chip's peaks (7.38 TB/s, 2307 TFLOP/s), as JAX sees each of its two TensorCores as a
device of its own (no megacore) and a kernel runs on one (a chip serving the experts alone is `--shards 2`). Not
in the floor: the VPU's dequantization of every weight block a visit reads, whatever the rows, which at decode may
well be the bound a TPU run finds (a v7x's vector rate per element operation is not at hand): its work is printed
first, as element operations per weight value in the kernels' chunk (the equations of its jaxpr, each counted by
its output's elements; bitcasts, reshapes, loads and stores free); the MXU's loading of each weight block, which
every weight value passes once whatever the rows (at decode's 16-row tiles it may take longer than the block's
bytes); the scalar core's issue of gate_up's row DMAs (one per kept copy: 32,768 at 4096 tokens).
"""

from __future__ import annotations

import argparse
from collections import Counter

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from bench.moe_experts import EXPERTS, HIDDEN, INTER, routing_case
from pallas_kernels import block_formats
from pallas_kernels.moe import tpu
from pallas_kernels.moe.routing import group_offsets, route, visits
from pallas_kernels.quantized import MXFP8, NVFP4

HBM_TB_S, MXU_TFLOP_S = 7.38 / 2, 2307.0 / 2  # TPU v7x per TensorCore: half the chip's (quant_and_kernels.md)
WEIGHT_BYTES = {"bf16": 2.0, MXFP8: 1 + 1 / block_formats.MX_BLOCK, NVFP4: 0.5 + 1 / block_formats.NV_BLOCK}


NOT_VECTOR_WORK = {  # a vreg reinterpreted or moved whole, or memory
    "bitcast",
    "bitcast_convert_type",
    "reshape",
    "concatenate",
    "broadcast_in_dim",
    "squeeze",
    "slice",
    "get",
    "swap",
    "jit",
    "multiple_of",
}


def dequant_ops(fmt: str, tn: int = 512) -> Counter:
    """Element operations per weight value of the kernels' dequantization of one chunk [CHUNK, tn] to bf16, by
    primitive."""
    spec = jax.ShapeDtypeStruct
    blocks = tpu.CHUNK // (block_formats.MX_BLOCK if fmt == MXFP8 else block_formats.NV_BLOCK)
    if fmt == MXFP8:
        refs = [spec((tpu.CHUNK, tn), jnp.float8_e4m3fn), spec((blocks, tn), jnp.uint8)]
    else:
        refs = [spec((2, blocks, tn), jnp.uint32), spec((blocks, tn), jnp.float8_e4m3fn), spec((1, tn), jnp.float32)]

    def kernel(*refs):
        *weight, out_ref, scales = refs
        tpu._decode_scales(fmt, weight, scales)
        out_ref[...] = tpu._chunk(fmt, weight, scales, 0, jnp.bfloat16)

    def call(*args):
        return pl.pallas_call(
            kernel,
            out_shape=spec((tpu.CHUNK, tn), jnp.bfloat16),
            scratch_shapes=[pltpu.VMEM((blocks, tn), jnp.float32)],
        )(*args)

    ops = Counter()

    def count(jaxpr) -> None:
        for eqn in jaxpr.eqns:
            for inner in jax.extend.core.jaxprs_in_params(eqn.params):
                count(inner)
            if eqn.primitive.name not in NOT_VECTOR_WORK:
                ops[eqn.primitive.name] += sum(v.aval.size for v in eqn.outvars) / (tpu.CHUNK * tn)

    (pallas,) = [eqn for eqn in jax.make_jaxpr(call)(*refs).eqns if eqn.primitive.name == "pallas_call"]
    count(pallas.params["jaxpr"])
    return ops


def kernel_work(
    expert: np.ndarray,
    tm: int,
    k: int,
    tiles: int,
    block: int,
    out: int,
    per_value: float,
    visits_first: bool,
    row_bytes: float,
) -> tuple[float, float]:
    """(HBM bytes, flops) of one grouped matmul over the visits' experts `expert` [V] and its `tiles` column tiles:
    each step's weight block(s) [K, block] fetched where the expert or the column tile changes, its rows
    (`row_bytes` a visit) where the visit does, its output tile [TM, out] out (bf16)."""
    visits = len(expert)
    runs = 1 + int(np.sum(expert[1:] != expert[:-1]))
    steps = tiles * visits
    weights = tiles * (visits if visits_first else runs) * k * block * per_value
    rows = (1 if visits_first else tiles) * row_bytes
    return weights + rows + steps * tm * out * 2, 2.0 * steps * tm * k * block


def shared_rows(routing) -> int:
    """Rows multiplied by megablox's plan: tiles of all the copies up to 256 rows, one visit per (tile, expert)."""
    copies, experts = routing.order.shape[0], routing.group_sizes.shape[0]
    tm = min(tpu.MAX_TM, -(-copies // 16) * 16)
    _, _, real = visits(group_offsets(routing), tm, -(-copies // tm) + min(experts, copies) - 1)
    return int(real[0]) * tm


def call_work(tokens: int, fmt: str, shards: int) -> dict:
    """The plan's counts and the call's bytes, flops and floor for `tokens` on shard 0 of `shards`."""
    local = EXPERTS // shards
    _, ids, weights = routing_case(tokens, tokens, EXPERTS, HIDDEN)
    routing = route(ids, weights, local, EXPERTS if shards > 1 else None)
    plan = tpu._plan(routing)
    real = int(plan.real[0])
    expert = np.asarray(plan.expert)[:real]
    per_value = WEIGHT_BYTES[fmt]
    itemsize = {"bf16": 2, MXFP8: 1, NVFP4: 0.5}[fmt]
    tn, th = tpu._columns_per_step(INTER, HIDDEN, itemsize), tpu._columns_per_step(HIDDEN, INTER, itemsize)
    kept = int(np.asarray(routing.kept).sum())
    token_row = tpu.lane_blocks(HIDDEN, jnp.bfloat16) * tpu.LANES * 2  # a token's row as gate_up's DMA reads it
    rows = (kept * token_row, real * plan.tm * INTER * 2)  # each kernel's rows, every visit's once
    shapes = ((INTER // tn, 2 * INTER * HIDDEN * itemsize), (HIDDEN // th, HIDDEN * INTER * itemsize))  # column
    # tiles, an expert's weight bytes
    orders = [
        bool(tpu._visits_first(plan, tiles, expert_bytes, jnp.float32(row_bytes)))  # as the kernels choose
        for (tiles, expert_bytes), row_bytes in zip(shapes, rows, strict=True)
    ]
    gate_up = kernel_work(expert, plan.tm, HIDDEN, INTER // tn, 2 * tn, tn, per_value, orders[0], rows[0])
    down = kernel_work(expert, plan.tm, INTER, HIDDEN // th, th, th, per_value, orders[1], rows[1])
    xla = tokens * (HIDDEN * 2 + token_row) + kept * HIDDEN * 2 + tokens * HIDDEN * 2  # x's rows relaid; combine
    floor = sum(max(b / HBM_TB_S, f / MXU_TFLOP_S) for b, f in (gate_up, down)) / 1e9 + xla / HBM_TB_S / 1e9
    stored = len(np.unique(expert)) * 3 * HIDDEN * INTER * per_value
    return {
        "tokens": tokens,
        "format": fmt,
        "shards": shards,
        "visits": real,
        "tm": plan.tm,
        "rows_per_kept": real * plan.tm / max(kept, 1),
        "shared_per_kept": shared_rows(routing) / max(kept, 1),
        "static_rows": plan.rows,
        "orders": "".join("V" if first else "C" for first in orders),
        "weights_gb": stored / 1e9,
        "kernel_gb": (gate_up[0] + down[0]) / 1e9,
        "xla_gb": xla / 1e9,
        "tflop": (gate_up[1] + down[1]) / 1e12,
        "floor_ms": floor,
        "weights_ms": stored / HBM_TB_S / 1e9,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 4096])
    parser.add_argument("--formats", nargs="+", default=["bf16", MXFP8, NVFP4], choices=list(WEIGHT_BYTES))
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args(argv)
    for fmt in args.formats:
        if fmt != "bf16":
            ops = dequant_ops(fmt)
            print(
                f"{fmt} dequantization: {sum(ops.values()):.2f} element operations per weight value ("
                + ", ".join(f"{name} {count:.2f}" for name, count in ops.most_common())
                + ")"
            )
    head = "tokens format shards visits TM rows/kept shared/kept static orders weights_GB kernels_GB XLA_GB TFLOP"
    head += " floor_ms"
    head += " weights_ms"
    print(" ".join(f"{name:>6}" for name in head.split()))
    for shards in args.shards:
        for fmt in args.formats:
            for tokens in args.tokens:
                w = call_work(tokens, fmt, shards)
                cells = [tokens, fmt, shards, w["visits"], w["tm"], f"{w['rows_per_kept']:.2f}",
                         f"{w['shared_per_kept']:.2f}", w["static_rows"], w["orders"], f"{w['weights_gb']:.2f}",
                         f"{w['kernel_gb']:.2f}", f"{w['xla_gb']:.3f}", f"{w['tflop']:.2f}", f"{w['floor_ms']:.3f}",
                         f"{w['weights_ms']:.3f}"]  # fmt: skip
                widths = [max(6, len(name)) for name in head.split()]
                print(" ".join(f"{cell:>{width}}" for cell, width in zip(cells, widths, strict=True)), flush=True)


if __name__ == "__main__":
    main()
