"""The recompute benchmark runs end to end and its rows are consistent."""

from __future__ import annotations

import csv
import json

from fastweights.bench import recompute
from fastweights.cli import main


def test_recompute_bench_writes_both_settings(tmp_path):
    assert main(["bench", "recompute", "--mixers", "delta,softmax", "--lengths", "16",
                 "--d-model", "16", "--n-heads", "2", "--n-layers", "2", "--repeats", "1",
                 "--out", str(tmp_path)]) == 0
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["mixer"], r["recompute"]) for r in rows] == [
        ("delta", "False"), ("delta", "True"), ("softmax", "False"), ("softmax", "True")]
    assert all(float(r["ms"]) > 0 for r in rows)
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["command"].startswith("fastweights bench recompute --mixers delta,softmax")
    assert meta["benchmark"] == "recompute" and meta["n_layers"] == 2
    again = recompute.run_recompute(["delta"], [16], d_model=16, n_heads=2, n_layers=2, repeats=1)
    assert [(r["mixer"], r["recompute"]) for r in again] == [("delta", False), ("delta", True)]
    table = (tmp_path / "results.md").read_text()
    assert table.count("| delta | 16 |") == 1 and table.count("| softmax | 16 |") == 1


def test_fwp_forms_times_forward_and_backward(capsys):
    from fastweights.bench import fwp_forms

    rows = fwp_forms.run_fwp_forms(T=20, H=1, D=4, repeats=1, chunk_sizes=[4, 8], modes=["chunk"],
                         backward=True)
    assert len(rows) == 4 and all(r["ms"] > 0 and r["gflop_s"] > 0 for r in rows)
    out = capsys.readouterr().out
    assert "forward+backward" in out.splitlines()[0]
    assert all(f"{op}[chunk C={c}]" in out for op in ("delta_rule", "linear_attn") for c in (4, 8))
