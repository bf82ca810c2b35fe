"""The TTT-MLP backward benchmark runs end to end and its rows are consistent."""

from __future__ import annotations

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
    out = tmp_path / "r.json"
    assert main(["bench", "ttt-mlp-backward", "--lengths", "8", "--d-model", "8", "--heads", "2",
                 "--repeats", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["config"]["lengths"] == "8" and set(res["8"]) == {
        "softmax (SDPA)", "ttt-mlp", "ttt-mlp autograd"}
