"""Per-kernel device time of one routed-experts call through the Mosaic GPU kernels: where the call's time goes
(routing, the row gather, the two grouped matmuls, the SwiGLU, the combine), at Inkling 2 Small's expert shapes.

    python -m bench.moe_profile [--formats mxfp8 nvfp4] [--tokens 1 8 64 4096] [--repeats 7] [--brief]

Weights and routing as in `bench.moe_experts` (each token's 8 distinct experts uniformly at random); CUPTI times
every kernel of the call, the median of `repeats` per kernel; the total against the distinct chosen experts'
stored bytes at the H200's 4.3 TB/s copy bandwidth. `--brief`: kernels of 0.1 ms and more only.
"""

from __future__ import annotations

import argparse
import statistics

import jax
import numpy as np

from bench.moe_experts import CAPS, COPY_TB_S, EXPERTS, HIDDEN, INTER, nbytes, routing_case, stored
from pallas_kernels.moe import for_gpu, moe_experts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="+", default=["mxfp8", "nvfp4"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 4096])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--brief", action="store_true")
    args = parser.parse_args(argv)
    from jax.experimental.mosaic.gpu import profiler

    for fmt in args.formats:
        keys = jax.random.split(jax.random.key(0), 2)
        gate_up = stored(keys[0], (EXPERTS, 2 * INTER, HIDDEN), fmt)
        down = stored(keys[1], (EXPERTS, HIDDEN, INTER), fmt)
        per_expert = (nbytes(gate_up) + nbytes(down)) // EXPERTS
        gate_up, down = jax.jit(for_gpu)(gate_up), jax.jit(for_gpu)(down)
        call = jax.jit(lambda *a: moe_experts(*a, **CAPS, backend="gpu"))
        for tokens in args.tokens:
            x, experts, weights = routing_case(tokens, tokens, EXPERTS, HIDDEN)
            distinct = len(np.unique(np.asarray(experts)))
            jax.block_until_ready(call(x, gate_up, down, experts, weights))
            operands = (x, gate_up, down, experts, weights)
            _, runs = profiler.measure(call, aggregate=False, iterations=args.repeats)(*operands)
            names = [name for name, _ in runs[0]]
            ms = [statistics.median(run[i][1] for run in runs) for i in range(len(names))]
            total = sum(ms)
            percent = 100 * distinct * per_expert / total / 1e9 / COPY_TB_S
            print(f"== {fmt} tokens {tokens}: total {total * 1e3:.1f} us, {percent:.1f}% of copy", flush=True)
            for name, kernel_ms in zip(names, ms, strict=True):
                if not args.brief or kernel_ms > 0.1:
                    print(f"   {kernel_ms * 1e3:8.1f} us  {name[:110]}")
        del gate_up, down


if __name__ == "__main__":
    main()
