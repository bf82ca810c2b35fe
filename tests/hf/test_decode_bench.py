"""The decode benchmark (`fastweights bench decode`) runs and reports a constant state for
delta, a growing one for softmax (tiny settings)."""

from __future__ import annotations

import csv
import json

from fastweights.bench import decode
from fastweights.cli import main

TINY = ["--contexts", "9", "20", "--d-model", "8", "--n-layers", "1", "--n-heads", "2",
        "--vocab-size", "11", "--new-tokens", "3", "--prefill-chunk", "7"]


def test_decode_bench_tiny(tmp_path, capsys):
    out = tmp_path / "decode"
    assert main(["bench", "decode", *TINY, "--out", str(out)]) == 0
    with open(out / "results.csv") as f:  # the record (bench/record.py): numbers as text
        rows = [{k: v if k in ("mixer", "decode_mode") else float(v) if v else None
                 for k, v in r.items()} for r in csv.DictReader(f)]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["benchmark"] == "decode" and meta["config"]["new_tokens"] == 3
    assert "| delta | 9 |" in (out / "results.md").read_text()
    by = {(r["mixer"], r["context"]): r for r in rows}
    assert by["delta", 9]["state_bytes_after_prefill"] == by["delta", 20]["state_bytes_after_prefill"]
    assert by["delta", 20]["state_bytes_per_new_token"] == 0
    # softmax: K and V, 1 layer x 2 heads x 4 dims, float32, per token
    assert by["softmax", 20]["state_bytes_after_prefill"] == 20 * 2 * 8 * 4
    assert by["softmax", 20]["state_bytes_per_new_token"] == 2 * 8 * 4
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert "tokens/s" in capsys.readouterr().out
    # the function returns the rows the command writes
    again = decode.run_decode(["delta"], [9], d_model=8, n_layers=1, n_heads=2, vocab_size=11,
                       new_tokens=3, prefill_chunk=7)
    assert [set(r) for r in again] == [set(by["delta", 9])]
    assert again[0]["state_bytes_after_prefill"] == by["delta", 9]["state_bytes_after_prefill"]


def test_decode_bench_refuses_bad_settings_in_one_line(capsys):
    assert main(["bench", "decode", "--contexts", "0"]) == 2
    assert "--contexts" in capsys.readouterr().err
