"""``fastweights bench --peers``: our ops next to the installed peers' references, one process.

Each comparison times one of our ops and a peer's implementation of the same computation on the
same data, forward only, interleaved (ours, peer, ours, ...; with several thread counts, ours
and peer at each count in turn, round by round) so that both see the same machine
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
from ..ops.backend import preferred_chunk_size
from .measure import time_rounds

__all__ = ["PEER_COLUMNS", "PeerRow", "run_peers"]

PEER_COLUMNS = ("op", "peer", "T", "threads", "status", "ours_s", "peer_s", "ratio", "repeats")


@dataclass
class PeerRow:
    """One (comparison, T, thread count): times in seconds per forward call (medians); ``status``
    ``ok`` or ``skipped: why``."""

    op: str
    peer: str
    T: int
    threads: int = 1
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
    threads: list[int] | None = None,
) -> tuple[list[PeerRow], dict[str, str]]:
    """Time every installed comparison at every length (float32, CPU, forward, no autograd) and
    count of ``threads`` (None: torch's current count): after one warm-up round, each of
    ``repeats`` rounds times ours then the peer at each thread count in order
    (``measure.time_rounds``); one row per (comparison, T, thread count).

    A length is skipped for a comparison when its previous length took more than
    ``time_budget`` / 4 s per round (the next is about 4x longer for softmax, 2x for the
    rest). Returns the rows and {comparison: why} for peers that are not installed."""
    threads = list(threads) if threads else [torch.get_num_threads()]
    comps, missing = _comparisons()
    rows: list[PeerRow] = []
    last: dict[str, float] = {}
    cpu = torch.device("cpu")
    with torch.no_grad():
        for T in lengths:
            x = _inputs(B, T, H, D)
            for c in comps:
                group = [PeerRow(c.op, c.peer, T, threads=n) for n in threads]
                rows += group
                status = ""
                if T % c.multiple:
                    status = f"skipped: the peer needs T to be a multiple of {c.multiple}"
                elif last.get(c.op, 0.0) > time_budget / 4:
                    status = "skipped: over the time budget"
                if status:
                    for row in group:
                        row.status = status
                    continue
                calls = c.make(x)
                time_rounds(calls, threads, 1, cpu)  # warm-up at every count
                times = time_rounds(calls, threads, repeats, cpu)
                for row, (ours, peer) in zip(group, times):
                    row.ours_s, row.peer_s = statistics.median(ours), statistics.median(peer)
                    row.repeats = repeats
                last[c.op] = sum(r.ours_s + r.peer_s for r in group)
    return rows, missing


def peer_table(rows: list[PeerRow], missing: dict[str, str]) -> list[str]:
    """The results.md section: one line per (comparison, T)."""
    lines = ["## Peers (forward, float32, same process, interleaved)", "",
             "ratio = peer time / our time (> 1: fastweights is faster); times are medians of "
             "the rounds at that thread count.", "",
             "| op | peer | T | threads | ours (ms) | peer (ms) | ratio |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.status == "ok":
            lines.append(f"| {r.op} | {r.peer} | {r.T} | {r.threads} | {r.ours_s * 1e3:.3g} | "
                         f"{r.peer_s * 1e3:.3g} | {r.ratio:.2f}x |")
        else:
            lines.append(f"| {r.op} | {r.peer} | {r.T} | {r.threads} | | | {r.status} |")
    lines += [f"- {name}: {why}" for name, why in missing.items()]
    return [*lines, ""]
