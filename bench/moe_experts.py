"""Routed experts at Inkling 2 Small's full shapes (hidden 4608, intermediate 2304, 384 experts, top-8): the
Mosaic GPU expert kernels (`kernel`) side by side with XLA's paths.

    python -m bench.moe_experts [--tokens 1 8 64] [--prefill 4096] [--formats bf16 mxfp8 nvfp4]
        [--repeats 10] [--out FILE.json]

Decode (a few tokens): memory-bound on the chosen experts' weights; reported as the distinct chosen experts'
stored bytes per second against the H200's measured 4.3 TB/s copy bandwidth. `kernel`: `moe_experts` with
backend "gpu" over the weights laid out by `for_gpu_experts` (the whole call: routing, both grouped matmuls, the
SwiGLU, the combine; `kernel_longest_ms` its longest kernel alone). `gather`: each copy's expert
weights gathered in their stored format, dequantized in XLA and multiplied (a naive XLA path); `xla_read`: XLA
reducing the same distinct experts' stored bytes, what one memory-bound kernel reaches at that size.
Prefill (`--prefill` tokens): reported as useful TFLOP/s (2 * copies * 3 * H * I / time) against ~800 bf16.
`padded`: every expert dequantized to bf16 in XLA, its copies gathered into a capacity-padded [E, C, H] batch
(C = the largest group), two batched matmuls, the rows scattered back; `kernel` as for decode. Device time
from CUPTI (every kernel of the call), median of `repeats`. Routing: each token's 8 distinct experts uniformly at
random.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.timing import device_ms
from pallas_kernels.moe import moe_experts
from pallas_kernels.moe.layouts import for_gpu_experts
from pallas_kernels.moe.reference import capped_swiglu
from pallas_kernels.moe.routing import combine, route
from pallas_kernels.numerics import round_to
from pallas_kernels.quantized import MXFP8, NVFP4, QuantizedArray

HIDDEN, INTER, EXPERTS, TOP_K = 4608, 2304, 384, 8
CAPS = {"gate_cap": 4.0, "up_cap": 25.0}
COPY_TB_S, BF16_TFLOP_S = 4.3, 800.0


def random_bytes(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """uint8 random bytes drawn as uint32 words (`random.bits` of uint8 would draw a uint32 per byte: 4x the
    memory, 30 GiB for MXFP8 gate_up)."""
    *lead, last = shape
    words = jax.random.bits(key, (*lead, last // 4), jnp.uint32)
    return jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(shape)


def stored(key: jax.Array, shape: tuple[int, int, int], fmt: str) -> jax.Array | QuantizedArray:
    """Random expert weights [E, N, K] as stored: bf16 values, or well-formed quantized bytes."""
    keys = jax.random.split(key, 2)
    if fmt == "bf16":
        return (jax.random.normal(keys[0], shape, jnp.float32) * 0.02).astype(jnp.bfloat16)
    *lead, k = shape
    if fmt == MXFP8:
        data = random_bytes(keys[0], shape)
        data = jnp.where(data & 0x7F == 0x7F, data ^ 1, data)  # no NaN codes
        scales = jax.random.randint(keys[1], (*lead, k // 32), 112, 120).astype(jnp.uint8)
        return QuantizedArray(jax.lax.bitcast_convert_type(data, jnp.float8_e4m3fn), scales, None, MXFP8)
    data = random_bytes(keys[0], (*lead, k // 2))
    scales = jax.random.randint(keys[1], (*lead, k // 16), 0x30, 0x50).astype(jnp.uint8)
    global_scale = jnp.full((shape[0], 1, 1), 1e-3, jnp.float32)
    return QuantizedArray(data, jax.lax.bitcast_convert_type(scales, jnp.float8_e4m3fn), global_scale, NVFP4)


def take(weight: jax.Array | QuantizedArray, ids: jax.Array) -> jax.Array | QuantizedArray:
    """The experts `ids` of a stored weight, still stored; the barrier keeps XLA from moving the gather after
    the dequantization (which would dequantize every expert)."""
    return jax.lax.optimization_barrier(jax.tree.map(lambda a: a[ids], weight))


def values(weight: jax.Array | QuantizedArray) -> jax.Array:
    return weight.dequantize(jnp.bfloat16) if isinstance(weight, QuantizedArray) else weight


def gather_path(x, gate_up, down, experts, weights):
    """Each copy's experts gathered, dequantized and multiplied in XLA."""
    copy_ids, top_k = experts.reshape(-1), experts.shape[1]
    rows = jnp.repeat(x, top_k, axis=0)  # [N * k, H], copy n * k + j
    projected = round_to(
        jnp.einsum("ch,cnh->cn", rows, values(take(gate_up, copy_ids)), preferred_element_type=jnp.float32), x.dtype
    )
    inter = projected.shape[-1] // 2
    hidden = capped_swiglu(projected[:, :inter], projected[:, inter:], **CAPS)
    out_rows = jnp.einsum("ci,chi->ch", hidden, values(take(down, copy_ids)), preferred_element_type=jnp.float32)
    out = (out_rows * weights.reshape(-1, 1)).reshape(*x.shape[:1], top_k, -1).sum(axis=1)
    return round_to(out, x.dtype)


def padded_path(x, gate_up, down, experts, weights, *, capacity: int):
    """All experts dequantized, copies in a capacity-padded [E, C, H] batch, two batched matmuls."""
    num_experts, hidden_size = gate_up.shape[0], x.shape[1]
    routing = route(experts, weights, num_experts)
    copies = routing.order.shape[0]
    expert_of = experts.reshape(-1)[routing.order]
    slot = jnp.arange(copies) - (jnp.cumsum(routing.group_sizes) - routing.group_sizes)[expert_of]
    index = jnp.full((num_experts, capacity), copies, jnp.int32).at[expert_of, slot].set(jnp.arange(copies))
    rows = jnp.concatenate([x[routing.token_of], jnp.zeros((1, hidden_size), x.dtype)])[index]  # [E, C, H]
    projected = round_to(jnp.einsum("ech,enh->ecn", rows, values(gate_up), preferred_element_type=jnp.float32), x.dtype)
    inter = projected.shape[-1] // 2
    hidden = capped_swiglu(projected[..., :inter], projected[..., inter:], **CAPS)
    out_rows = round_to(jnp.einsum("eci,ehi->ech", hidden, values(down), preferred_element_type=jnp.float32), x.dtype)
    sorted_rows = out_rows.reshape(-1, hidden_size)[expert_of * capacity + slot]
    return combine(sorted_rows, routing, x.shape[0], x.dtype)


def routing_case(tokens: int, seed: int, num_experts: int, hidden: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    experts = np.stack([rng.permutation(num_experts)[:TOP_K] for _ in range(tokens)]).astype(np.int32)
    x = jax.random.normal(jax.random.key(seed), (tokens, hidden), jnp.float32).astype(jnp.bfloat16)
    weights = jnp.asarray(rng.uniform(0.05, 0.3, (tokens, TOP_K)), jnp.float32)
    return x, jnp.asarray(experts), weights


def nbytes(weight: jax.Array | QuantizedArray) -> int:
    return weight.nbytes if isinstance(weight, QuantizedArray) else weight.size * weight.dtype.itemsize


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--prefill", type=int, nargs="*", default=[4096])
    parser.add_argument("--formats", nargs="+", default=["bf16", MXFP8, NVFP4])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--shape", type=int, nargs=3, default=[EXPERTS, HIDDEN, INTER], help="E H I (smaller: a smoke run)"
    )
    parser.add_argument("--kernel-only", action="store_true", help="the GPU kernel column alone (no XLA paths)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    report = {
        "command": "python -m bench.moe_experts " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": jax.devices()[0].device_kind,
        "decode": [],
        "prefill": [],
    }

    def record(section: str, row: dict) -> None:
        report[section].append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            args.out.write_text(json.dumps(report, indent=1) + "\n")

    for fmt in args.formats:
        measure_format(fmt, args, record)


def stored_experts(num_experts: int, hidden: int, inter: int, fmt: str) -> tuple:
    """Random gate_up [E, 2I, H] and down [E, H, I] as stored in `fmt`, and one expert's stored bytes."""
    keys = jax.random.split(jax.random.key(0), 2)
    gate_up = stored(keys[0], (num_experts, 2 * inter, hidden), fmt)
    down = stored(keys[1], (num_experts, hidden, inter), fmt)
    return gate_up, down, (nbytes(gate_up) + nbytes(down)) // num_experts


def measure_format(fmt: str, args: argparse.Namespace, record) -> None:
    """The decode and prefill rows of one weight format (its weights freed on return)."""
    num_experts, hidden, inter = args.shape
    gate_up, down, per_expert = stored_experts(num_experts, hidden, inter, fmt)
    laid = for_gpu_experts(gate_up, down) if jax.default_backend() == "gpu" else None
    kernel = jax.jit(
        lambda x, gate_up, down, experts, weights: moe_experts(
            x, gate_up, down, experts, weights, **CAPS, backend="gpu"
        )
    )
    for tokens in args.tokens:
        x, experts, weights = routing_case(tokens, tokens, num_experts, hidden)
        distinct = len(np.unique(np.asarray(experts)))
        row = {"format": fmt, "tokens": tokens, "distinct_experts": distinct, "bytes": distinct * per_expert}

        def read(gate_up, down, d=distinct):
            return sum(leaf[:d].astype(jnp.float32).max() for leaf in jax.tree.leaves((gate_up, down)))

        operands = (x, gate_up, down, experts, weights)
        if laid:
            row["kernel_ms"], row["kernel_longest_ms"] = device_ms(
                kernel, x, *laid, experts, weights, repeats=args.repeats
            )
        if not args.kernel_only:
            row["gather_ms"] = device_ms(jax.jit(gather_path), *operands, repeats=args.repeats)[0]
            row["xla_read_ms"] = device_ms(jax.jit(read), gate_up, down, repeats=args.repeats)[0]
        for name in (name for name in ("kernel", "gather", "xla_read") if f"{name}_ms" in row):
            row[f"{name}_pct_of_copy"] = 100 * row["bytes"] / row[f"{name}_ms"] / 1e9 / COPY_TB_S
        record("decode", row)
    for tokens in args.prefill:
        x, experts, weights = routing_case(tokens, tokens, num_experts, hidden)
        capacity = int(np.bincount(np.asarray(experts).reshape(-1), minlength=num_experts).max())
        flops = 2 * tokens * TOP_K * 3 * hidden * inter
        run = jax.jit(lambda *a, c=capacity: padded_path(*a, capacity=c))
        row = {"format": fmt, "tokens": tokens, "capacity": capacity, "flops": flops}
        if laid:
            row["kernel_ms"], row["kernel_longest_ms"] = device_ms(
                kernel, x, *laid, experts, weights, repeats=args.repeats
            )
            row["kernel_tflop_s"] = flops / row["kernel_ms"] / 1e9
            row["kernel_pct_of_bf16"] = 100 * row["kernel_tflop_s"] / BF16_TFLOP_S
        if not args.kernel_only:
            row["padded_ms"] = device_ms(run, x, gate_up, down, experts, weights, repeats=args.repeats)[0]
            row["padded_tflop_s"] = flops / row["padded_ms"] / 1e9
            row["padded_pct_of_bf16"] = 100 * row["padded_tflop_s"] / BF16_TFLOP_S
        record("prefill", row)


if __name__ == "__main__":
    main()
