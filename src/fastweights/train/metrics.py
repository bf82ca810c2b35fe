"""A run's metrics: ``metrics.csv`` (always) and TensorBoard (when installed), written by rank 0;
a resumed run keeps the rows up to its checkpoint, so the file ends up with every step once."""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path

import torch
import torch.distributed as dist

from ..layers.base import Mixer
from .checkpoint import write_atomic

METRICS_FILE = "metrics.csv"
# grad_norm: the total gradient norm before clipping (train rows); mixer_grad_norm: the same
# over the token mixers' parameters only (every block's mixer); last so that the rows of files
# written before they existed still read (restval "").
METRIC_FIELDS = ("step", "split", "loss", "perplexity", "lr", "tokens_per_s", "seconds", "grad_norm",
                 "mixer_grad_norm")


class Metrics:
    """metrics.csv (always) and TensorBoard (when installed); rank 0 only."""

    def __init__(self, run_dir: Path, resume_step: int | None) -> None:
        self.path = run_dir / METRICS_FILE
        rows: list[dict[str, str]] = []
        if resume_step is not None and self.path.exists():
            rows = metrics_rows(self.path, resume_step)
        # Rewritten atomically: a crash right now must not lose the rows of earlier sessions.
        text = io.StringIO(newline="")
        header = csv.DictWriter(text, fieldnames=METRIC_FIELDS)
        header.writeheader()
        header.writerows(rows)
        write_atomic(self.path, text.getvalue().encode())
        self.file = open(self.path, "a", newline="")  # noqa: SIM115 (open for the whole run)
        self.writer = csv.DictWriter(self.file, fieldnames=METRIC_FIELDS)
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        except ImportError:
            self.tb = None

    def log(self, step: int, split: str, loss: float, **extra: float) -> None:
        row = {"step": step, "split": split, "loss": f"{loss:.6f}",
               "perplexity": f"{math.exp(min(loss, 50)):.4f}", **{k: f"{v:.6g}" for k, v in extra.items()}}
        self.writer.writerow(row)
        self.file.flush()
        if self.tb is not None:
            self.tb.add_scalar(f"{split}/loss", loss, step)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def metrics_rows(path: Path, resume_step: int) -> list[dict[str, str]]:
    """The rows of ``metrics.csv`` up to ``resume_step``: rows logged after the checkpoint are
    logged again by the resumed run, and a row cut short by a crash (no line end, missing
    fields) is dropped, so the file ends up with every step exactly once."""
    lines = [line for line in path.read_text(errors="replace").splitlines(keepends=True)
             if line.endswith("\n")]
    rows = csv.DictReader(lines, fieldnames=METRIC_FIELDS, restval="")
    return [r for r in rows if None not in r and None not in r.values()
            and r["step"].isdigit() and int(r["step"]) <= resume_step]


def mixer_grad_norm(model: torch.nn.Module, *, sharded: bool = False) -> float | None:
    """The 2-norm of the gradients of the token mixers' parameters (``layers.base.Mixer``
    modules), None for a model without mixer gradients. TransNormer's claim (b) is about the
    attention's gradients, not the whole model's. ``sharded``: the gradients are FSDP's
    DTensor shards, disjoint across ranks; every rank must call, and gets the whole norm."""
    grads = [p.grad.detach() for m in model.modules() if isinstance(m, Mixer)
             for p in m.parameters() if p.grad is not None]
    if not sharded:
        return float(torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads]))) if grads else None
    squares = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else None)
    for g in grads:
        squares += g.to_local().double().pow(2).sum()
    dist.all_reduce(squares)
    return float(squares.sqrt()) if grads else None
