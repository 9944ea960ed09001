"""bench.step_profile on the tiny config, on CPU: each active count runs its program's steps from the engine's own
arguments, and each program's first step agrees with itself under the engine's options."""

import re

import pytest
from paths import TINY_CONFIG

from bench.step_profile import main


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
