"""The attention-residual mix + RMSNorm at Inkling 2 Small's width (hidden 4608) on the platform's path (`auto`:
what the model runs, the Mosaic TPU kernel on TPU, the Mosaic GPU kernel on GPU), beside the pure-jnp oracle
under XLA and, on GPU, the jnp formulation for XLA's GPU fusions (`xla_`).

    python -m bench.attn_res [--tokens 64 4096] [--sources 0 8] [--queries 1 3] [--repeats 20] [--out FILE.json]

Each case mixes `sources` closed blocks (bf16) and the fp32 partial sum under `queries` learned queries and
writes the Q normalised mixes (bf16). It is memory-bound: reported as the bytes it must move (every source
read once, the outputs written once) per second against the H200's measured 4.3 TB/s copy bandwidth, beside
`xla_read`: XLA reducing the same inputs to one value (their bytes per second), what one memory-bound kernel
reaches at that size.
Device time from CUPTI (every kernel of the call), median of `repeats`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from bench.timing import device_ms
from pallas_kernels.attn_res import attn_res_norm

HIDDEN, EPS, COPY_TB_S = 4608, 1e-5, 4.3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 4096])
    parser.add_argument("--sources", type=int, nargs="+", default=[0, 8])
    parser.add_argument("--queries", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    report = {
        "command": "python -m bench.attn_res " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": jax.devices()[0].device_kind,
        "rows": [],
    }
    for tokens in args.tokens:
        for count in args.sources:
            for queries in args.queries:
                keys = jax.random.split(jax.random.key(tokens + count + queries), count + 3)
                sources = [jax.random.normal(keys[i], (tokens, HIDDEN), jnp.bfloat16) for i in range(count)]
                partial = jax.random.normal(keys[count], (tokens, HIDDEN), jnp.float32)
                query = jax.random.normal(keys[count + 1], (queries, HIDDEN), jnp.float32)
                gains = (1 + 0.1 * jax.random.normal(keys[count + 2], (queries, HIDDEN))).astype(jnp.bfloat16)
                operands = (sources, partial, query, gains)
                read = jax.jit(lambda s, p: sum(x.astype(jnp.float32).max() for x in s) + p.max())
                read_bytes = tokens * HIDDEN * (2 * count + 4)
                moved = read_bytes + tokens * HIDDEN * 2 * queries
                row = {"tokens": tokens, "sources": count, "queries": queries, "bytes": moved}
                paths = [("", "auto"), ("reference_", "reference")]
                if jax.default_backend() == "gpu":
                    paths.append(("xla_", "xla"))
                for name, backend in paths:
                    run = jax.jit(lambda *a, b=backend: attn_res_norm(*a, eps=EPS, out_dtype=jnp.bfloat16, backend=b))
                    row[f"{name}ms"] = device_ms(run, *operands, repeats=args.repeats)[0]
                    row[f"{name}pct_of_copy"] = 100 * moved / row[f"{name}ms"] / 1e9 / COPY_TB_S
                row["xla_read_ms"] = device_ms(read, sources, partial, repeats=args.repeats)[0]
                row["xla_read_pct_of_copy"] = 100 * read_bytes / row["xla_read_ms"] / 1e9 / COPY_TB_S
                report["rows"].append(row)
                print(json.dumps(row), flush=True)
                if args.out:
                    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
