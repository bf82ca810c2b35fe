"""The recompute benchmark runs end to end and its rows are consistent."""

from __future__ import annotations

import json

from fastweights.bench.recompute import main


def test_recompute_bench_writes_both_settings(tmp_path):
    rows = main(["--mixers", "delta,softmax", "--lengths", "16", "--d-model", "16", "--n-heads",
                 "2", "--n-layers", "2", "--repeats", "1", "--out", str(tmp_path)])
    assert [(r["mixer"], r["recompute"]) for r in rows] == [
        ("delta", False), ("delta", True), ("softmax", False), ("softmax", True)]
    assert all(r["ms"] > 0 for r in rows)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["rows"] == rows and "--mixers delta,softmax" in saved["meta"]["command"]
    table = (tmp_path / "results.md").read_text()
    assert table.count("| delta | 16 |") == 1 and table.count("| softmax | 16 |") == 1
