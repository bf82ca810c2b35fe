"""Context parallelism (fastweights.parallel) on CPU with gloo: 2 and 4 processes, each holding
a shard of unequal length, against the single-process run in float64, for every registered
mixer (plus the delta rule on DPFP features and normalised by attention, TransNormer's decay and
Infini's delta memory).

Each world size is spawned once for the whole module (cp_worker.equality_worker runs every
case and records its largest differences); the tests read those records.
"""

from __future__ import annotations

import json
import time

import pytest
import torch.multiprocessing as mp

from fastweights import build_mixer, mixer_names
from fastweights.parallel import strategy_name

from ..helpers import ATOL64
from . import cp_worker

CASE_IDS = [c[0] for c in cp_worker.MIXER_CASES]


def _spawn(worker, world: int, tmp_path_factory, join: bool = True) -> list[dict]:
    """Run ``worker`` on ``world`` processes and read their records. ``join=False``: wait for
    the processes but ignore how they exit (a process group torn down by a failing rank may
    abort at interpreter exit, after its record is written)."""
    path = str(tmp_path_factory.mktemp(f"cp{world}") / "rank")
    ctx = mp.spawn(worker, args=(world, cp_worker.free_port(), path), nprocs=world, join=join)
    if not join:
        for proc in ctx.processes:
            proc.join(timeout=120)
            if proc.is_alive():  # hung: stop it; its missing record fails the test
                proc.terminate()
    out = []
    for rank in range(world):
        with open(f"{path}.{rank}.json") as f:
            out.append(json.load(f))
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def records(request, tmp_path_factory) -> list[dict]:
    return _spawn(cp_worker.equality_worker, request.param, tmp_path_factory)


def test_every_registered_mixer_is_covered():
    assert {c[1] for c in cp_worker.MIXER_CASES} == set(mixer_names())
    for name in mixer_names():
        strategy_name(build_mixer(name, 8, 2))  # no TypeError: every mixer has a strategy


@pytest.mark.parametrize("with_state", [False, True], ids=["start", "carried-state"])
@pytest.mark.parametrize("case_id", CASE_IDS)
def test_equals_single_process(records, case_id, with_state):
    """Outputs, the final state (on every rank), input and (summed) parameter gradients."""
    key = f"{case_id}{'-state' if with_state else ''}"
    for rank, rec in enumerate(records):
        got = rec[key]
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        for what in ("y", "state", "x_grad", "param_grad"):
            assert got[what] <= ATOL64, f"rank {rank} {what}: max abs diff {got[what]:.3e}"


def test_refusals_raise_on_every_rank(records):
    world = len(records)
    for rec in records:
        assert rec["refuse-misaligned"].startswith("ValueError")
        assert "DiagAttention needs every shard to start on a block border" in rec["refuse-misaligned"]
        assert rec["refuse-bad-input"].startswith(f"ValueError: context parallel forward refused: rank {world - 1}")
        assert "d_model=8" in rec["refuse-bad-input"]
        assert rec["refuse-unknown"].startswith("TypeError: context parallelism has no strategy for mixer _Unknown")
        assert "cu_seqlens is not supported" in rec["refuse-cu-seqlens"]


def test_failing_rank_raises_everywhere_without_hanging(tmp_path_factory):
    """Rank 1 raises inside the layer after the agreement step: rank 0 waits in a collective
    and must get an error (peer closed, or the 10 s process-group timeout), not hang."""
    start = time.monotonic()
    records = _spawn(cp_worker.failing_worker, 2, tmp_path_factory, join=False)
    assert time.monotonic() - start < 120
    assert records[1]["outcome"] == "RuntimeError: rank 1 fails on purpose"
    assert records[0]["outcome"] != "no error"
