"""``python -m fastweights.bench.gated_delta``: a row per candidate of every (pass, thread count),
the reference's paired ratio exactly 1, the files written, and bad options refused."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from fastweights.bench.gated_delta import main, run_gated_delta


def test_rows_per_pass_and_thread_count():
    rows = run_gated_delta(T=20, H=2, D=4, threads=(1,), chunk_sizes=(8, 4), repeats=2,
                           step_calls=2)
    by_pass = {p: [r for r in rows if r.pass_ == p] for p in ("fwd", "fwdbwd", "step")}
    assert [r.name for r in by_pass["fwd"]] == [
        "gated_delta_rule C=8", "delta_rule C=8", "transformers torch_chunk_gated_delta_rule C=8",
        "gated_delta_rule C=4", "delta_rule C=4", "transformers torch_chunk_gated_delta_rule C=4"]
    assert len(by_pass["fwdbwd"]) == 6 and len(by_pass["step"]) == 4
    for r in rows:
        if r.status != "ok":  # transformers not installed
            assert r.name.startswith("transformers") and r.status.startswith("skipped")
            continue
        assert r.threads == 1 and r.repeats == 2
        assert 0 < r.min_s <= r.median_s <= r.max_s
        assert r.ratio_min <= r.ratio <= r.ratio_max
        if r.name == r.reference:
            assert r.ratio == r.ratio_min == r.ratio_max == 1.0
    assert torch.get_num_threads() >= 1


def test_command_writes_its_files(tmp_path, capsys):
    out = tmp_path / "res"
    main(["--T", "12", "--H", "1", "--D", "4", "--threads", "1", "--chunk-sizes", "4",
          "--passes", "fwd,step", "--repeats", "1", "--step-calls", "1", "--out", str(out)])
    text = capsys.readouterr().out
    assert "### fwd" in text and "### step" in text and "### fwdbwd" not in text
    assert (out / "results.md").read_text().startswith("B1 T12 H1 D4 float32")
    meta = json.loads((out / "meta.json").read_text())
    assert meta["command"].startswith("python -m fastweights.bench.gated_delta --T 12")
    with open(out / "results.csv") as f:
        assert len(list(csv.DictReader(f))) == 3 + 4
    assert (out / "lscpu.txt").exists()


@pytest.mark.parametrize("kwargs,words", [
    ({"T": 0}, "T must be >= 1"),
    ({"threads": ()}, "threads"),
    ({"chunk_sizes": (0,)}, "chunk_sizes"),
    ({"passes": ("fwd", "bwd")}, "passes"),
])
def test_bad_options(kwargs, words):
    with pytest.raises(ValueError, match=words):
        run_gated_delta(**kwargs)
