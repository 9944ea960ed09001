"""bench.constraints on the tiny config: every kind and slot count is timed, and the record says what ran."""

import json

from paths import TINY_CONFIG

from bench.constraints import CONSTRAINTS, main


def test_every_kind_and_slot_count_is_timed(tmp_path, capsys):
    out = tmp_path / "constraints.json"
    main(["--config", str(TINY_CONFIG), "--slots", "1", "3", "--steps", "6", "--out", str(out)])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(row["kind"], row["slots"]) for row in rows] == [(kind, n) for kind in CONSTRAINTS for n in (1, 3)]
    for row in rows:
        assert 0 < row["fill_ms_median"] <= row["fill_ms_p90"] <= row["fill_ms_max"] and row["compile_ms"] > 0
    record = json.loads(out.read_text())
    assert record["rows"] == rows and record["command"].endswith("--steps 6 --out " + str(out))
