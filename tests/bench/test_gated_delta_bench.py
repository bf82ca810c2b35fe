"""``fastweights bench gated-delta`` (fastweights.bench.gated_delta): a row per candidate of every
(pass, thread count), the reference's paired ratio exactly 1, the files written (also by
``python -m fastweights bench gated-delta`` in a process of its own), and bad options refused."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
import torch

from fastweights.bench.gated_delta import run_gated_delta
from fastweights.cli import main


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


TINY = ["--T", "12", "--H", "1", "--D", "4", "--threads", "1", "--chunk-sizes", "4",
        "--passes", "fwd,step", "--repeats", "1", "--step-calls", "1"]


def test_command_writes_its_files(tmp_path):
    """The command in a process of its own (``python -m fastweights``, as a user runs it): the
    tables printed, the four files in --out, the command that repeats the run recorded; a
    second run into the same folder is refused without --overwrite, one line, exit 2."""
    out = tmp_path / "res"
    res = subprocess.run([sys.executable, "-m", "fastweights", "bench", "gated-delta", *TINY,
                          "--out", str(out)], capture_output=True, text=True, timeout=300,
                         check=False)
    assert res.returncode == 0, res.stderr
    assert "### fwd" in res.stdout and "### step" in res.stdout and "### fwdbwd" not in res.stdout
    assert (out / "results.md").read_text().startswith("B1 T12 H1 D4 float32")
    meta = json.loads((out / "meta.json").read_text())
    assert meta["command"].startswith("fastweights bench gated-delta --T 12 --B 1 --H 1 --D 4")
    assert meta["config"]["chunk_sizes"] == "4" and meta["config"]["repeats"] == 1
    with open(out / "results.csv") as f:
        assert len(list(csv.DictReader(f))) == 3 + 4
    assert (out / "lscpu.txt").exists()
    assert main(["bench", "gated-delta", *TINY, "--out", str(out)]) == 2  # already holds results


@pytest.mark.parametrize(("argv", "words"), [
    (["--passes", "fwd,bwd"], "--passes must be some of fwd, fwdbwd, step"),
    (["--threads", "0"], "--threads must be comma-separated positive integers"),
    (["--chunk-sizes", "a"], "--chunk-sizes must be"),
    (["--T", "0"], "--T: must be a positive integer"),
])
def test_command_refuses_bad_options(argv, words, capsys):
    assert main(["bench", "gated-delta", *argv]) == 2
    assert words in capsys.readouterr().err


def test_help_names_the_outputs(capsys):
    with pytest.raises(SystemExit) as done:
        main(["bench", "gated-delta", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "--out" in text and "results.csv" in text and "(default: 4096)" in text


@pytest.mark.parametrize("kwargs,words", [
    ({"T": 0}, "T must be >= 1"),
    ({"threads": ()}, "threads"),
    ({"chunk_sizes": (0,)}, "chunk_sizes"),
    ({"passes": ("fwd", "bwd")}, "passes"),
])
def test_bad_options(kwargs, words):
    with pytest.raises(ValueError, match=words):
        run_gated_delta(**kwargs)
