"""``fastweights bench gpu``: the prepared GPU benchmark, run as CI can: ``--dry-run`` (the same
code at tiny sizes on the CPU) in a subprocess, as a user would. Correctness only: that every
section's items ran or say why not, the PyTorch forms are exact against the float64 oracle, the
record is complete; no assertion depends on a time."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time

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
    state without a static form (AFT-local's and AFT-conv's windows not yet full after the dry
    run's short prompt) skipped with its reason."""
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
            if name in ("aft-local", "aft-conv"):  # the dry run's 16 tokens: windows not full
                assert "window - 1" in graph["status"], graph
            else:  # every other mixer has a static form, AFT-full's cache as buffers too
                assert graph["status"] == "ok" and float(graph["median_ms"]) > 0, graph


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
    with the resident kernels, forward and forward+backward timed; the opt-in kernels'
    exactness rows (resident TTT-Linear, TTT-MLP's cluster forward, TTT-Linear's CUDA
    forward; bfloat16 and float16 at head size 128, bfloat16 at 64) say why they did not run
    on the CPU; the record has the section's table."""
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
    for name in ("ttt_linear (resident)", "ttt_mlp (cluster)", "ttt_linear (cuda)"):
        exact = [r for r in rows if r["name"] == name]
        assert [(r["dtype"], r["shape"].split()[-1]) for r in exact] == [
            ("bfloat16", "D128"), ("float16", "D128"), ("bfloat16", "D64")]
        assert all(r["section"] == "exact" and r["status"].startswith("skipped:")
                   for r in exact)
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
    assert len(items) == len(gpu_paper.OPT_IN) * len(gpu_paper.EXACT) + 3 * len(s.lengths)


def test_calls_per_pass_follow_the_call_length():
    """Quick calls: an untimed warm-up and --repeats timed calls; slow ones: as many as fit a
    second, at least one, no warm-up (the first call, timed apart, warmed up)."""
    plan = gpu.gpu_plan
    assert plan.calls_and_warmup(0.001, 10) == (10, True)
    assert plan.calls_and_warmup(0.3, 10) == (3, False)
    assert plan.calls_and_warmup(12.0, 10) == (1, False)
    assert plan.pass_cost(12.0, 12.6, 10) == pytest.approx(24.6)
    assert plan.pass_cost(0.001, 0.5, 10) == pytest.approx(0.511)


def test_timed_calls_of_a_slow_pass(monkeypatch):
    """The pass's second call is the timed one where it is slow: two calls in all (the first
    apart), where the fixed rule took twelve."""
    durations = iter([13.0, 12.0, 12.0, 12.0])
    monkeypatch.setattr(gpu, "time_call", lambda call, device: next(durations))
    run = gpu.Run(gpu.GPU_SIZES, torch.device("cpu"), time.monotonic() + 1e6, ("triton",), 1.0)
    timed = gpu._timed(run, lambda: None)
    assert timed["first_call_s"] == 13.0 and timed["calls"] == 1
    assert timed["median_ms"] == 12000.0 and next(durations) == 12.0  # two of four used


def test_slow_first_calls_go_last():
    plan = gpu.gpu_plan
    costs = [("a", plan.Cost(1.0, 2.0)), ("slow", plan.Cost(40.0, 60.0)),
             ("b", plan.Cost(2.0, 3.0)), ("slower", plan.Cost(90.0, 95.0)),
             ("c", plan.Cost(0.5, 1.0))]
    assert plan.ordered(costs) == ["a", "b", "c", "slow", "slower"]


def test_the_required_rows_fit_one_call_on_an_h200():
    """Issue 43: every mixer's layer rows at T 4096 and 16384 and its training step fit one
    270 s call, by the H200 record's per-row times under the timing rule; and the run puts
    them first, slow first calls last."""
    plan = gpu.gpu_plan
    sizes = gpu.GPU_SIZES
    costs = plan.required_items(mixer_names(), sizes.layers[3], sizes.repeats)
    assert len(costs) == 3 * len(mixer_names())
    assert plan.expected_seconds(costs) < 270 - 15  # the matmul rate, imports: 15 s spare
    run = gpu.Run(sizes, torch.device("cpu"), 0.0, ("triton",), 1.0,
                  ops=tuple(op.name for op in gpu.KERNEL_OPS), mixers=tuple(mixer_names()))
    for item in gpu.plan(run, gpu.SECTIONS)[:len(costs)]:  # the deadline passed: each item
        item()  # writes its one row, skipped
    assert all(r["status"] == "skipped: time budget" for r in run.rows)
    rows = [f"{r['section']} {r['name']} {r['shape']}" for r in run.rows]
    assert len(rows) == len(set(rows)) == len(costs)
    assert rows[0] == "layers softmax B4 T4096 d1024 H8"
    assert rows[len(mixer_names())] == "train softmax B8 T2048 d1024 H8 L8"
    assert rows[-1] == "layers aft-full B4 T16384 d1024 H8"  # its first calls take 14 s


def test_skipped_rows_are_listed_in_the_record(tmp_path):
    out = tmp_path / "out"
    assert main(["bench", "gpu", "--dry-run", "--budget-s", "0.001", "--sections", "train",
                 "--mixers", "linear", "--out", str(out)]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["skipped"] == [f"train {n} auto B2 T32 d32 H2 L2 step"
                               for n in ("softmax", "linear")]


def test_the_cluster_rows_say_when_the_triton_kernel_ran_instead(monkeypatch):
    """On a GPU where the TTT-MLP cluster kernel cannot run (here: its build failed), its
    exactness rows are the Triton kernel's (the fallback): their status says so, with the
    reason; where it can run, they stay as measured."""
    from types import SimpleNamespace

    from fastweights.bench import gpu_paper
    from fastweights.ops.ttt import cluster

    run = gpu.Run(gpu.GPU_SIZES, torch.device("cuda"), 0.0, ("triton",), 1.0)
    monkeypatch.setattr(gpu_paper.torch, "empty", lambda *a, **k: None)
    tools = gpu_paper.Tools(lambda r, op, backend, dtype, docs: r.row(status="ok"), None, None,
                            {"ttt_mlp": SimpleNamespace(chunk=16)})
    for why in ("building it failed: nvcc failed: ...", None):
        monkeypatch.setattr(cluster, "problem", lambda q, Dv, Dh, b, why=why: why)
        gpu_paper.opt_in_exact(run, tools, "ttt_mlp (cluster)", torch.bfloat16, 128)
    assert [r["name"] for r in run.rows] == ["ttt_mlp (cluster)"] * 2
    assert run.rows[0]["status"] == "skipped: the Triton kernel ran, building it failed: nvcc failed: ..."
    assert run.rows[1]["status"] == "ok"
