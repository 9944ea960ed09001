"""bench.timeline: a trace's GPU kernels laid out in time (busy, idle, gaps, time by kind) against a count over a
grid of microseconds, and the kernels read from a trace file as the profiler writes it."""

import dataclasses
import gzip
import json

import numpy as np
import pytest

from bench.timeline import XLA_KERNELS, Kernel, kind_of, layout, trace_kernels

NAMES = ["experts_nvfp4_swiglu_mosaic_gpu_kernel", "nvjet_sm90_tss_64x8", "loop_add_fusion", "memcpy32_post"]


def random_kernels(rng: np.random.Generator, count: int) -> list[Kernel]:
    """Kernels at whole microseconds, some overlapping (side by side on two streams), some with gaps between."""
    starts = np.cumsum(rng.integers(0, 12, count))
    durations = rng.integers(1, 15, count)
    return [Kernel(str(rng.choice(NAMES)), float(s), float(d)) for s, d in zip(starts, durations, strict=True)]


@pytest.mark.parametrize("seed", range(4))
def test_the_layout_counts_every_microsecond_once(seed):
    rng = np.random.default_rng(seed)
    kernels = random_kernels(rng, int(rng.integers(20, 200)))
    runs = int(rng.integers(1, 5))
    first = min(k.start_us for k in kernels)
    last = max(k.start_us + k.duration_us for k in kernels)
    covered = np.zeros(int(last - first), bool)
    for k in kernels:
        covered[int(k.start_us - first) : int(k.start_us - first + k.duration_us)] = True
    gaps = np.count_nonzero(np.diff(covered.astype(int)) == -1)  # each uncovered stretch follows a covered one

    shuffled = [kernels[i] for i in rng.permutation(len(kernels))]
    result = layout(shuffled, runs)
    assert result.span_ms == pytest.approx((last - first) / 1e3 / runs)
    assert result.busy_ms == pytest.approx(covered.sum() / 1e3 / runs)
    assert result.idle_ms == pytest.approx((~covered).sum() / 1e3 / runs)
    assert result.gaps == pytest.approx(gaps / runs)
    assert result.kernels == pytest.approx(len(kernels) / runs)
    assert sum(result.by_kind_ms.values()) == pytest.approx(sum(k.duration_us for k in kernels) / 1e3 / runs)
    nvfp4 = sum(k.duration_us for k in kernels if k.name.startswith("experts_nvfp4")) / 1e3 / runs
    assert result.by_kind_ms.get("NVFP4 experts", 0.0) == pytest.approx(nvfp4)


def test_kernels_are_sorted_into_kinds():
    assert kind_of("experts_mxfp8_matmul_mosaic_gpu_kernel") == "MXFP8 experts"
    assert kind_of("anonymous_mosaic_gpu_kernel") == "Mosaic GPU kernels"
    assert kind_of("ragged_paged_attention_mosaic_gpu_kernel") == "attention"
    assert kind_of("attn_res_norm_mosaic_gpu_kernel") == "attention-residual mix"
    assert kind_of("nvjet_sm90_tss_512x8_64x3_2x1_v_ssched_bz_TNT") == "cuBLAS gemms"
    assert kind_of("input_reduce_fusion_12") == XLA_KERNELS


def test_the_kernels_are_read_from_the_gpus_streams_only(tmp_path):
    rng = np.random.default_rng(5)
    kernels = random_kernels(rng, 30)
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 7, "args": {"name": "Stream #13(Compute)"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 8, "args": {"name": "XLA Ops"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #13(host copy)"}},
    ]
    for k in kernels:
        events.append({"ph": "X", "pid": 2, "tid": 7, "name": k.name, "ts": k.start_us, "dur": k.duration_us})
        events.append({"ph": "X", "pid": 2, "tid": 8, "name": "an op's summary", "ts": k.start_us, "dur": 1})
        events.append({"ph": "X", "pid": 1, "tid": 7, "name": "host work", "ts": k.start_us, "dur": 3})
    folder = tmp_path / "plugins" / "profile" / "2026_12_06"
    folder.mkdir(parents=True)
    with gzip.open(folder / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": [events[i] for i in rng.permutation(len(events))]}, f)
    assert sorted(trace_kernels(tmp_path), key=dataclasses.astuple) == sorted(kernels, key=dataclasses.astuple)
    with pytest.raises(FileNotFoundError, match="no profiler trace"):
        trace_kernels(tmp_path / "elsewhere")
