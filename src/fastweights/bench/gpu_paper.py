"""``fastweights bench gpu``'s ``paper`` section: the TTT paper's 1.3B layer (Sun et al. 2024:
d_model 2048, 32 heads of 64, mini-batches of 16) at batch 4 and T 2048, 8192 and 32768, where
the paper has TTT-Linear's forward below a Transformer's from 8k tokens: TTT-Linear's layer (the
automatic backend; and with the opt-in resident kernels of ops/ttt/triton_resident.py,
``FASTWEIGHTS_TTT_FWD=resident`` and ``FASTWEIGHTS_TTT_BWD=resident``) against softmax
attention's at the same shape, forward and forward+backward, bfloat16 weights. It first checks
the opt-in kernels' exactness as the ``exact`` section checks every kernel: the resident
TTT-Linear kernels (rows ``ttt_linear (resident)``), TTT-MLP's thread-block-cluster forward
(ops/ttt/cluster.py, ``FASTWEIGHTS_TTT_MLP_FWD=cluster``; rows ``ttt_mlp (cluster)``, the
Triton backward after it) and TTT-Linear's CUDA forward (ops/ttt/linear_cuda.py,
``FASTWEIGHTS_TTT_FWD=cuda``; rows ``ttt_linear (cuda)``, head size 64 only: at 128 the row
says the Triton kernel ran), at head sizes 128 and 64. The dry run (CPU) runs the same items at a
tiny shape.

Kept apart from gpu.py's sections (its ``plan`` appends ``paper_items``); the rows reuse its
timing, budget and record through ``Tools``, which gpu.py hands in (the two modules do not
import each other).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .targets import Setting, mixer_targets

SECTION = "paper"
TITLE = "The TTT paper's 1.3B layer (d_model 2048, 32 heads of 64, b 16), bfloat16 weights"
# the switches of the resident kernels (ops/ttt/triton_regs.py ENV, triton_resident.py BWD_ENV)
RESIDENT_ENV = ("FASTWEIGHTS_TTT_FWD", "FASTWEIGHTS_TTT_BWD")
# the opt-in kernels' switches per exactness row name: (op, environment)
OPT_IN = {"ttt_linear (resident)": ("ttt_linear", {name: "resident" for name in RESIDENT_ENV}),
          "ttt_mlp (cluster)": ("ttt_mlp", {"FASTWEIGHTS_TTT_MLP_FWD": "cluster"}),
          # the CUDA forward at head size 64 (ops/ttt/linear_cuda.py), the Triton backward
          "ttt_linear (cuda)": ("ttt_linear", {"FASTWEIGHTS_TTT_FWD": "cuda"})}


@dataclasses.dataclass(frozen=True)
class PaperShape:
    """The section's layer shape: batch, d_model, heads, TTT mini-batch, lengths."""

    batch: int
    d_model: int
    heads: int
    mini_batch: int
    lengths: tuple[int, ...]


PAPER_GPU = PaperShape(batch=4, d_model=2048, heads=32, mini_batch=16,
                       lengths=(2048, 8192, 32768))
PAPER_DRY = PaperShape(batch=1, d_model=64, heads=4, mini_batch=16, lengths=(48,))
# (row name, registered mixer, whether the item runs the resident kernels)
LAYERS = (("softmax", "softmax", False), ("ttt-linear", "ttt-linear", False),
          ("ttt-linear resident", "ttt-linear", True))
# the opt-in kernels' exactness rows, each of OPT_IN: (dtype, head size) at the exact section's
# B, T, H
EXACT = ((torch.bfloat16, 128), (torch.float16, 128), (torch.bfloat16, 64))


@dataclasses.dataclass(frozen=True)
class Tools:
    """What the section takes from bench/gpu.py: its ``exact_case``, ``_item`` and ``_timed``,
    and its ``KernelOp`` per op name (ttt_linear and ttt_mlp at least)."""

    exact_case: Callable[..., None]
    item: Callable[..., Any]
    timed: Callable[..., dict[str, Any]]
    ops: dict[str, Any]


def paper_shape(device: torch.device) -> PaperShape:
    """The paper's shape on a GPU; a tiny one for the dry run (CPU)."""
    return PAPER_GPU if device.type == "cuda" else PAPER_DRY


def shape_name(s: PaperShape, T: int) -> str:
    return f"B{s.batch} T{T} d{s.d_model} H{s.heads} b{s.mini_batch}"


@contextlib.contextmanager
def _switched(env: dict[str, str]) -> Iterator[None]:
    """The environment ``env`` for the block (the opt-in kernels' switches), restored after."""
    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _resident(on: bool) -> contextlib.AbstractContextManager[None]:
    """The resident TTT-Linear forward and backward chosen for the block if ``on``."""
    return _switched(OPT_IN["ttt_linear (resident)"][1] if on else {})


def opt_in_exact(run: Any, tools: Tools, name: str, dtype: torch.dtype, D: int) -> None:
    """The ``exact`` section's row of an opt-in kernel (``name``, a key of ``OPT_IN``) on
    triton at head size D, named ``name`` (``run``: bench/gpu.py's ``Run``)."""
    op, env = OPT_IN[name]
    B, T, H, _ = run.sizes.exact
    sized = dataclasses.replace(run, sizes=dataclasses.replace(run.sizes, exact=(B, T, H, D)))
    first = len(run.rows)  # ``sized`` appends to the same rows
    with _switched(env):
        tools.exact_case(sized, tools.ops[op], "triton", dtype, None)
    # the CUDA kernels fall back to Triton's where they cannot run (a log line): say so here
    why = None
    if op == "ttt_mlp" and run.device.type == "cuda":
        from ..ops.ttt import cluster

        why = cluster.problem(torch.empty(B, T, H, D, dtype=dtype, device=run.device), D, 4 * D,
                              tools.ops[op].chunk)
    elif name == "ttt_linear (cuda)" and run.device.type == "cuda":
        from ..ops.ttt import linear_cuda

        why = linear_cuda.problem(torch.empty(B, T, H, D, dtype=dtype, device=run.device),
                                  tools.ops[op].chunk)
    for r in run.rows[first:]:
        r["name"] = name
        if why is not None and not str(r.get("status", "")).startswith("skipped"):
            r["status"] = f"skipped: the Triton kernel ran, {why}"


def paper_case(run: Any, tools: Tools, name: str, mixer: str, resident: bool, T: int) -> None:
    """Rows of the section: the layer ``mixer`` at the paper's shape and length T, forward and
    forward+backward, the automatic backend (with the resident kernels if ``resident``)."""
    s = paper_shape(run.device)
    fields = {"section": SECTION, "name": name, "dtype": "bfloat16",
              "shape": shape_name(s, T), "backend": "auto"}
    if not run.may_start(**fields, **{"pass": "fwd"}):
        return
    options = {} if mixer == "softmax" else {"mini_batch_size": s.mini_batch}
    with _resident(resident), tools.item(run, **fields, **{"pass": "build"}):
        work = mixer_targets([(name, mixer, options)])[0].build(
            T, Setting(s.batch, s.d_model, s.heads, torch.bfloat16, run.device))
        for p, call in (("fwd", work.forward), ("fwdbwd", work.forward_backward)):
            if not run.may_start(**fields, **{"pass": p}):
                return
            with tools.item(run, **fields, **{"pass": p}):
                run.row(**fields, **{"pass": p}, **tools.timed(run, call))


def paper_items(run: Any, tools: Tools) -> list[Callable[[], None]]:
    """The section's items in order: the opt-in kernels' exactness, then each length's
    softmax, TTT-Linear and TTT-Linear with the resident kernels."""
    items: list[Callable[[], None]] = [
        lambda n=n, dt=dt, D=D: opt_in_exact(run, tools, n, dt, D)
        for n in OPT_IN for dt, D in EXACT]
    for T in paper_shape(run.device).lengths:
        items += [lambda a=a, T=T: paper_case(run, tools, *a, T) for a in LAYERS]
    return items
