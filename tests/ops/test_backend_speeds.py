"""The automatic backend choice ranks the kernel backends by the op's measured times
(ops/backend.py ``ranked``, the ops' speeds.py tables; docs/gpu.md "Which backend runs what"),
keeps the refusals and their fallback, and the tables are updated from records of
``fastweights bench gpu`` (fastweights/bench/speeds.py). No GPU: the device checks are stood
in for, the op is a stand-in registered for the test."""

from __future__ import annotations

import csv
import importlib
import json
import logging
import runpy

import pytest
import torch

from fastweights.bench import gpu, speeds
from fastweights.ops import backend as backends

OP = "speed_test_op"
TABLE = {"sm_90": {"shape": "B8 T2048 H16 D128 bfloat16", "source": "test",
                   "forward": {"fla": 2.0, "triton": 1.0}, "train": {"fla": 1.0, "triton": 3.0}},
         "sm_80": {"shape": "B8 T2048 H16 D128 bfloat16", "source": "test",
                   "forward": {"triton": 1.0}}}


@pytest.fixture
def gpu_op(monkeypatch):
    """``OP`` registered with both kernel backends and ``TABLE``, CPU tensors taken for an sm_90
    GPU's, every backend able to run unless ``refused[name]`` says why not."""
    monkeypatch.setitem(backends._REGISTRY, OP, backends._Registered(
        {"fla": (backends.Kernel(),), "triton": (backends.Kernel(),)}, {}, TABLE))
    monkeypatch.setattr(backends, "_on_cuda", lambda q: True)
    monkeypatch.setattr(backends, "device_kind", lambda device: "sm_90")
    monkeypatch.setattr(backends, "_logged", set())
    monkeypatch.setattr(backends, "_trials", {})
    monkeypatch.delenv(backends.ENV, raising=False)
    refused: dict[str, str] = {}
    monkeypatch.setattr(backends, "_why_not",
                        lambda name, op, q, mode, chunk, facts=None: refused.get(name))
    return refused


def test_ranked_orders_measured_backends_fastest_first(monkeypatch):
    monkeypatch.setitem(backends._REGISTRY, OP, backends._Registered({}, {}, TABLE))
    kinds = {"cuda:0": "sm_90", "cuda:1": "sm_80", "cuda:2": "sm_100"}
    monkeypatch.setattr(backends, "device_kind", lambda device: kinds[str(device)])
    assert backends.ranked(OP, "cuda:0", train=False) == ["triton", "fla"]
    assert backends.ranked(OP, "cuda:0", train=True) == ["fla", "triton"]
    # one backend measured: nothing to compare, the fixed order; an unmeasured kind likewise
    assert backends.ranked(OP, "cuda:1", train=False) == ["fla", "triton"]
    assert backends.ranked(OP, "cuda:2", train=True) == ["fla", "triton"]
    assert backends.ranked("not_an_op", "cuda:0", train=False) == ["fla", "triton"]


def test_device_kind():
    assert backends.device_kind("cpu") == "cpu"
    assert backends.device_kind(torch.device("meta")) == "meta"


def test_automatic_choice_takes_the_fastest_that_can_run(gpu_op, caplog):
    q = torch.zeros(1, 8, 1, 4)
    assert backends.choose_backend(OP, q, None, "chunk", 64) == "triton"  # forward: triton
    grad = torch.zeros(1, 8, 1, 4, requires_grad=True)
    assert backends.choose_backend(OP, grad, None, "chunk", 64) == "fla"  # training: fla
    with torch.no_grad():  # no gradients recorded: the forward's figures
        assert backends.choose_backend(OP, grad, None, "chunk", 64) == "triton"
    gpu_op["triton"] = "refused for the test"  # the fastest cannot run: the next one does
    with caplog.at_level(logging.INFO, logger=backends.__name__):
        assert backends.choose_backend(OP, q, None, "chunk", 64) == "fla"
    gpu_op["fla"] = "refused too"
    assert backends.choose_backend(OP, q, None, "chunk", 64) == "torch"
    # an explicit backend is not ranked
    gpu_op.clear()
    assert backends.choose_backend(OP, q, "fla", "chunk", 64) == "fla"


def test_a_failed_trial_of_the_fastest_falls_back_and_warns(gpu_op, caplog):
    """The trial run and its refusal logging are the same whatever the ranking: the fastest
    measured backend (triton, forward) fails its trial, the next one runs the call."""
    tried = []

    class Trial(backends.Trial):  # a trial without gradients whose triton run raises
        grad = False

        def __init__(self):  # no call to stand for
            pass

        def __call__(self, name):
            tried.append(name)
            if name == "triton":
                raise RuntimeError("a guard of the test")

    q = torch.zeros(1, 8, 1, 4)
    with caplog.at_level(logging.WARNING, logger=backends.__name__):
        assert backends.choose_backend(OP, q, None, "chunk", 64, Trial()) == "fla"
        assert backends.choose_backend(OP, q, None, "chunk", 64, Trial()) == "fla"
    assert tried == ["triton", "fla"]  # each tried once per key
    assert sum("failed a trial run" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("op", ["linear_attn", "delta_rule", "gated_delta_rule"])
def test_each_op_registers_its_table(op):
    """The table in the op's folder is what it registers, well formed: sm_XY kinds, forward
    and train times of the kernel backends in ms, and where they were measured."""
    table = importlib.import_module(f"fastweights.ops.{op}.speeds").SPEEDS
    importlib.import_module(f"fastweights.ops.{op}")
    assert backends._REGISTRY[op].speeds == table and table
    for kind, entry in table.items():
        assert kind.startswith("sm_") and kind[3:].isdigit()
        assert set(entry) <= {"shape", "source", "forward", "train"} and entry["source"]
        for p in ("forward", "train"):
            for name, ms in entry.get(p, {}).items():
                assert name in ("fla", "triton") and ms > 0


def _record(folder, device, rows, layout="record"):
    """A gpu record's meta.json and results.csv: versions in the machine block
    (bench/record.py), or at the top as records before it had them (``layout="old"``)."""
    folder.mkdir(parents=True)
    versions = {"torch": "2.x", "triton": "3.x"}
    meta = {"device": device, "fla": "0.6.0", "date": "2026-12-01 00:00:00",
            "sizes": {"ops": [[8, 2048], [2, 16384]], "ops_heads": [16, 128]},
            **({"machine": versions} if layout == "record" else versions)}
    (folder / "meta.json").write_text(json.dumps(meta))
    with open(folder / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=gpu.COLUMNS)
        w.writeheader()
        for name, backend, shape, p, ms, status in rows:
            w.writerow({c: "" for c in gpu.COLUMNS} | {
                "section": "ops", "name": name, "backend": backend, "dtype": "bfloat16",
                "shape": shape, "pass": p, "median_ms": ms, "status": status})
    return folder


def test_tables_update_from_a_bench_record(tmp_path):
    """The updater takes the kernel backends' ops rows at the first ops shape of a record,
    under the record's device kind, keeps the other kinds, and writes a table the op can load
    (the automatic choice then ranks by it)."""
    ops_dir = tmp_path / "ops"
    (ops_dir / "linear_attn").mkdir(parents=True)
    (ops_dir / "linear_attn" / "speeds.py").write_text(speeds.render("linear_attn", {
        "sm_80": TABLE["sm_80"], "sm_90": TABLE["sm_90"]}))
    s = "B8 T2048 H16 D128"
    rec = _record(tmp_path / "rec", "NVIDIA H200 (sm_90)", [
        ("linear_attn", "fla", s, "fwd", "0.5", "ok"),
        ("linear_attn", "triton", s, "fwd", "0.4", "ok"),
        ("linear_attn", "triton", s, "fwdbwd", "2.0", "ok"),
        ("linear_attn", "fla", s, "fwdbwd", "", "skipped: time budget"),
        ("linear_attn", "torch", s, "fwd", "9.0", "ok"),  # not a kernel backend
        ("linear_attn", "triton", "B2 T16384 H16 D128", "fwd", "7.0", "ok"),  # another shape
    ])
    assert speeds.update([rec], ops_dir) == [ops_dir / "linear_attn" / "speeds.py"]
    table = runpy.run_path(str(ops_dir / "linear_attn" / "speeds.py"))["SPEEDS"]
    assert table["sm_80"] == TABLE["sm_80"]  # untouched
    assert table["sm_90"]["forward"] == {"fla": 0.5, "triton": 0.4}
    assert table["sm_90"]["train"] == {"triton": 2.0}
    assert table["sm_90"]["shape"] == f"{s} bfloat16" and str(rec) in table["sm_90"]["source"]
    assert "torch 2.x, Triton 3.x, fla 0.6.0" in table["sm_90"]["source"]
    with pytest.raises(ValueError, match="sm_XY"):
        speeds.device_kind("CPU something")
    with pytest.raises(ValueError, match="no op folder"):
        speeds.update([_record(tmp_path / "rec2", "NVIDIA H200 (sm_90)",
                               [("new_op", "triton", s, "fwd", "1.0", "ok")])], ops_dir)


def test_the_command_updates_and_refuses_what_is_not_a_record(tmp_path, monkeypatch, capsys):
    from fastweights.cli import main

    ops_dir = tmp_path / "ops"
    (ops_dir / "delta_rule").mkdir(parents=True)
    monkeypatch.setattr(speeds, "OPS_DIR", ops_dir)
    rec = _record(tmp_path / "rec", "NVIDIA H100 80GB HBM3 (sm_90)",
                  [("delta_rule", "fla", "B8 T2048 H16 D128", "fwd", "1.5", "ok")], "old")
    assert main(["bench", "speeds", str(rec)]) == 0
    assert "wrote" in capsys.readouterr().out
    table = runpy.run_path(str(ops_dir / "delta_rule" / "speeds.py"))["SPEEDS"]
    assert table["sm_90"]["forward"] == {"fla": 1.5}
    assert "torch 2.x, Triton 3.x" in table["sm_90"]["source"]  # an older record's layout
    assert main(["bench", "speeds", str(tmp_path)]) == 2
    assert "not a record" in capsys.readouterr().err
