"""bench.step_profile on the tiny config, on CPU: each active count runs its program's steps from the engine's own
arguments, and each program's first step agrees with itself under the engine's options."""

import re

import numpy as np
import pytest
from paths import TINY_CONFIG

from bench.step_profile import main, report
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
