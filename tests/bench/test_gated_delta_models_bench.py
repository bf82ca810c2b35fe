"""``python -m fastweights.bench.gated_delta_models``: rows for both candidates of every case,
their paired speed-ups, the files written, bad options refused (tiny sizes: the head layout is
Qwen3.5's, the hidden size and lengths are not)."""

from __future__ import annotations

import csv
import json

import pytest

pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed")

from fastweights.bench.gated_delta_models import main, run_gated_delta_models


def test_rows_for_both_candidates_of_every_case(tmp_path, capsys):
    rows = main(["--T", "6", "--dtypes", "float32", "--hidden", "32", "--layers", "4",
                 "--vocab", "64", "--model-T", "6", "--new-tokens", "2", "--repeats", "1",
                 "--decode-calls", "1", "--out", str(tmp_path)])
    cases = [(r.case, r.name) for r in rows]
    assert cases == [(c, n) for c in ("layer prefill", "layer decode", "model prefill",
                                      "model decode") for n in ("transformers", "fastweights")]
    for r in rows:
        assert r.repeats == 1 and 0 < r.min_s <= r.median_s <= r.max_s and r.tokens_per_s > 0
        assert r.speedup_min <= r.speedup <= r.speedup_max
    assert "| layer prefill | float32 | 6 |" in capsys.readouterr().out
    assert {p.name for p in tmp_path.iterdir()} == {"results.md", "results.csv", "meta.json",
                                                   "lscpu.txt"}
    with open(tmp_path / "results.csv") as f:
        assert len(list(csv.DictReader(f))) == 8
    assert "gated_delta_models" in json.loads((tmp_path / "meta.json").read_text())["command"]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"dtypes": ("float16",)}, "dtypes"), ({"cases": ("attention",)}, "cases"),
    ({"Ts": (0,)}, "T must be"), ({"repeats": 0}, "repeats")])
def test_bad_options_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        run_gated_delta_models(**kwargs)
