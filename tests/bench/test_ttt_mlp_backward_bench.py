"""The TTT-MLP backward benchmark runs end to end and its rows are consistent."""

from __future__ import annotations

import csv
import json

from fastweights.bench import ttt_mlp_backward
from fastweights.cli import main


def test_times_every_variant(capsys):
    res = ttt_mlp_backward.run_ttt_mlp_backward([20], d_model=16, heads=2, repeats=1, group=2)
    row = res["20"]
    assert set(row) == {"softmax (SDPA)", "ttt-mlp", "ttt-mlp autograd", "ttt-mlp g2"}
    assert all(r["ms"] > 0 and r["saved_MiB"] > 0 for r in row.values())
    # the hand-written backward keeps less than autograd through the plain scan
    assert row["ttt-mlp"]["saved_MiB"] < row["ttt-mlp autograd"]["saved_MiB"]
    assert "ttt-mlp autograd" in capsys.readouterr().out


def test_command_writes_the_results(tmp_path):
    out = tmp_path / "r"
    assert main(["bench", "ttt-mlp-backward", "--lengths", "8", "--d-model", "8", "--heads", "2",
                 "--repeats", "1", "--out", str(out)]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["config"]["lengths"] == "8" and meta["benchmark"] == "ttt-mlp-backward"
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["T"] for r in rows} == {"8"} and {r["variant"] for r in rows} == {
        "softmax (SDPA)", "ttt-mlp", "ttt-mlp autograd"}
    assert all(float(r["ms"]) > 0 and float(r["saved_MiB"]) > 0 for r in rows)
    assert "| 8 | ttt-mlp autograd |" in (out / "results.md").read_text()
