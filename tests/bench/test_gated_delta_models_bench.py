"""``fastweights bench gated-delta-models`` (fastweights.bench.gated_delta_models): rows for both candidates of every case,
their paired speed-ups, the files written, bad options refused (tiny sizes: the head layout is
Qwen3.5's, the hidden size and lengths are not)."""

from __future__ import annotations

import csv
import json

import pytest

pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed")

from fastweights.bench.gated_delta_models import run_gated_delta_models
from fastweights.cli import main


def test_rows_for_both_candidates_of_every_case(tmp_path, capsys):
    assert main(["bench", "gated-delta-models", "--T", "6", "--dtypes", "float32", "--hidden",
                 "32", "--layers", "4", "--vocab", "64", "--model-T", "6", "--new-tokens", "2",
                 "--repeats", "1", "--decode-calls", "1", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.DictReader(f))
    cases = [(r["case"], r["name"]) for r in rows]
    assert cases == [(c, n) for c in ("layer prefill", "layer decode", "model prefill",
                                      "model decode") for n in ("transformers", "fastweights")]
    for r in rows:
        mn, md, mx = (float(r[n]) for n in ("min_s", "median_s", "max_s"))
        assert r["repeats"] == "1" and 0 < mn <= md <= mx and float(r["tokens_per_s"]) > 0
        assert float(r["speedup_min"]) <= float(r["speedup"]) <= float(r["speedup_max"])
    assert "| layer prefill | float32 | 6 |" in capsys.readouterr().out
    assert {p.name for p in tmp_path.iterdir()} == {"results.md", "results.csv", "meta.json",
                                                   "lscpu.txt"}
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["command"].startswith("fastweights bench gated-delta-models --T 6 --dtypes float32")
    assert meta["config"]["hidden"] == 32


@pytest.mark.parametrize(("argv", "words"), [
    (["--dtypes", "float16"], "--dtypes must be some of float32, bfloat16"),
    (["--cases", "attention"], "--cases must be some of layer, model"),
    (["--T", "0"], "--T must be comma-separated positive integers")])
def test_command_refuses_bad_options(argv, words, capsys):
    assert main(["bench", "gated-delta-models", *argv]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"dtypes": ("float16",)}, "dtypes"), ({"cases": ("attention",)}, "cases"),
    ({"Ts": (0,)}, "T must be"), ({"repeats": 0}, "repeats")])
def test_bad_options_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        run_gated_delta_models(**kwargs)
