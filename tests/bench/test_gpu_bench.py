"""``fastweights bench gpu``: the prepared GPU benchmark, run as CI can: ``--dry-run`` (the same
code at tiny sizes on the CPU) in a subprocess, as a user would. Correctness only: that every
section's items ran or say why not, the PyTorch forms are exact against the float64 oracle, the
record is complete; no assertion depends on a time."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
import torch

from fastweights.bench import gpu
from fastweights.cli import main
from fastweights.models.registry import mixer_names


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "gpu"
    run = subprocess.run([sys.executable, "-m", "fastweights", "bench", "gpu", "--dry-run",
                          "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    return out, rows, run.stdout


def _ok(rows, **match):
    return [r for r in rows if r["status"] == "ok" and all(r[k] == v for k, v in match.items())]


def test_dry_run_writes_the_record(dry_run):
    out, rows, stdout = dry_run
    assert {p.name for p in out.iterdir()} == set(gpu.OUTPUT_FILES)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dry_run"] is True and meta["sections"] == list(gpu.SECTIONS)
    assert meta["command"].startswith("fastweights bench gpu")
    text = (out / "results.md").read_text()
    for title in ("Kernel exactness", "Ops, bfloat16", "Layers", "Training step"):
        assert title in text
    assert f"{len(rows)} rows (0 failed)" in stdout
    assert not [r for r in rows if r["status"].startswith("failed")]


def test_dry_run_checks_the_pytorch_forms_against_float64(dry_run):
    """On the CPU the kernel backends are rows that say why they did not run; the PyTorch
    chunked form of every kernel op ran, dense and packed, and is within bfloat16/float16
    rounding of the float64 naive form, outputs, states and gradients."""
    _, rows, _ = dry_run
    exact = [r for r in rows if r["section"] == "exact"]
    for r in exact:
        if r["backend"] in ("triton", "fla"):
            assert r["status"].startswith("skipped:"), r
            assert "CUDA" in r["status"] or f"no {r['backend']} kernel" in r["status"].replace(
                "Triton", "triton"), r
    for op in gpu.KERNEL_OPS:
        for case in ("dense", "packed"):
            got = _ok(exact, name=op.name, backend="torch", **{"pass": case})
            assert got, (op.name, case)
            for r in got:
                tol = 2e-2 if r["dtype"] == "bfloat16" else 3e-3
                assert max(float(r[k]) for k in ("err_out", "err_state", "err_grad")) < tol, r


def test_dry_run_times_every_op_layer_and_training_step(dry_run):
    _, rows, _ = dry_run
    ops = _ok(rows, section="ops")
    assert {r["name"] for r in ops} == {op.name for op in gpu.KERNEL_OPS} | {
        "softmax (SDPA, causal)"}
    for name in mixer_names():
        for p in ("fwd", "fwdbwd", "decode"):
            (r,) = _ok(rows, section="layers", name=name, **{"pass": p})
            assert float(r["median_ms"]) > 0 and float(r["first_call_s"]) > 0
        (fwd,) = _ok(rows, section="layers", name=name, **{"pass": "fwd"})
        assert float(fwd["tflops"]) > 0 and fwd["vs_baseline"]
        (step,) = _ok(rows, section="train", name=name)
        assert float(step["tokens_per_s"]) > 0 and step["vs_baseline"]


def test_dry_run_plans_a_decode_row_per_mixer_eager_and_graph(dry_run):
    """The decode section: every mixer at both batch sizes, eager and on the static buffers
    (captured as a CUDA graph on a GPU; without capture in the dry run), the graph row of a
    mixer without a static form skipped with its reason."""
    from fastweights.bench.gpu_decode import DRY_DECODE

    _, rows, _ = dry_run
    for B in DRY_DECODE.batches:
        for name in mixer_names():
            shape = {"section": "decode", "name": name}
            got = [r for r in rows if r["section"] == "decode" and r["name"] == name
                   and r["shape"].startswith(f"B{B} ")]
            assert {r["pass"] for r in got} == {"eager", "graph"}, (name, B, got)
            (eager,) = _ok(got, **shape, **{"pass": "eager"})
            assert float(eager["median_ms"]) > 0
            (graph,) = [r for r in got if r["pass"] == "graph"]
            if name == "aft-full":
                assert "no static decoding form" in graph["status"]


def test_a_spent_budget_skips_items_and_says_so(tmp_path):
    out = tmp_path / "out"
    assert main(["bench", "gpu", "--dry-run", "--budget-s", "0.001", "--sections", "ops,train",
                 "--out", str(out)]) == 0
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    timed = [r for r in rows if r["backend"] in ("sdpa", "torch", "auto")]
    assert timed and all(r["status"] == "skipped: time budget" for r in timed)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_a_gpu_it_refuses_in_one_line(tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["bench", "gpu", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--dry-run" in err and "CUDA" in err
    assert not out.exists()


def test_bad_sections_and_existing_results_are_refused(tmp_path, capsys):
    assert main(["bench", "gpu", "--dry-run", "--sections", "exact,speed",
                 "--out", str(tmp_path / "a")]) == 2
    assert "--sections" in capsys.readouterr().err
    out = tmp_path / "b"
    out.mkdir()
    (out / "results.csv").write_text("mine\n")
    assert main(["bench", "gpu", "--dry-run", "--out", str(out)]) == 2
    assert (out / "results.csv").read_text() == "mine\n"


def test_ops_and_mixers_restrict_the_sections_softmax_stays(tmp_path, capsys):
    out = tmp_path / "few"
    assert main(["bench", "gpu", "--dry-run", "--sections", "exact,layers", "--ops", "ttt_mlp",
                 "--mixers", "ttt-mlp", "--out", str(out)]) == 0
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["name"] for r in rows if r["section"] == "exact"} == {"ttt_mlp"}
    assert {r["name"] for r in rows if r["section"] == "layers"} == {"softmax", "ttt-mlp"}
    assert _ok(rows, section="layers", name="ttt-mlp", **{"pass": "fwd"})[0]["vs_baseline"]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["ops"] == ["ttt_mlp"] and meta["mixers"] == ["softmax", "ttt-mlp"]
    for flag, bad in (("--ops", "ttt_linear,attention"), ("--mixers", "ttt-mlp,transformer")):
        assert main(["bench", "gpu", "--dry-run", flag, bad, "--out", str(tmp_path / "x")]) == 2
        assert flag in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_timed_calls_shrink_to_fit_the_budget_never_below_one():
    """An item that started inside the budget times fewer calls (at least one) rather than
    overrun it, and says how many (the calls column)."""
    import time

    calls = []
    sizes = gpu.dataclasses.replace(gpu.DRY_SIZES, repeats=5)

    def run_at(deadline):
        calls.clear()
        run = gpu.Run(sizes, torch.device("cpu"), deadline, ("triton",), 1.0)
        return gpu._timed(run, lambda: calls.append(time.sleep(0.01)))

    assert run_at(time.monotonic() + 1000)["calls"] == 5 and len(calls) == 7
    assert run_at(time.monotonic())["calls"] == 1 and len(calls) == 3


def test_dry_run_plans_the_paper_section(dry_run):
    """The ``paper`` section at the dry run's tiny shape: softmax, TTT-Linear and TTT-Linear
    with the resident kernels, forward and forward+backward timed; the resident kernels'
    exactness rows (bfloat16 and float16 at head size 128, bfloat16 at 64) say why they did not
    run on the CPU; the record has the section's table."""
    from fastweights.bench import gpu_paper

    out, rows, _ = dry_run
    s = gpu_paper.PAPER_DRY
    for T in s.lengths:
        for name, _, _ in gpu_paper.LAYERS:
            for p in ("fwd", "fwdbwd"):
                (r,) = _ok(rows, section="paper", name=name, shape=gpu_paper.shape_name(s, T),
                           **{"pass": p})
                assert float(r["median_ms"]) > 0
                assert r["vs_baseline"]  # against softmax at the same shape and pass
    exact = [r for r in rows if r["name"] == "ttt_linear (resident)"]
    assert [(r["dtype"], r["shape"].split()[-1]) for r in exact] == [
        ("bfloat16", "D128"), ("float16", "D128"), ("bfloat16", "D64")]
    assert all(r["section"] == "exact" and r["status"].startswith("skipped:") for r in exact)
    assert gpu_paper.TITLE in (out / "results.md").read_text()


def test_paper_section_is_the_papers_layer_on_a_gpu():
    """On a GPU the section runs the TTT paper's 1.3B layer (Sun et al. 2024): d_model 2048,
    32 heads of 64, mini-batches of 16, batch 4, at T 2k, 8k and 32k, softmax at the same
    shape, three layers per length (planned, not run: no GPU here)."""
    from fastweights.bench import gpu_paper

    s = gpu_paper.paper_shape(torch.device("cuda"))
    assert (s.batch, s.d_model, s.heads, s.d_model // s.heads, s.mini_batch) == (
        4, 2048, 32, 64, 16)
    assert s.lengths == (2048, 8192, 32768)
    assert [m for _, m, _ in gpu_paper.LAYERS] == ["softmax", "ttt-linear", "ttt-linear"]
    assert [resident for _, _, resident in gpu_paper.LAYERS] == [False, False, True]
    run = gpu.Run(gpu.GPU_SIZES, torch.device("cuda"), 0.0, ("triton",), 1.0)
    items = gpu.plan(run, ("paper",))
    assert len(items) == len(gpu_paper.EXACT) + 3 * len(s.lengths)
