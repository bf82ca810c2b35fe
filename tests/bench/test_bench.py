"""fastweights bench: the quick preset end to end, the FLOP counter, output safety, bad options.

Correctness only: no assertion here depends on how fast anything runs.
"""

from __future__ import annotations

import csv
import importlib.util

import pytest
import torch

from fastweights.bench.measure import PeakMemory, count_flops, prepare_cpu_memory_accounting
from fastweights.cli import main

QUICK = ["bench", "--quick", "--mixers", "delta", "--lengths", "8,16", "--repeats", "1",
         "--no-progress"]


def test_quick_preset_end_to_end(tmp_path):
    out = tmp_path / "res"
    assert main([*QUICK, "--ops", "--out", str(out)]) == 0
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    targets = {r["target"] for r in rows}
    # the softmax baseline is always added; the op-level forms come with --ops
    assert {"softmax", "delta", "delta_rule[chunk]", "delta_rule[recurrent]",
            "delta_rule[naive]", "linear_attn[chunk]", "softmax_attention"} <= targets
    assert {(r["pass"], r["T"]) for r in rows if r["target"] == "delta"} == {
        (p, T) for p in ("fwd", "fwdbwd", "decode") for T in ("8", "16")}
    for r in rows:
        if r["status"] == "ok":
            assert float(r["time_s"]) > 0 and float(r["tokens_per_s"]) > 0
            assert float(r["flops"]) >= 0 and int(r["repeats"]) >= 1
    ok = {(r["target"], r["pass"], r["T"]): r for r in rows if r["status"] == "ok"}
    assert float(ok[("softmax", "fwd", "16")]["speedup_vs_softmax"]) == 1.0
    md = (out / "results.md").read_text()
    assert "## fwd" in md and "## decode" in md and "GFLOP/s" in md and "## Method" in md
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "time_vs_T.png").stat().st_size > 0
        assert (out / "memory_vs_T.png").stat().st_size > 0


def test_flop_counter_matmul_exact():
    a, b = torch.randn(7, 5, 3), torch.randn(7, 3, 11)
    assert count_flops(lambda: a @ b) == 2 * 7 * 5 * 3 * 11
    x, w = torch.randn(13, 17), torch.randn(19, 17)
    assert count_flops(lambda: torch.nn.functional.linear(x, w)) == 2 * 13 * 17 * 19


def test_flop_counter_cpu_attention_and_triangular_solve():
    q = torch.randn(2, 3, 10, 4)  # [B, H, T, D]
    dense = 2 * 2 * (2 * 3 * 10 * 10 * 4)  # q k^T and p v, 2 FLOPs per multiply-add
    assert count_flops(
        lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)) == dense
    A = torch.eye(6).expand(4, 6, 6)
    assert count_flops(
        lambda: torch.linalg.solve_triangular(A, torch.randn(4, 6, 5), upper=False)) == 4 * 36 * 5


@pytest.mark.skipif(not prepare_cpu_memory_accounting(), reason="needs Linux /proc and glibc")
def test_peak_memory_sees_a_known_allocation():
    size = 32 * 2**20
    with PeakMemory(torch.device("cpu")) as pm:
        x = torch.ones(size // 4)
        del x
    assert 0.95 * size <= pm.peak < size + 4 * 2**20


def test_refuses_to_overwrite(tmp_path, capsys):
    out = tmp_path / "res"
    out.mkdir()
    (out / "results.csv").write_text("precious\n")
    assert main([*QUICK, "--passes", "fwd", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--overwrite" in err
    assert (out / "results.csv").read_text() == "precious\n"
    assert main([*QUICK, "--passes", "fwd", "--out", str(out), "--overwrite"]) == 0
    assert (out / "results.csv").read_text().startswith("target,")


@pytest.mark.parametrize("bad, word", [
    (["--mixers", "nosuchmixer"], "--mixers"),
    (["--lengths", "0"], "--lengths"),
    (["--lengths", "16,-4"], "--lengths"),
    (["--passes", "fwd,sideways"], "--passes"),
    (["--repeats", "zero"], "--repeats"),
    (["--time-budget", "-1"], "--time-budget"),
    (["--d-model", "30", "--n-heads", "4"], "--d-model"),
    (["--dtype", "int8"], "--dtype"),
    (["--op-forms", "linear_attn[sideways]"], "--op-forms"),
], ids=["unknown-mixer", "zero-length", "negative-length", "unknown-pass", "repeats-not-int",
        "negative-budget", "heads-not-dividing", "bad-dtype", "unknown-op-form"])
def test_bad_arguments_exit_2_with_one_line(tmp_path, capsys, bad, word):
    out = tmp_path / "never"
    assert main([*QUICK, "--out", str(out), *bad]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and word in err
    assert not out.exists()


def test_over_budget_lengths_are_skipped_with_reason(tmp_path):
    out = tmp_path / "res"
    args = [*QUICK, "--mixers", "linear", "--passes", "fwd", "--lengths", "8,64,512",
            "--time-budget", "1e-7", "--out", str(out)]
    assert main(args) == 0
    with open(out / "results.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["target"] == "linear"]
    assert [r["T"] for r in rows] == ["8", "64", "512"]
    assert rows[0]["status"] == "ok"  # the smallest length always runs
    assert all(r["status"].startswith("skipped: predicted") for r in rows[1:])
    assert "skipped: predicted" in (out / "results.md").read_text()


def test_mixer_options_in_the_mixer_list(tmp_path, capsys):
    """--mixers accepts name:opt=value, benchmarks each spec as its own row, and rejects bad
    option names or values before measuring anything."""
    out = tmp_path / "b"
    assert main(["bench", "--quick", "--mixers", "delta,delta:chunk_size=4", "--passes", "fwd",
                 "--lengths", "8", "--repeats", "1", "--no-progress", "--out", str(out)]) == 0
    rows = list(csv.DictReader((out / "results.csv").read_text().splitlines()))
    assert {"delta", "delta:chunk_size=4"} <= {r["target"] for r in rows}
    for bad, words in [("delta:chunk_size=0", "chunk_size"), ("delta:colour=red", "unknown option")]:
        capsys.readouterr()
        assert main(["bench", "--quick", "--mixers", bad, "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err
        assert not (tmp_path / "x" / "results.csv").exists()
