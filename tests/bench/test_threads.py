"""fastweights bench --threads: thread counts interleaved round by round in one process, every
figure per count with the speed-up from the first, and the scans' parallel width.

Correctness only: no assertion depends on how fast anything runs or how it scales.
"""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch

from fastweights.bench.measure import time_rounds
from fastweights.bench.runner import run_targets
from fastweights.bench.targets import (
    Setting,
    Target,
    Workload,
    mixer_targets,
    op_targets,
    scan_width,
)
from fastweights.cli import main

CPU = torch.device("cpu")


@pytest.mark.parametrize("bad", ["0", "a", "1,0", "2,2", ",", "1.5"],
                         ids=["zero", "letter", "zero-in-list", "twice", "empty", "fraction"])
def test_bad_threads_exit_2_with_one_line(tmp_path, capsys, bad):
    out = tmp_path / "never"
    assert main(["bench", "--quick", "--mixers", "delta", "--threads", bad,
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--threads" in err
    assert not out.exists()


def test_time_rounds_interleaves_counts_round_by_round():
    seen = []
    calls = [lambda: seen.append(("a", torch.get_num_threads())),
             lambda: seen.append(("b", torch.get_num_threads()))]
    before = torch.get_num_threads()
    times = time_rounds(calls, [2, 1], 3, CPU)
    assert seen == [("a", 2), ("b", 2), ("a", 1), ("b", 1)] * 3
    assert torch.get_num_threads() == before
    assert [[len(per_call) for per_call in per_count] for per_count in times] == [[3, 3], [3, 3]]


def test_runner_warms_up_then_interleaves_every_count(monkeypatch):
    """One config at threads (2, 1): a warm-up call per count, then rounds 2, 1, 2, 1, ...; the
    FLOP count at the caller's count and a memory probe per count; one row per count."""
    seen: list[int] = []

    def build(T: int, s: Setting) -> Workload:
        def forward() -> None:
            seen.append(torch.get_num_threads())
        return Workload(forward, forward, None, None, 1, no_decode_reason="none")

    target = Target("probe", "op", build)
    setting = Setting(1, 4, 2, torch.float32, CPU)
    before = torch.get_num_threads()
    rows = run_targets([target], [8], ["fwd"], setting, repeats=3, budget=60.0,
                       memory_limit=math.inf, memory=False, progress=False, threads=[2, 1])
    assert seen == [2, 1] + [2, 1] * 3 + [before] + [2, 1]
    assert [(r.threads, r.status, r.repeats) for r in rows] == [(2, "ok", 3), (1, "ok", 3)]
    assert rows[0].speedup == rows[0].speedup_min == rows[0].speedup_max == 1.0
    assert rows[1].time_min_s <= rows[1].time_s <= rows[1].time_max_s
    assert rows[1].speedup_min <= rows[1].speedup <= rows[1].speedup_max
    assert torch.get_num_threads() == before


def test_quick_run_writes_every_count_and_the_speedup(tmp_path):
    out = tmp_path / "res"
    assert main(["bench", "--quick", "--mixers", "delta", "--lengths", "64", "--repeats", "2",
                 "--passes", "fwd,decode", "--threads", "1,2", "--peers", "--no-progress",
                 "--op-forms", "linear_attn[chunk]", "--out", str(out)]) == 0
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["target"] for r in rows if r["kind"] == "op"} == {"linear_attn[chunk]"}
    for target in ("softmax", "delta"):
        for pass_name in ("fwd", "decode"):
            got = {r["threads"]: r for r in rows
                   if (r["target"], r["pass"]) == (target, pass_name)}
            assert set(got) == {"1", "2"}
            assert float(got["1"]["speedup_vs_first_threads"]) == 1.0
            assert float(got["2"]["speedup_vs_first_threads"]) > 0
            for r in got.values():
                assert float(r["time_min_s"]) <= float(r["time_s"]) <= float(r["time_max_s"])
                assert float(r["matmul_gflops_per_s"]) > 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["threads"] == [1, 2] and "--threads 1,2" in meta["command"]
    assert set(meta["matmul_by_threads"]) == {"1", "2"}
    assert meta["scan_width"]["delta"]["64"]["items"] == 2  # batch 1 x 2 heads
    assert meta["scan_width"]["linear_attn[chunk]"]["64"] == {
        "steps": 1, "items": 2, "item": "one (batch, head) chunk hand-off: 64 keys and values "
                                        "into its state"}
    with open(out / "peers.csv") as f:
        peers = list(csv.DictReader(f))
    assert {r["threads"] for r in peers} == {"1", "2"}
    md = (out / "results.md").read_text()
    assert "Thread scaling" in md and "| threads |" in md and "at 2 threads" in md
    assert "## Parallel width of the sequential scans" in md


def test_scan_width_from_the_shape():
    s = Setting(2, 24, 3, torch.float32, CPU)  # 6 (batch, head) pairs, head dim 8
    ops = {t.name: t for t in op_targets(s)[0]}
    width = scan_width(ops["linear_attn[chunk]"], 100, s)
    assert (width.steps, width.items) == (2, 6)  # chunks of 64
    assert (scan_width(ops["ttt_mlp[dual]"], 100, s).steps,
            scan_width(ops["ttt_mlp[dual]"], 100, s).items) == (7, 6)  # mini-batches of 16
    assert scan_width(ops["delta_rule[recurrent]"], 100, s).steps == 100
    assert scan_width(ops["softmax_attention"], 100, s) is None
    mixers = {"delta:chunk_size=4": ("delta", {"chunk_size": 4})}
    (target,) = mixer_targets([("delta:chunk_size=4", "delta", {"chunk_size": 4})])
    assert scan_width(target, 100, s, mixers).steps == 25
    (softmax,) = mixer_targets([("softmax", "softmax", {})])
    assert scan_width(softmax, 100, s) is None
