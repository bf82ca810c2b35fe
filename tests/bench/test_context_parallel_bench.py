"""The context-parallel benchmark end to end at toy sizes (N = 1 and 2), and its helpers."""

from __future__ import annotations

import csv
import json

import pytest

from fastweights.bench.context_parallel import longest_T, shard_lengths
from fastweights.cli import main


def test_shard_lengths_whole_blocks_and_total():
    assert shard_lengths(10, 3, 1) == [4, 3, 3]
    assert shard_lengths(40, 3, 8) == [16, 16, 8]
    assert shard_lengths(41, 2, 8) == [24, 17]
    with pytest.raises(ValueError, match="too short"):
        shard_lengths(8, 2, 8)


def test_longest_T_extends_the_last_slope():
    rows = [{"mixer": "m", "world": 2, "T": T, "peak_bytes_per_rank": 100 + 10 * T}
            for T in (10, 20)]
    assert longest_T(rows, 1100) == [{"mixer": "m", "world": 2, "longest_T": 100}]


def test_bench_runs_and_counts_bytes(tmp_path):
    out = tmp_path / "cp"
    assert main(["bench", "context-parallel", "--world", "1,2", "--lengths", "16,32", "--d-model", "8", "--n-heads", "2",
                 "--repeats", "1", "--mixers", "linear,ttt-linear", "--out", str(out)]) == 0
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 2 * 2
    for r in rows:
        comm = int(r["comm_forward_bytes"]) + int(r["comm_backward_bytes"])
        assert (comm > 0) == (r["world"] == "2")
    lin = [r for r in rows if r["mixer"] == "linear" and r["world"] == "2"]
    # LASP-2: one all-gather of each rank's (S, z) per layer, whatever T; S [1, 2, 4, 4] and
    # z [1, 2, 4] in float32 from each of the 2 ranks, plus the backward all-reduce of both.
    state_bytes = (2 * 4 * 4 + 2 * 4) * 4
    assert {int(r["comm_forward_bytes"]) for r in lin} == {2 * state_bytes}
    assert {int(r["comm_backward_bytes"]) for r in lin} == {2 * 2 * state_bytes}
    assert (out / "results.md").exists() and (out / "longest_T.csv").exists()
    command = json.loads((out / "meta.json").read_text())["command"]
    assert command.startswith("fastweights bench context-parallel --world 1,2 --lengths 16,32")


def test_bench_rejects_a_layout_it_cannot_split(tmp_path, capsys):
    assert main(["bench", "context-parallel", "--world", "2", "--lengths", "8", "--mixers",
                 "diag:block_size=8", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "too short" in err and "--mixers diag:block_size=8" in err
