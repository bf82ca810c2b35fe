"""The FSDP benchmark end to end at a toy size (DDP and FSDP on 2 processes), and its
extrapolation."""

from __future__ import annotations

import csv

import pytest

from fastweights.bench.fsdp import largest_params
from fastweights.cli import main


def test_fsdp_bench_halves_the_model_state_and_counts_the_collectives(tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(["bench", "fsdp", "--world", "2", "--d-model", "32", "--n-layers", "2",
                 "--n-heads", "2", "--seq-len", "8", "--out", str(out)]) == 0
    with open(out / "results.csv") as f:
        rows = {r["mode"]: r for r in csv.DictReader(f)}
    ddp, fsdp = rows["ddp"], rows["fsdp"]
    params = int(ddp["params"])
    assert int(ddp["state_bytes_per_rank"]) == 16 * params  # float32 weights, grads, 2 moments
    # FSDP: half of it on each rank (the shards' padding aside: under 1 row per tensor)
    assert 8 * params <= int(fsdp["state_bytes_per_rank"]) < 8 * params * 1.05
    assert int(ddp["comm_bytes_per_rank"]) == 4 * params  # the gradients, all-reduced once
    # FSDP gathers the parameters for the forward and again for the backward (blocks, root
    # kept), and reduce-scatters the gradients: 2 to 3 times the parameters' bytes
    assert 8 * params <= int(fsdp["comm_bytes_per_rank"]) <= 13 * params
    assert fsdp["comm_measured"] == "True" and ddp["comm_measured"] == "False"
    assert int(fsdp["largest_params"]) > int(ddp["largest_params"])
    assert "fastweights bench fsdp --world 2" in (out / "meta.json").read_text()
    assert "| fsdp | 2 |" in capsys.readouterr().out


def test_largest_params_extrapolates_the_model_state():
    row = {"params": 1000, "state_bytes_per_rank": 16000, "peak_bytes_per_rank": 116000}
    # 100000 bytes besides the model state; 16 bytes per parameter
    assert largest_params(row, 1_700_000) == 100_000
    assert largest_params({**row, "peak_bytes_per_rank": None}, 1e9) is None
    assert largest_params(row, 50_000) == 0


def test_bad_world_is_one_line(tmp_path, capsys):
    assert main(["bench", "fsdp", "--world", "0", "--out", str(tmp_path)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.parametrize("flag", ["--d-model", "--n-layers"])
def test_bad_model_size_is_one_line(tmp_path, capsys, flag):
    assert main(["bench", "fsdp", flag, "0", "--out", str(tmp_path)]) == 2
    assert "must be a positive integer" in capsys.readouterr().err
