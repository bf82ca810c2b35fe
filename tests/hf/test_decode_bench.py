"""The decode benchmark script runs and reports a constant state for delta, a growing one for
softmax (tiny settings)."""

from __future__ import annotations

import json

from fastweights.bench.decode import main


def test_decode_bench_tiny(tmp_path, capsys):
    out = tmp_path / "decode.json"
    rows = main(["--contexts", "9", "20", "--d-model", "8", "--n-layers", "1", "--n-heads", "2",
                 "--vocab-size", "11", "--new-tokens", "3", "--prefill-chunk", "7",
                 "--out", str(out)])
    by = {(r["mixer"], r["context"]): r for r in rows}
    assert by["delta", 9]["state_bytes_after_prefill"] == by["delta", 20]["state_bytes_after_prefill"]
    assert by["delta", 20]["state_bytes_per_new_token"] == 0
    # softmax: K and V, 1 layer x 2 heads x 4 dims, float32, per token
    assert by["softmax", 20]["state_bytes_after_prefill"] == 20 * 2 * 8 * 4
    assert by["softmax", 20]["state_bytes_per_new_token"] == 2 * 8 * 4
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert json.loads(out.read_text())["results"] == rows
    assert "tokens/s" in capsys.readouterr().out
