"""Helpers of the tests that spawn a gloo process group on 127.0.0.1 inside the test (training
across processes): a free port, the torchrun environment of one worker, float64 workers, a run
folder's validation losses, and the bound within which such float64 runs equal one process."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import torch

from fastweights._files import STATE_FILE, resolve_checkpoint
from fastweights.train.checkpoint import load_model

# The bound within which a float64 run on several processes (DDP, FSDP2, context parallel,
# carried state, gradient accumulation) equals one process on the same global batch: losses,
# validation loss, and weights after a few AdamW steps. The model, the cross-entropy, the
# validation sums and the reductions across ranks are all float64 (train/trainer.py,
# train/evaluate.py), so the runs differ only in the order of float64 sums (rank-local partial
# sums, context-parallel scans, other matrix shapes): relative ~n * 1.1e-16 for n <= 256 terms,
# below 2e-13 on values up to 6. One float32 step anywhere (a cast, a float32 sum) moves a loss
# near 5.5 by up to 2.4e-7 (half a float32 unit) and a weight near 0.1 by 3.7e-9. TOL64 lies
# between: 37 times below the smallest float32 rounding, 500 times above float64's reordering.
# Measured: at most 1.8e-15 on losses and validation loss, 1.2e-15 on weights.
TOL64 = 1e-10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env(rank: int, world: int, port: int) -> None:
    """The environment torchrun gives worker ``rank`` of ``world``; one thread, float64, and the
    gloo process group (the trainer uses the group it finds)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                      RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    torch.distributed.init_process_group("gloo")


def val_losses(run_dir: Path) -> list[float]:
    """The validation losses metrics.csv holds (6 decimals)."""
    with open(Path(run_dir) / "metrics.csv") as f:
        return [float(r["loss"]) for r in csv.DictReader(f) if r["split"] == "val"]


def val_loss(run_dir: Path) -> float:
    """The validation loss of a run that validated once, at its last step, unrounded: the best
    validation loss its last checkpoint records (metrics.csv writes 6 decimals). Checks that
    metrics.csv holds that one validation, rounded."""
    state = json.loads((resolve_checkpoint(run_dir) / STATE_FILE).read_text())
    assert val_losses(run_dir) == [round(state["best_val_loss"], 6)], run_dir
    return state["best_val_loss"]


@contextlib.contextmanager
def float64_default() -> Iterator[None]:
    """torch's default dtype float64 inside (the one-process reference runs), restored after."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(dtype)


def run_params(run: Path) -> dict[str, torch.Tensor]:
    """The parameters of a run's (or checkpoint's) model, built in float64 (a model is built in
    torch's default dtype: a float32 one would round the weights)."""
    with float64_default():
        return {n: p.detach() for n, p in load_model(run).named_parameters()}


def assert_same_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Float64 parameters, equal within TOL64."""
    assert got.keys() == want.keys()
    for name, p in got.items():
        assert p.dtype == want[name].dtype == torch.float64, name
        diff = (p - want[name]).abs().max().item()
        assert diff < TOL64, f"{name}: max difference {diff:.3e}"


def assert_same_losses(got: list, want: list, tol: float = TOL64) -> None:
    """``(step, loss)`` lists: the same steps, the losses within ``tol``."""
    assert [s for s, _ in got] == [s for s, _ in want]
    diff = max(abs(a - b) for (_, a), (_, b) in zip(got, want))
    assert diff < tol, f"max loss difference {diff:.3e}"


def assert_same_run(got: list, run: Path, want: list, ref_run: Path) -> None:
    """Losses, validation loss and final parameters of ``run`` equal the reference's."""
    assert_same_losses(got, want)
    diff = abs(val_loss(run) - val_loss(ref_run))
    assert diff < TOL64, f"validation loss difference {diff:.3e}"
    assert_same_params(run_params(run), run_params(ref_run))
