"""The TTT-MLP backward benchmark runs end to end and its rows are consistent."""

from __future__ import annotations

from fastweights.bench.ttt_mlp_backward import main


def test_times_every_variant(capsys):
    res = main(["--lengths", "20", "--d-model", "16", "--heads", "2", "--repeats", "1",
                "--group", "2"])
    row = res["20"]
    assert set(row) == {"softmax (SDPA)", "ttt-mlp", "ttt-mlp autograd", "ttt-mlp g2"}
    assert all(r["ms"] > 0 and r["saved_MiB"] > 0 for r in row.values())
    # the hand-written backward keeps less than autograd through the plain scan
    assert row["ttt-mlp"]["saved_MiB"] < row["ttt-mlp autograd"]["saved_MiB"]
    assert "ttt-mlp autograd" in capsys.readouterr().out
