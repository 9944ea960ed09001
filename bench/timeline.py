"""A GPU's kernels laid out in time, from a profiler trace: how much of a run the device was busy, how long it sat
idle between kernels, and where the busy time went by kind of kernel. CUPTI's per-kernel sums (`bench.timing`)
count kernels that run side by side twice and miss the gaps between them; the trace has both.

`trace_kernels` reads what `jax.profiler.trace` wrote (the kernels on the GPU's streams, as the trace viewer shows
them); `layout` summarizes them.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
from pathlib import Path

# kinds of kernels, by name (the first that matches); anything else is one of XLA's own (fusions, copies)
KINDS = (
    ("NVFP4 experts", re.compile(r"experts_nvfp4")),
    ("MXFP8 experts", re.compile(r"experts_mxfp8")),
    ("bf16 experts", re.compile(r"experts_")),
    ("attention", re.compile(r"ragged_paged_attention")),
    ("attention-residual mix", re.compile(r"attn_res")),
    ("Mosaic GPU kernels", re.compile(r"mosaic_gpu")),
    ("cuBLAS gemms", re.compile(r"nvjet|gemm|cublas|cutlass", re.IGNORECASE)),
    ("copies", re.compile(r"memcpy|memset|^copy", re.IGNORECASE)),
)
XLA_KERNELS = "XLA kernels"


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    start_us: float
    duration_us: float


@dataclasses.dataclass(frozen=True)
class Layout:
    """`runs` runs' kernels, per run: from the first kernel's start to the last one's end (span), the time at least
    one kernel ran (busy), the rest (idle) in `gaps` stretches, and each kind's kernel time (kernels side by side
    both counted)."""

    runs: int
    kernels: float
    span_ms: float
    busy_ms: float
    idle_ms: float
    gaps: float
    by_kind_ms: dict[str, float]

    def lines(self) -> list[str]:
        head = (
            f"timeline of {self.runs} runs, per run: {self.kernels:.0f} kernels, span {self.span_ms:.3f} ms, busy "
            f"{self.busy_ms:.3f} ms, idle {self.idle_ms:.3f} ms in {self.gaps:.0f} gaps"
        )
        kinds = sorted(self.by_kind_ms.items(), key=lambda item: -item[1])
        return [head, *(f"{ms:8.3f} ms  {kind}" for kind, ms in kinds)]


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return XLA_KERNELS


def layout(kernels: list[Kernel], runs: int) -> Layout:
    """The timeline of `runs` back-to-back runs' kernels (in any order), per run."""
    if not kernels:
        raise ValueError("the trace holds no GPU kernel")
    ordered = sorted(kernels, key=lambda k: k.start_us)
    busy = gaps = 0.0
    covered_from, covered_to = ordered[0].start_us, ordered[0].start_us
    for kernel in ordered:  # the union of the kernels' intervals, stretch by stretch
        end = kernel.start_us + kernel.duration_us
        if kernel.start_us > covered_to:
            busy += covered_to - covered_from
            gaps += 1
            covered_from = kernel.start_us
        covered_to = max(covered_to, end)
    busy += covered_to - covered_from
    span = covered_to - ordered[0].start_us
    by_kind: dict[str, float] = {}
    for kernel in kernels:
        kind = kind_of(kernel.name)
        by_kind[kind] = by_kind.get(kind, 0.0) + kernel.duration_us / 1e3 / runs
    per_run = 1e3 * runs
    return Layout(
        runs, len(kernels) / runs, span / per_run, busy / per_run, (span - busy) / per_run, gaps / runs, by_kind
    )


def trace_kernels(trace_dir: Path) -> list[Kernel]:
    """The kernels of the newest trace `jax.profiler.trace(trace_dir)` wrote: complete events on the GPUs' stream
    lanes ("Stream #..." threads of a "/device:GPU:..." process), not the per-op summaries the viewer adds."""
    files = sorted(Path(trace_dir).glob("plugins/profile/*/*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"no profiler trace under {trace_dir}")
    with gzip.open(files[-1], "rt") as f:
        events = json.load(f)["traceEvents"]
    processes, threads = {}, {}
    for event in events:
        if event.get("ph") == "M" and event.get("name") == "process_name":
            processes[event["pid"]] = event["args"]["name"]
        elif event.get("ph") == "M" and event.get("name") == "thread_name":
            threads[event["pid"], event["tid"]] = event["args"]["name"]
    return [
        Kernel(event["name"], float(event["ts"]), float(event["dur"]))
        for event in events
        if event.get("ph") == "X"
        and "/device:GPU:" in processes.get(event["pid"], "")
        and threads.get((event["pid"], event["tid"]), "").startswith("Stream #")
    ]
