"""`fastweights bench family-compare` and `fastweights bench ttt-modes` on tiny settings: the
functions return their rows, the commands print them and write what they promise."""

from __future__ import annotations

import csv
import json

from fastweights.bench import family_compare, ttt_modes
from fastweights.cli import main


def test_family_compare_rows_and_command(capsys):
    rows = family_compare.run_family_compare(["softmax", "norm", "no-such-mixer"], [16], d_model=8, heads=2,
                              repeats=1)
    assert [(r["mixer"], r["T"]) for r in rows] == [("softmax", 16), ("norm", 16)]
    assert rows[0]["vs_softmax"] == 1.0 and rows[1]["min_s"] > 0
    assert "skipped (not registered): no-such-mixer" in capsys.readouterr().out
    assert main(["bench", "family-compare", "--mixers", "diag", "--lengths", "8", "--d-model",
                 "8", "--heads", "2", "--repeats", "1"]) == 0
    assert "diag" in capsys.readouterr().out
    assert main(["bench", "family-compare", "--repeats", "0"]) == 2


def test_ttt_modes_results_and_record(tmp_path):
    out = tmp_path / "modes"
    assert main(["bench", "ttt-modes", "--seq-len", "16", "--head-dim", "4", "--heads", "1",
                 "--mini-batch-size", "4", "--repeats", "1", "--ops", "ttt_linear",
                 "--out", str(out)]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["config"]["T"] == 16 and meta["command"].startswith("fastweights bench ttt-modes")
    with open(out / "results.csv") as f:
        rows = {r["pass"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"forward", "forward+backward"}
    assert all(r["op"] == "ttt_linear" for r in rows.values())
    assert float(rows["forward"]["dual_s"]) > 0
    assert float(rows["forward+backward"]["primal_over_dual"]) > 0
    assert float(rows["forward"]["float64_max_abs_dual_minus_primal_T256"]) < 1e-10
    assert "| ttt_linear | forward |" in (out / "results.md").read_text()
    assert set(ttt_modes.run_ttt_modes(["ttt_mlp"], seq_len=8, head_dim=4, heads=1, mini_batch_size=4,
                             repeats=1)) == {"config", "ttt_mlp"}
