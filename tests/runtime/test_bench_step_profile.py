"""bench.step_profile on the tiny config, on CPU: each active count runs its program's steps from the engine's own
arguments, and each program's first step agrees with itself under the engine's options."""

import re

import numpy as np
import pytest
from paths import TINY_CONFIG

from bench.step_profile import main, per_layer, report
from bench.timeline import Kernel


@pytest.mark.slow
def test_each_active_count_is_timed_on_its_program(capsys):
    main(["--config", str(TINY_CONFIG), "--slots", "4", "--active", "1", "4", "--repeats", "1"])
    printed = capsys.readouterr().out
    assert re.search(r"weights built on the device: [\d.]+ s", printed)
    programs = re.findall(r"step \[4 slots, (\d+) tokens\]: lowered", printed)
    assert programs and len(programs) == len(set(programs))
    assert printed.count("largest difference 0\n") == len(programs)
    for active in (1, 4):
        wall, dispatch = re.search(
            rf"^{active} active: wall time per step, back to back: ([\d.]+) ms; a dispatch on an idle device: "
            r"([\d.]+) ms$",
            printed,
            re.MULTILINE,
        ).groups()
        assert float(wall) > 0 and float(dispatch) > 0


def test_a_traces_kernels_are_reported_per_run_and_grouped_by_name(capsys):
    """Kernels of several runs from one trace: per run their count and summed time, and numbered instances of one
    kernel grouped under its name with their time per run, longest group first."""
    rng = np.random.default_rng()
    runs = int(rng.integers(2, 5))
    names = ["fusion.3", "fusion.12", "nvjet_sm90_tss_64x8", "experts_nvfp4_swiglu_mosaic_gpu_kernel"]
    durations = rng.uniform(1, 50, len(names))
    kernels = [
        Kernel(name, float(run * 1000 + i * 60), float(us))
        for run in range(runs)
        for i, (name, us) in enumerate(zip(names, durations, strict=True))
    ]
    report(kernels, runs)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"kernels: {len(names)}, {durations.sum() / 1e3:.3f} ms a step on the device"
    groups = {"fusion": durations[:2].sum(), "nvjet_sm90_tss_64x8": durations[2], names[3]: durations[3]}
    longest_first = sorted(groups.items(), key=lambda group: -group[1])
    want = [f"{us / 1e3:8.3f} ms {2 if name == 'fusion' else 1:5d}x {name}" for name, us in longest_first]
    assert printed[1:] == want


def test_a_steps_kernels_are_averaged_per_layer_by_expert_format():
    """Layers cut at each gate_up expert kernel: per expert format the mean start-to-start wall, kernel count and
    kernel time by kind; the kernels before the first layer's experts and after the last's are left out."""
    rng = np.random.default_rng()
    body = ["ragged_paged_attention_mosaic_gpu_kernel", "nvjet_sm90_tss_64x8", "input_reduce_fusion_3"]
    formats = ["nvfp4"] * int(rng.integers(2, 5)) + ["mxfp8"] * int(rng.integers(2, 4))
    kernels, clock, pieces = [Kernel("embedding_fusion", 0.0, 2.0)], 5.0, []
    for fmt in formats:
        piece = [f"experts_{fmt}_swiglu_mosaic_gpu_kernel", f"experts_{fmt}_matmul_mosaic_gpu_kernel", *body]
        piece += ["attn_res_norm_mosaic_gpu_kernel"] * int(rng.integers(1, 3))
        durations = rng.uniform(1, 40, len(piece))
        start = clock
        for name, us in zip(piece, durations, strict=True):
            kernels.append(Kernel(name, clock, float(us)))
            clock += float(us) + float(rng.uniform(0, 3))
        pieces.append((fmt, clock - start, len(piece), list(zip(piece, durations, strict=True))))
    kernels.append(Kernel("experts_mxfp8_swiglu_mosaic_gpu_kernel", clock, 30.0))  # the last layer's: left out
    kernels.append(Kernel("lm_head_nvjet", clock + 40, 90.0))
    lines = per_layer(kernels)
    assert len(lines) == 2
    for fmt, label in (("nvfp4", "NVFP4 experts"), ("mxfp8", "MXFP8 experts")):
        mine = [piece for piece in pieces if piece[0] == fmt]
        line = next(line for line in lines if line.startswith(f"per layer, {label} ({len(mine)}):"))
        wall = np.mean([piece[1] for piece in mine])
        count = np.mean([piece[2] for piece in mine])
        assert f"wall {wall:.1f} us, {count:.1f} kernels" in line
        for kind, prefix in (("attention", "ragged_paged"), ("attention-residual mix", "attn_res")):
            us = np.mean([sum(us for name, us in piece[3] if name.startswith(prefix)) for piece in mine])
            assert f"{kind} {us:.1f}," in line or line.endswith(f"{kind} {us:.1f}")
