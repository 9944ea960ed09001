"""Per-kernel device time of one routed-experts call through the Mosaic GPU kernels: where the call's time goes
(routing, the row gather, the two grouped matmuls, the combine), at Inkling 2 Small's expert shapes. The kernels
are named `experts_{format}_swiglu` (gate_up with the SwiGLU in its epilogue) and `experts_{format}_matmul` (down).

    python -m bench.moe_profile [--formats mxfp8 nvfp4] [--tokens 1 8 64 4096] [--repeats 7] [--brief] [--once]

Weights and routing as in `bench.moe_experts` (each token's 8 distinct experts uniformly at random); CUPTI times
every kernel of the call, the median of `repeats` per kernel; the total against the distinct chosen experts'
stored bytes at the H200's 4.3 TB/s copy bandwidth. `--brief`: kernels of 0.1 ms and more only. `--once`: each
call run once and not timed, for a profiler outside (CUPTI is then free), e.g. Nsight Compute's counters of the
expert kernels (on the H200 machine, ~2 minutes for both formats at 1, 8 and 4096 tokens):

    ncu --clock-control none --set full --kernel-name regex:experts_ -o prof \\
        python -m bench.moe_profile --once --tokens 1 8 4096
    ncu --import prof.ncu-rep --page raw --csv > raw.csv
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

from bench.moe_experts import CAPS, COPY_TB_S, EXPERTS, HIDDEN, INTER, routing_case, stored_experts
from bench.timing import kernels_ms
from pallas_kernels.moe import moe_experts
from pallas_kernels.moe.layouts import for_gpu_experts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="+", default=["mxfp8", "nvfp4"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 4096])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--brief", action="store_true")
    parser.add_argument("--once", action="store_true")
    args = parser.parse_args(argv)
    for fmt in args.formats:
        gate_up, down, per_expert = stored_experts(EXPERTS, HIDDEN, INTER, fmt)
        gate_up, down = for_gpu_experts(gate_up, down)
        call = jax.jit(lambda *a: moe_experts(*a, **CAPS, backend="gpu"))
        for tokens in args.tokens:
            x, experts, weights = routing_case(tokens, tokens, EXPERTS, HIDDEN)
            if args.once:
                jax.block_until_ready(call(x, gate_up, down, experts, weights))
                print(f"== {fmt} tokens {tokens}: ran once", flush=True)
                continue
            distinct = len(np.unique(np.asarray(experts)))
            kernels = kernels_ms(call, x, gate_up, down, experts, weights, repeats=args.repeats)
            total = sum(ms for _, ms in kernels)
            percent = 100 * distinct * per_expert / total / 1e9 / COPY_TB_S
            print(f"== {fmt} tokens {tokens}: total {total * 1e3:.1f} us, {percent:.1f}% of copy", flush=True)
            for name, ms in kernels:
                if not args.brief or ms > 0.1:
                    print(f"   {ms * 1e3:8.1f} us  {name[:110]}")
        del gate_up, down


if __name__ == "__main__":
    main()
