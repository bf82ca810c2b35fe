"""Helpers of the tests that spawn a gloo process group on 127.0.0.1 inside the test (training
across processes): a free port, the torchrun environment of one worker, float64 workers, and a
run folder's validation losses."""

from __future__ import annotations

import contextlib
import csv
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import torch


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


@contextlib.contextmanager
def float64_default() -> Iterator[None]:
    """torch's default dtype float64 inside (the one-process reference runs), restored after."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(dtype)
