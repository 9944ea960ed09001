"""Ragged paged relative-bias attention at Inkling 2 Small's shapes (48 query / 8 KV heads of 128, 128-token
pages in random order, d_rel 16, extent 1024, bf16): the platform's kernel, the pure-jnp reference under
XLA, and cuDNN's fused attention (`jax.nn.dot_product_attention`, contiguous K/V, no bias, no sink: the
vendor's floor for the same reads and FLOPs, not the same op).

    python -m bench.ragged_paged_attention [--batches 1 8 64] [--contexts 1024 8192 65536]
        [--chunks 512 1024 2048 4096] [--prefixes 0 16384] [--repeats 20] [--layers 4]
        [--skip-reference-above 1000000000] [--out FILE.json]

Decode: one query per sequence at the end of `context` keys of a full-attention layer; reported as the KV bytes it
must read per second (2 * batch * context * 8 heads * 128 * 2 bytes / time) against the H200's measured 4.3 TB/s
copy bandwidth, beside `xla_read`: XLA reducing those same bytes (the K and V pools) to their maxima, what one
memory-bound kernel reaches at that size (launch and tail included), and `per_layer`: the call's time per layer in
a step of `--layers` calls sharing the lengths and page table. Prefill: one sequence's chunk of C new tokens after
`prefix` keys (0: the start of its prompt; chunked prefill of a long prompt: a later chunk), causal, C * prefix +
C(C+1)/2 visible pairs; reported as attention TFLOP/s (4 * 128 * 48 * pairs / time) against the ~800 TFLOP/s bf16
GEMM rate (cuDNN after a prefix: its whole C x (prefix + C) rectangle, since its causal mask is not the chunk's).
On a GPU, prefill rows also time `gpu_prefill_tiles`: the kernel with `invariant=False`, its 64-row prefill tiles
instead of the decode tiles that give a position the same bits at every step width (the cost of batch invariance).
Times are device time from CUPTI (every kernel the call launches, including the layout prep around ours and the
page gather in the reference; `kernel_only`: the longest single kernel of ours, the attention itself), median of
`repeats`. Each kernel result is checked against the reference where the reference runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from bench.timing import device_ms
from pallas_kernels.ragged_paged_attention import implementation
from pallas_kernels.ragged_paged_attention.reference import paged_keys

HEADS, KV_HEADS, DIM, PAGE, D_REL, EXTENT = 48, 8, 128, 128, 16, 1024
COPY_TB_S, BF16_TFLOP_S = 4.3, 800.0
PREFILL_TILES = (("gpu_prefill_tiles", {"invariant": False}),)  # the GPU kernel without batch invariance
LAYERED_KV_BYTES = 1 << 34  # per-layer timing only up to this much KV over all layers (each has its own pool)


def case(batch: int, context: int, width: int, seed: int) -> dict:
    """Random bf16 inputs: `batch` sequences of `context` keys in a shuffled page pool, `width` queries each."""
    keys = jax.random.split(jax.random.key(seed), 7)
    pages_per_seq = -(-context // PAGE)
    num_pages = batch * pages_per_seq
    table = jax.random.permutation(keys[0], num_pages).reshape(batch, pages_per_seq).astype(jnp.int32)

    def normal(key, *shape):
        return jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)

    return {
        "q": normal(keys[1], batch, width, HEADS, DIM) * 0.3,
        "k": normal(keys[2], num_pages, KV_HEADS, PAGE, DIM),
        "v": normal(keys[3], num_pages, KV_HEADS, PAGE, DIM),
        "kv_lens": jnp.full((batch,), context, jnp.int32),
        "query_lens": jnp.full((batch,), width, jnp.int32),
        "rel": normal(keys[4], batch, width, HEADS, D_REL),
        "rel_proj": normal(keys[5], D_REL, EXTENT) * 0.1,
        "sinks": normal(keys[6], batch, width, HEADS),
        "page_table": table,
    }


def contiguous(inputs: dict) -> tuple[jax.Array, jax.Array]:
    """Each sequence's K, V [B, context, Hkv, D] in position order (what cuDNN reads)."""
    return paged_keys(inputs["k"], inputs["page_table"])[0], paged_keys(inputs["v"], inputs["page_table"])[0]


def per_layer_ms(inputs: dict, *, kernel: str, layers: int, repeats: int) -> float:
    """Device time per layer of `layers` calls in one jitted step, each over its own K/V pool, profile table and
    queries, sharing the lengths and page table (as in an engine step, where XLA builds what depends only on
    the lengths once for all layers)."""
    attend = implementation(kernel)
    own = ("q", "k", "v", "rel", "rel_proj", "sinks")

    def fresh(x: jax.Array, key: jax.Array) -> jax.Array:
        return (jax.random.normal(key, x.shape, jnp.float32) * jnp.std(x.astype(jnp.float32))).astype(x.dtype)

    keys = jax.random.split(jax.random.key(layers), (layers - 1, len(own)))
    stacks = [{name: inputs[name] for name in own}]
    stacks += [{name: fresh(inputs[name], key) for name, key in zip(own, row, strict=True)} for row in keys]

    @jax.jit
    def step(stacks, kv_lens, query_lens, table):
        return [
            attend(x["q"], x["k"], x["v"], kv_lens, query_lens, x["rel"], x["rel_proj"], x["sinks"],
                   page_table=table, scale=DIM**-0.5, window=None)
            for x in stacks
        ]  # fmt: skip

    args = (stacks, inputs["kv_lens"], inputs["query_lens"], inputs["page_table"])
    return device_ms(step, *args, repeats=repeats)[0] / layers


def run_case(
    inputs: dict, *, kernel: str, repeats: int, with_reference: bool, causal_chunk: bool, variants: tuple = ()
) -> dict:
    """Times of the kernel, the reference and cuDNN on one case, and the kernel's largest error; `variants`: further
    (name, options) of the kernel to time, checked against the reference too."""
    args = [inputs[name] for name in ("q", "k", "v", "kv_lens", "query_lens", "rel", "rel_proj", "sinks")]
    row = {}
    results = {}
    calls = {kernel: implementation(kernel), "reference": implementation("reference")}
    calls |= {name: functools.partial(implementation(kernel), **options) for name, options in variants}
    names = [kernel, *(name for name, _ in variants)]
    for name in dict.fromkeys([*names, "reference"] if with_reference else names):
        attend = calls[name]
        fn = jax.jit(lambda *a, table, attend=attend: attend(*a, page_table=table, scale=DIM**-0.5, window=None))
        results[name] = fn(*args, table=inputs["page_table"])
        total, longest = device_ms(lambda *a, fn=fn: fn(*a, table=inputs["page_table"]), *args, repeats=repeats)
        row[f"{name}_ms"] = total
        if name == kernel and name != "reference":
            row["kernel_only_ms"] = longest
    for name in names if with_reference and kernel != "reference" else ():
        error = jnp.abs(results[name].astype(jnp.float32) - results["reference"].astype(jnp.float32)).max()
        row["max_abs_error" if name == kernel else f"{name}_max_abs_error"] = float(error)
    if jax.default_backend() == "gpu":
        k, v = contiguous(inputs)
        cudnn = jax.jit(
            lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, scale=DIM**-0.5, is_causal=causal_chunk, implementation="cudnn"
            )
        )
        row["cudnn_ms"] = device_ms(cudnn, inputs["q"], k, v, repeats=repeats)[0]
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 65536])
    parser.add_argument("--chunks", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument(
        "--prefixes", type=int, nargs="+", default=[0, 16384], help="keys before each prefill chunk (0: a fresh prompt)"
    )
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--layers", type=int, default=4, help="decode: also time this many layers' calls in one step (per layer)"
    )
    parser.add_argument(
        "--skip-reference-above",
        type=int,
        default=1 << 30,
        help="run the reference only up to this many bytes (decode: KV; prefill: its fp32 logits)",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    kernel = {"gpu": "gpu", "tpu": "tpu"}.get(jax.default_backend(), "reference")
    report = {
        "command": "python -m bench.ragged_paged_attention " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": jax.devices()[0].device_kind,
        "kernel": kernel,
        "decode": [],
        "prefill": [],
    }

    def record(section: str, row: dict) -> None:  # written after every case: a run cut short keeps what it measured
        report[section].append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            args.out.write_text(json.dumps(report, indent=1) + "\n")

    for batch in args.batches:
        for context in args.contexts:
            kv_bytes = 2 * batch * context * KV_HEADS * DIM * 2
            inputs = case(batch, context, 1, seed=batch * 7 + context)
            row = {"batch": batch, "context": context, "kv_bytes": kv_bytes}
            row |= run_case(
                inputs,
                kernel=kernel,
                repeats=args.repeats,
                with_reference=kv_bytes <= args.skip_reference_above,
                causal_chunk=False,
            )
            if args.layers > 1 and kernel != "reference" and args.layers * kv_bytes <= LAYERED_KV_BYTES:
                row[f"{kernel}_per_layer_ms"] = per_layer_ms(
                    inputs, kernel=kernel, layers=args.layers, repeats=args.repeats
                )
            if jax.default_backend() == "gpu":
                read = jax.jit(lambda k, v: (k.max(), v.max()))
                row["xla_read_ms"] = device_ms(read, inputs["k"], inputs["v"], repeats=args.repeats)[0]
            for name in (kernel, f"{kernel}_per_layer", "kernel_only", "reference", "cudnn", "xla_read"):
                if f"{name}_ms" in row:
                    row[f"{name}_tb_s"] = kv_bytes / row[f"{name}_ms"] / 1e9
                    row[f"{name}_pct_of_copy"] = 100 * row[f"{name}_tb_s"] / COPY_TB_S
            record("decode", row)
            del inputs
    for prefix in args.prefixes:
        for chunk in args.chunks:
            pairs = chunk * prefix + chunk * (chunk + 1) // 2
            flops = 4 * DIM * HEADS * pairs
            inputs = case(1, prefix + chunk, chunk, seed=chunk + prefix)
            row = {"chunk": chunk, "prefix": prefix, "flops": flops}
            logits_bytes = 4 * HEADS * chunk * (prefix + chunk)
            row |= run_case(
                inputs,
                kernel=kernel,
                repeats=args.repeats,
                with_reference=logits_bytes <= args.skip_reference_above,
                causal_chunk=prefix == 0,
                variants=PREFILL_TILES if kernel == "gpu" else (),
            )
            for name in (kernel, "gpu_prefill_tiles", "kernel_only", "reference", "cudnn"):
                if f"{name}_ms" in row:
                    # cuDNN after a prefix sees the whole chunk x context rectangle (no causal mask inside the chunk)
                    work = 4 * DIM * HEADS * chunk * (prefix + chunk) if name == "cudnn" and prefix else flops
                    row[f"{name}_tflop_s"] = work / row[f"{name}_ms"] / 1e9
                    row[f"{name}_pct_of_bf16"] = 100 * row[f"{name}_tflop_s"] / BF16_TFLOP_S
            record("prefill", row)


if __name__ == "__main__":
    main()
