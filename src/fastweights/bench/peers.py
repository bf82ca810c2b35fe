"""``fastweights bench --peers``: our ops next to the installed peers' references, one process.

Each comparison times one of our ops and a peer's implementation of the same computation on the
same data, forward only, interleaved (ours, peer, ours, ...) so that both see the same machine
state; the median of the repeats counts and ``ratio`` = peer time / our time (> 1: we are
ahead). Peers are the CPU-capable references that are installed:

- flash-linear-attention (``fla``): its pure-PyTorch chunked forms ``naive_chunk_linear_attn``,
  ``delta_rule_chunkwise``, ``naive_chunk_simple_gla`` and ``chunk_ttt_linear_ref``;
- torch's ``scaled_dot_product_attention`` (causal) against our ``softmax_attention``.

Every input is built in each side's own layout before timing (fla's delta rule and TTT
reference take ``[B, H, T, D]``), so no layout change is timed on either side. A peer that is not
installed, or that cannot take a length (fla's chunked references need T to be a multiple of
their chunk size), is listed with the reason instead of a time.

Dimension legend: B batch, T time, H heads, D head dim.
"""

from __future__ import annotations

import importlib
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..ops import (
    decay_linear_attn,
    delta_rule,
    elu_plus_one,
    linear_attn,
    softmax_attention,
    sum_norm,
    ttt_linear,
)
from ..ops.fwp import preferred_chunk_size

__all__ = ["PEER_COLUMNS", "PeerRow", "run_peers"]

PEER_COLUMNS = ("op", "peer", "T", "status", "ours_s", "peer_s", "ratio", "repeats")


@dataclass
class PeerRow:
    """One (comparison, T): times in seconds per forward call; ``status`` ``ok`` or
    ``skipped: why``."""

    op: str
    peer: str
    T: int
    status: str = "ok"
    ours_s: float = float("nan")
    peer_s: float = float("nan")
    repeats: int = 0

    @property
    def ratio(self) -> float:
        return self.peer_s / self.ours_s


Call = Callable[[], Any]


@dataclass
class _Comparison:
    op: str
    peer: str
    multiple: int  # the peer needs T to be a multiple of this
    make: Callable[[dict[str, torch.Tensor]], tuple[Call, Call]]  # inputs -> (ours, peer)


def _fla(module: str) -> Any:
    """An fla.ops submodule, or None when fla is not installed (its import warns that Triton
    cannot run on a CPU-only machine: expected here, so silenced)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(f"fla.ops.{module}")
    except ImportError:
        return None


def _heads_first(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[B, T, H, ...] -> [B, H, T, ...], contiguous: fla's reference layout."""
    return tuple(x.transpose(1, 2).contiguous() for x in xs)


def _comparisons() -> tuple[list[_Comparison], dict[str, str]]:
    """The comparisons whose peer is installed, and {name: why} for those left out."""
    comps: list[_Comparison] = []
    missing: dict[str, str] = {}
    fla_names = {
        "linear_attn/fla.naive_chunk_linear_attn": "linear_attn.naive",
        "delta_rule/fla.delta_rule_chunkwise": "delta_rule.naive",
        "decay_linear_attn/fla.naive_chunk_simple_gla": "simple_gla.naive",
        "ttt_linear/fla.chunk_ttt_linear_ref": "ttt.naive",
    }
    mods = {name: _fla(module) for name, module in fla_names.items()}
    for name, mod in mods.items():
        if mod is None:
            missing[name] = "flash-linear-attention is not installed (pip install flash-linear-attention)"

    def linear(x):
        fla = mods["linear_attn/fla.naive_chunk_linear_attn"]
        q, k = elu_plus_one(x["q"]), elu_plus_one(x["k"])
        return (lambda: linear_attn(q, k, x["v"], normalize=True),
                lambda: fla.naive_chunk_linear_attn(q, k, x["v"], scale=1.0, normalize=True))

    def delta(x):
        fla = mods["delta_rule/fla.delta_rule_chunkwise"]
        q, k = sum_norm(elu_plus_one(x["q"])), sum_norm(elu_plus_one(x["k"]))
        C = preferred_chunk_size("delta_rule", q.device)
        qh, kh, vh, bh = _heads_first(q, k, x["v"], x["beta"])
        return (lambda: delta_rule(q, k, x["v"], x["beta"], chunk_size=C),
                lambda: fla.delta_rule_chunkwise(qh, kh, vh, bh, chunk_size=32))

    def decay(x):
        fla = mods["decay_linear_attn/fla.naive_chunk_simple_gla"]
        H = x["q"].shape[2]
        lam = torch.linspace(0.9, 0.999, H, dtype=x["q"].dtype)
        g = lam.log().expand(x["q"].shape[:3]).contiguous()  # fla: per-token log-decay [B, T, H]
        return (lambda: decay_linear_attn(x["q"], x["k"], x["v"], lam),
                lambda: fla.naive_chunk_simple_gla(x["q"], x["k"], x["v"], g, scale=1.0))

    def ttt(x):
        fla = mods["ttt_linear/fla.chunk_ttt_linear_ref"]
        q, k, v = x["q"], x["k"], x["v"]
        B, _, H, D = q.shape
        W0 = 0.02 * torch.randn(B, H, D, D, generator=torch.Generator().manual_seed(1),
                                dtype=q.dtype)
        b0 = torch.zeros(B, H, D, dtype=q.dtype)
        ln_w, ln_b = torch.ones(H, D, dtype=q.dtype), torch.zeros(H, D, dtype=q.dtype)
        eta = x["beta"] / D
        # fla's reference: residual and LayerNorm always on, mini-batch 16, eta [B, T, H, 1].
        return (lambda: ttt_linear(q, k, v, eta, initial_state=(W0, b0), ln_weight=ln_w,
                                   ln_bias=ln_b, residual=True, mini_batch_size=16),
                lambda: fla.chunk_ttt_linear_ref(q, k, v, ln_w, ln_b, eta.unsqueeze(-1),
                                                 scale=1.0, mini_batch_size=16,
                                                 initial_state=W0, initial_state_bias=b0.unsqueeze(-2)))

    def sdpa(x):
        qh, kh, vh = _heads_first(x["q"], x["k"], x["v"])
        return (lambda: softmax_attention(x["q"], x["k"], x["v"]),
                lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True))

    for name, multiple, make in (
        ("linear_attn/fla.naive_chunk_linear_attn", 64, linear),
        ("delta_rule/fla.delta_rule_chunkwise", 32, delta),
        ("decay_linear_attn/fla.naive_chunk_simple_gla", 1, decay),
        ("ttt_linear/fla.chunk_ttt_linear_ref", 1, ttt),
    ):
        if mods[name] is not None:
            op, peer = name.split("/")
            comps.append(_Comparison(op, peer, multiple, make))
    comps.append(_Comparison("softmax_attention", "torch.sdpa", 1, sdpa))
    return comps, missing


def _inputs(B: int, T: int, H: int, D: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, generator=g) for _ in range(3))
    return {"q": q, "k": k, "v": v, "beta": torch.rand(B, T, H, generator=g)}


def run_peers(
    lengths: list[int], B: int, H: int, D: int, repeats: int, time_budget: float,
) -> tuple[list[PeerRow], dict[str, str]]:
    """Time every installed comparison at every length (float32, CPU, forward, no autograd).

    A length is skipped for a comparison when its previous length took more than
    ``time_budget`` / 4 s per call pair (the next is about 4x longer for softmax, 2x for the
    rest). Returns the rows and {comparison: why} for peers that are not installed."""
    comps, missing = _comparisons()
    rows: list[PeerRow] = []
    last: dict[str, float] = {}
    with torch.no_grad():
        for T in lengths:
            x = _inputs(B, T, H, D)
            for c in comps:
                row = PeerRow(c.op, c.peer, T)
                rows.append(row)
                if T % c.multiple:
                    row.status = f"skipped: the peer needs T to be a multiple of {c.multiple}"
                    continue
                if last.get(c.op, 0.0) > time_budget / 4:
                    row.status = "skipped: over the time budget"
                    continue
                ours, peer = c.make(x)
                ours(), peer()  # warm-up
                times: tuple[list[float], list[float]] = ([], [])
                for _ in range(repeats):
                    for fn, sink in ((ours, times[0]), (peer, times[1])):
                        start = time.perf_counter()
                        fn()
                        sink.append(time.perf_counter() - start)
                row.ours_s, row.peer_s = statistics.median(times[0]), statistics.median(times[1])
                row.repeats = repeats
                last[c.op] = row.ours_s + row.peer_s
    return rows, missing


def peer_table(rows: list[PeerRow], missing: dict[str, str]) -> list[str]:
    """The results.md section: one line per (comparison, T)."""
    lines = ["## Peers (forward, float32, same process, interleaved)", "",
             "ratio = peer time / our time (> 1: fastweights is faster).", "",
             "| op | peer | T | ours (ms) | peer (ms) | ratio |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        if r.status == "ok":
            lines.append(f"| {r.op} | {r.peer} | {r.T} | {r.ours_s * 1e3:.3g} | "
                         f"{r.peer_s * 1e3:.3g} | {r.ratio:.2f}x |")
        else:
            lines.append(f"| {r.op} | {r.peer} | {r.T} | | | {r.status} |")
    lines += [f"- {name}: {why}" for name, why in missing.items()]
    return [*lines, ""]
