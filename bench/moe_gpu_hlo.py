"""XLA's optimized program of the routed-experts call for an H200, compiled on a machine without a GPU: the XLA
kernels around the Mosaic GPU ones and what each computes per element. A chain of index gathers fused into a
large gather-sum (recomputed for every element it reads) shows as a fusion of many gathers.

    JAX_PLATFORMS=cpu python -m bench.moe_gpu_hlo [--formats mxfp8 nvfp4] [--tokens 1 64 4096] [--out DIR]

Needs JAX's CUDA plugin (`pip install -e '.[gpu-aot]'`), which compiles for `H200_TARGET` with no device. Not
the H200's program in every detail: without a device XLA has no CUB scratch sizes and sorts by its own fallback
(the routing's two sorts), and it autotunes nothing. Prints, per call, each kernel of the entry computation: its
operation, result shape and the gathers it holds; `--out` keeps each call's whole optimized HLO.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import jax
from jax.experimental import topologies

from bench.moe_experts import CAPS, EXPERTS, HIDDEN, INTER, routing_case, stored_experts
from pallas_kernels.moe import gpu
from pallas_kernels.moe.layouts import for_gpu_experts

# What XLA's GPU compiler reads of the device (its cost model and launch limits): an H200 SXM's.
H200_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 shared_memory_per_block_optin: 232448 threads_per_core_limit: 2048
  core_count: 132 fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 4800000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 150754820096 registers_per_core_limit: 65536 registers_per_block_limit: 65536
  cuda_compute_capability { major: 9 }
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
device_description_str: "NVIDIA H200"
"""
KERNEL_OPS = "fusion|custom-call|copy|sort"
ENTRY_KERNEL = re.compile(rf"^\s+(?:ROOT )?%(?P<name>[\w.-]+) = (?P<shape>\(.*?\)|\S+) (?P<op>{KERNEL_OPS})\(")
CALLS = re.compile(r"calls=%(?P<called>[\w.-]+)")


def computations(hlo: str) -> dict[str, str]:
    """Each computation's text by name ('ENTRY' for the entry computation)."""
    found = {}
    for block in re.finditer(r"^(ENTRY )?%(?P<name>[\w.-]+) \(.*?^\}", hlo, re.M | re.S):
        found["ENTRY" if block.group(1) else block.group("name")] = block.group(0)
    return found


def entry_kernels(hlo: str) -> list[tuple[str, str, str, int]]:
    """(name, operation, result shape, gathers inside) of each kernel the entry computation launches."""
    bodies = computations(hlo)
    kernels = []
    for line in bodies["ENTRY"].splitlines():
        kernel = ENTRY_KERNEL.match(line)
        if kernel is None:
            continue
        called = CALLS.search(line)
        body = bodies.get(called.group("called"), "") if called else ""
        shape = re.sub(r"\{[\d,]*\}", "", kernel.group("shape"))
        kernels.append((kernel.group("name"), kernel.group("op"), shape, body.count(" gather(")))
    return kernels


def optimized_hlo(fmt: str, tokens: int, device: jax.Device) -> str:
    """The call's optimized HLO at the full expert shapes, its operands abstract (nothing is allocated)."""
    gate_up, down = jax.eval_shape(lambda: for_gpu_experts(*stored_experts(EXPERTS, HIDDEN, INTER, fmt)[:2]))
    x, experts, weights = routing_case(tokens, tokens, EXPERTS, HIDDEN)
    sharding = jax.sharding.SingleDeviceSharding(device)
    operands = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), (x, gate_up, down, experts, weights)
    )
    call = jax.jit(lambda *a: gpu.moe_experts(*a, **CAPS))
    return call.trace(*operands).lower().compile().as_text()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="+", default=["mxfp8", "nvfp4"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 4096])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=H200_TARGET, topology="1x1x1")
    except (RuntimeError, ValueError) as error:
        plugin = "JAX's CUDA plugin (pip install -e '.[gpu-aot]')"
        raise SystemExit(f"compiling for a GPU without one needs {plugin}: {error}") from error
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    for fmt in args.formats:
        for tokens in args.tokens:
            hlo = optimized_hlo(fmt, tokens, topology.devices[0])
            if args.out:
                (args.out / f"moe_{fmt}_{tokens}.hlo").write_text(hlo)
            print(f"== {fmt} tokens {tokens}")
            for name, op, shape, gathers in entry_kernels(hlo):
                print(f"   {op:12} {shape[:60]:60} gathers {gathers:2}  {name}")


if __name__ == "__main__":
    main()
