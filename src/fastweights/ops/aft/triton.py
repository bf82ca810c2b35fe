"""Triton kernels of AFT's product form (docs/maths.md 4.4, ``product.py``), forward and
backward, tiled like flash attention over (query block, key block) with the channels of every
batch row as the columns of the products: AFT-full, and causal AFT-local (``LOCAL``: only the
key blocks of the windows, the keys before a window through prefix sums). The plan, tiles and
estimates: docs/kernels.md, "AFT-full".

Dimension legend: B batch, T the call's rows, L = first + T keys in view (a cached past first),
D channels, S AFT-local's window; BT query rows, BK keys and BD channels per tile;
NT = ceil(T / BT) query blocks, NB = ceil(D / BD) channel blocks. Rows, keys and channels past
T, L, D load as zeros (biases as -inf) and are never stored, so none of them has to be a power
of two.

forward   (a) ``_prep_kernel``      X_e = exp(K - M), X_ev = X_e V, M [B, D] the column
                                    maximum of K (torch's amax)
          (b) ``_fwd_kernel``       per (query block, channel block): over the key blocks, the
                                    online row maximum m of w, P = exp(w - m), num += P X_ev,
                                    den += P X_e; o = sigmoid(Q) num / den, R = num / den, den,
                                    m, and the flags of lossy rows
backward  (c) ``_bwd_prep_kernel``  U = dO sigmoid(Q) / den, Z = U R, dQ
          (d) ``_bwd_kv_kernel``    per (key block, channel block), over the query blocks:
                                    dV = X_e (P^T U), dK = V dV - X_e (P^T Z)
          (e) ``_bwd_w_kernel``     per (query block, key block), over batch rows and channels:
                                    dw = P * (U X_ev^T - Z X_e^T)

Precision: the products' operands P, X_e, X_ev, U and Z span float32's range and are float32;
the products are TF32 for half inputs and exact float32 for float32 inputs (docs/kernels.md,
"AFT-full", why not bfloat16 operands). Accumulation, row maxima, denominators and epilogues
are float32. This module imports ``triton`` at import time; ops/backend.py imports it lazily.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .._triton_common import _arch, precisions
from .chunk import cumsum_time
from .product import lossy_threshold

__all__ = ["CHANNEL_MULTIPLE", "OPS", "Tiles", "aft_full_triton", "aft_local_triton", "supports",
           "tile_config"]

OPS = ("aft", "aft_local")
# The dispatcher sends channel counts D that are multiples of 16 only: the tiles' rows are then
# 64-byte aligned, which the spill-free compiles rely on (tests/ops/triton_aot_aft.py).
CHANNEL_MULTIPLE = 16
GROUP = 8  # row blocks per group of programs (``_grouped``)


class Tiles(NamedTuple):
    """One launch's tiles: BT query rows, BK keys, BD channels, warps, and the software
    pipeline stages of its loop (None: Triton's default)."""

    BT: int
    BK: int
    BD: int
    warps: int
    stages: int | None = None


def tile_config(arch: int, dtype: torch.dtype, op: str) -> dict[str, Tiles] | None:
    """The tiles of every kernel for a target (sm_80, sm_90), input dtype and op, or None where
    no tiling compiles without register spills (float32: exact float32 products are FMA loops;
    the dispatcher sends it to PyTorch)."""
    if op not in OPS or dtype not in (torch.float16, torch.bfloat16):
        return None
    big = Tiles(64, 64, 64, 8, 2)
    rows = Tiles(32, 64, 64, 4)  # the elementwise kernels (a), (c): BT rows, BD channels
    return {"prep": rows, "fwd": big, "bwd_prep": rows, "bwd_kv": big,
            "bwd_w": Tiles(64, 64, 32, 4, 2)}


def supports(op: str, dtype: torch.dtype) -> bool:
    """Whether ``op`` has a spill-free tiling for ``dtype`` on every target."""
    return all(tile_config(arch, dtype, op) is not None for arch in (80, 90))


# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _tile(ptr, b, r0, c0, R, D, BR: tl.constexpr, BD: tl.constexpr):
    """Pointers and mask of rows r0..r0+BR-1, channels c0..c0+BD-1 of batch row b of a
    contiguous [B, R, D] tensor."""
    rows = r0 + tl.arange(0, BR)
    cols = c0 + tl.arange(0, BD)
    ptrs = ptr + tl.cast(b, tl.int64) * R * D + rows[:, None] * D + cols[None, :]
    return ptrs, (rows[:, None] < R) & (cols[None, :] < D)


@triton.jit
def _load(ptr, b, r0, c0, R, D, BR: tl.constexpr, BD: tl.constexpr, other: tl.constexpr = 0.0):
    ptrs, mask = _tile(ptr, b, r0, c0, R, D, BR, BD)
    return tl.load(ptrs, mask=mask, other=other)


@triton.jit
def _store(ptr, x, b, r0, c0, R, D, BR: tl.constexpr, BD: tl.constexpr):
    ptrs, mask = _tile(ptr, b, r0, c0, R, D, BR, BD)
    tl.store(ptrs, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bias(w_ptr, r0, j0, T, L, first, sw0, S, CAUSAL: tl.constexpr, LOCAL: tl.constexpr,
          BT: tl.constexpr, BK: tl.constexpr):
    """The [BT, BK] tile of biases of rows r0.. (positions first + row) against keys j0.. in
    float32, -inf where masked: past T or L, or (causal) a key after the row. AFT-full: w
    [T, L] (row stride sw0, keys contiguous). AFT-local (``LOCAL``, causal): the band [T, S]
    (row stride sw0), entry o the bias at offset o = position - key, and only the keys of the
    window (offsets below S); the keys before it are the prefix sums' (``_fwd_kernel``)."""
    rows = r0 + tl.arange(0, BT)
    keys = j0 + tl.arange(0, BK)
    ok = (rows[:, None] < T) & (keys[None, :] < L)
    if CAUSAL:
        ok = ok & (keys[None, :] <= first + rows[:, None])
    if LOCAL:
        offset = first + rows[:, None] - keys[None, :]
        ok = ok & (offset < S)
        ptrs = w_ptr + rows[:, None] * sw0 + offset
    else:
        ptrs = w_ptr + rows[:, None] * sw0 + keys[None, :]
    return tl.load(ptrs, mask=ok, other=float("-inf")).to(tl.float32)


@triton.jit
def _rows_at(ptr, b, idx, ok, c0, R, D, BR: tl.constexpr, BD: tl.constexpr):
    """Rows idx [BR] (where ok) of channels c0.. of batch row b of a contiguous [B, R, D]
    float32 tensor; 0 elsewhere."""
    cols = c0 + tl.arange(0, BD)
    ptrs = ptr + tl.cast(b, tl.int64) * R * D + idx[:, None] * D + cols[None, :]
    return tl.load(ptrs, mask=ok[:, None] & (cols[None, :] < D), other=0.0)


@triton.jit
def _grouped(n_rows, n_cols, GROUP: tl.constexpr):
    """(row block, column block) of this program in a 1-D grid of n_rows * n_cols programs
    taken in groups of GROUP row blocks (Triton's matmul tutorial): the programs that run
    together share GROUP row blocks and a few column blocks, whose tiles then come from L2."""
    pid = tl.program_id(0)
    per_group = GROUP * n_cols
    first = (pid // per_group) * GROUP
    size = tl.minimum(n_rows - first, GROUP)
    return first + (pid % per_group) % size, (pid % per_group) // size


@triton.jit
def _prep_kernel(k_ptr, v_ptr, m_ptr, xe_ptr, xev_ptr, L, D, BT: tl.constexpr,
                 BD: tl.constexpr):
    """(a) X_e = exp(K - M), X_ev = X_e V for BT keys and BD channels of one batch row."""
    i, b, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cols = c * BD + tl.arange(0, BD)
    m = tl.load(m_ptr + b * D + cols, mask=cols < D, other=0.0)
    k = _load(k_ptr, b, i * BT, c * BD, L, D, BT, BD).to(tl.float32)
    v = _load(v_ptr, b, i * BT, c * BD, L, D, BT, BD).to(tl.float32)
    e = tl.exp(k - m[None, :])
    _store(xe_ptr, e, b, i * BT, c * BD, L, D, BT, BD)
    _store(xev_ptr, e * v, b, i * BT, c * BD, L, D, BT, BD)


@triton.jit
def _fwd_kernel(q_ptr, xe_ptr, xev_ptr, w_ptr, ce_ptr, cev_ptr, o_ptr, r_ptr, den_ptr, mw_ptr,
                flag_ptr, T, L, D, first, sw0, S, NB, thr, CAUSAL: tl.constexpr,
                LOCAL: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
                PREC: tl.constexpr, GROUP: tl.constexpr):
    """(b) One query block and one channel block of one batch row, grouped (``_grouped``);
    the longest query blocks first. AFT-local (``LOCAL``): only the key blocks of the rows'
    windows, and the keys before a row's window from the prefix sums C_e, C_ev [B, L + 1, D]
    (C[u] the sum over keys < u) with bias 0."""
    NT = tl.cdiv(T, BT)
    i, pc = _grouped(NT, tl.num_programs(0) // NT, GROUP)
    i = NT - 1 - i
    b, c0, r0 = pc // NB, (pc % NB) * BD, i * BT
    rows = r0 + tl.arange(0, BT)
    cols = c0 + tl.arange(0, BD)
    m = tl.full([BT], float("-inf"), tl.float32)
    start = 0
    if LOCAL:  # bias 0 for the keys before the window: m starts at 0 where there are some
        lo = tl.maximum(first + rows - S + 1, 0)
        m = tl.where(lo > 0, 0.0, m)
        start = (tl.maximum(first + r0 - S + 1, 0) // BK) * BK
    num = tl.zeros([BT, BD], tl.float32)
    den = tl.zeros([BT, BD], tl.float32)
    stop = L
    if CAUSAL:
        stop = tl.minimum(first + r0 + BT, L)
    for j0 in range(start, stop, BK):
        w = _bias(w_ptr, r0, j0, T, L, first, sw0, S, CAUSAL, LOCAL, BT, BK)
        m_new = tl.maximum(m, tl.max(w, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows past T: nothing seen
        alpha = tl.exp(m - m_ref)
        p = tl.exp(w - m_ref[:, None])
        xev = _load(xev_ptr, b, j0, c0, L, D, BK, BD)
        xe = _load(xe_ptr, b, j0, c0, L, D, BK, BD)
        num = num * alpha[:, None] + tl.dot(p, xev, input_precision=PREC)
        den = den * alpha[:, None] + tl.dot(p, xe, input_precision=PREC)
        m = m_new
    valid = (rows[:, None] < T) & (cols[None, :] < D)
    if LOCAL:
        f = tl.exp(-tl.where(m == float("-inf"), 0.0, m))[:, None]
        num += f * _rows_at(cev_ptr, b, lo, rows < T, c0, L + 1, D, BT, BD)
        den += f * _rows_at(ce_ptr, b, lo, rows < T, c0, L + 1, D, BT, BD)
    lossy = (den < thr) & valid
    den = tl.where(valid, den, 1.0)
    den = tl.where(lossy, float("inf"), den)  # a lossy row is redone outside: o 0, no gradient
    q = _load(q_ptr, b, r0, c0, T, D, BT, BD).to(tl.float32)
    ratio = num / den
    _store(o_ptr, tl.sigmoid(q) * ratio, b, r0, c0, T, D, BT, BD)
    _store(r_ptr, ratio, b, r0, c0, T, D, BT, BD)
    _store(den_ptr, den, b, r0, c0, T, D, BT, BD)
    flagged = tl.max(lossy.to(tl.int32), axis=1)
    tl.store(flag_ptr + rows, flagged, mask=(rows < T) & (flagged > 0))
    if pc == 0:
        tl.store(mw_ptr + rows, m, mask=rows < T)


@triton.jit
def _bwd_prep_kernel(do_ptr, q_ptr, r_ptr, den_ptr, u_ptr, z_ptr, dq_ptr, T, D,
                     BT: tl.constexpr, BD: tl.constexpr):
    """(c) with dR = dO sigmoid(Q): U = dR / den, Z = U R, dQ = dR R (1 - sigmoid(Q))."""
    i, b, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    do = _load(do_ptr, b, i * BT, c * BD, T, D, BT, BD).to(tl.float32)
    q = _load(q_ptr, b, i * BT, c * BD, T, D, BT, BD).to(tl.float32)
    ratio = _load(r_ptr, b, i * BT, c * BD, T, D, BT, BD)
    den = _load(den_ptr, b, i * BT, c * BD, T, D, BT, BD, float("inf"))
    s = tl.sigmoid(q)
    u = do * s / den
    _store(u_ptr, u, b, i * BT, c * BD, T, D, BT, BD)
    _store(z_ptr, u * ratio, b, i * BT, c * BD, T, D, BT, BD)
    _store(dq_ptr, do * s * ratio * (1.0 - s), b, i * BT, c * BD, T, D, BT, BD)


@triton.jit
def _bwd_kv_kernel(k_ptr, v_ptr, m_ptr, u_ptr, z_ptr, su_ptr, sz_ptr, w_ptr, mw_ptr, dk_ptr,
                   dv_ptr, T, L, D, first, sw0, S, NB, CAUSAL: tl.constexpr,
                   LOCAL: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
                   PREC: tl.constexpr, GROUP: tl.constexpr):
    """(d) One key block and one channel block of one batch row, grouped (``_grouped``); the
    first key blocks, which most rows see, first. AFT-local (``LOCAL``): only the query blocks
    whose windows hold the keys, plus, for the rows that see a key through their prefix sums
    (rows from key + S on), the suffix sums S_u, S_z [B, T, D] of e^-m U and e^-m Z."""
    NK = tl.cdiv(L, BK)
    j, pc = _grouped(NK, tl.num_programs(0) // NK, GROUP)
    b, c0, j0 = pc // NB, (pc % NB) * BD, j * BK
    gv = tl.zeros([BK, BD], tl.float32)
    gz = tl.zeros([BK, BD], tl.float32)
    start = 0
    if CAUSAL:  # the first query block with a row that sees the keys
        start = (tl.maximum(j0 - first, 0) // BT) * BT
    stop = T
    if LOCAL:  # the last row whose window holds one of the keys
        stop = tl.minimum(j0 + BK + S - 1 - first, T)
    for r0 in range(start, stop, BT):
        rows = r0 + tl.arange(0, BT)
        mw = tl.load(mw_ptr + rows, mask=rows < T, other=0.0)
        p = tl.exp(_bias(w_ptr, r0, j0, T, L, first, sw0, S, CAUSAL, LOCAL, BT, BK)
                   - mw[:, None])
        u = _load(u_ptr, b, r0, c0, T, D, BT, BD)
        z = _load(z_ptr, b, r0, c0, T, D, BT, BD)
        pt = tl.trans(p)
        gv = tl.dot(pt, u, gv, input_precision=PREC)
        gz = tl.dot(pt, z, gz, input_precision=PREC)
    if LOCAL:
        after = j0 + tl.arange(0, BK) + S - first  # the first row whose prefix holds the key
        seen = (after < T) & (j0 + tl.arange(0, BK) < L)
        gv += _rows_at(su_ptr, b, after, seen, c0, T, D, BK, BD)
        gz += _rows_at(sz_ptr, b, after, seen, c0, T, D, BK, BD)
    cols = c0 + tl.arange(0, BD)
    m = tl.load(m_ptr + b * D + cols, mask=cols < D, other=0.0)
    e = tl.exp(_load(k_ptr, b, j0, c0, L, D, BK, BD).to(tl.float32) - m[None, :])
    v = _load(v_ptr, b, j0, c0, L, D, BK, BD).to(tl.float32)
    dv = e * gv
    _store(dv_ptr, dv, b, j0, c0, L, D, BK, BD)
    _store(dk_ptr, v * dv - e * gz, b, j0, c0, L, D, BK, BD)


@triton.jit
def _bwd_w_kernel(u_ptr, z_ptr, xe_ptr, xev_ptr, w_ptr, mw_ptr, dw_ptr, B, T, L, D, first, sw0,
                  S, NJ, CAUSAL: tl.constexpr, LOCAL: tl.constexpr, BT: tl.constexpr,
                  BK: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr,
                  GROUP: tl.constexpr):
    """(e) One tile of the biases' gradient (query block, key block; grouped, ``_grouped``),
    contracted over every batch row and channel. AFT-full: dw [T, L], NJ = all key blocks; a
    causal tile wholly after the diagonal runs no step and stores nothing (dw starts at zero).
    AFT-local: the NJ key blocks from the first that a row's window reaches, stored into the
    band's gradient [T, S] (row stride S)."""
    NT = tl.cdiv(T, BT)
    i, j = _grouped(NT, NJ, GROUP)
    r0 = i * BT
    if LOCAL:
        j = tl.maximum(first + r0 - S + 1, 0) // BK + j
    j0 = j * BK
    last = L - 1  # the last key any row of the tile sees
    if CAUSAL:
        last = tl.minimum(first + tl.minimum(r0 + BT, T) - 1, L - 1)
    nb = tl.where(j0 <= last, B, 0)  # no batch row to contract for a tile after the diagonal
    acc = tl.zeros([BT, BK], tl.float32)
    for b in range(0, nb):
        for c0 in range(0, D, BD):
            u = _load(u_ptr, b, r0, c0, T, D, BT, BD)
            z = _load(z_ptr, b, r0, c0, T, D, BT, BD)
            xev = _load(xev_ptr, b, j0, c0, L, D, BK, BD)
            xe = _load(xe_ptr, b, j0, c0, L, D, BK, BD)
            acc = tl.dot(u, tl.trans(xev), acc, input_precision=PREC)
            acc = tl.dot(-z, tl.trans(xe), acc, input_precision=PREC)
    rows = r0 + tl.arange(0, BT)
    keys = j0 + tl.arange(0, BK)
    mw = tl.load(mw_ptr + rows, mask=rows < T, other=0.0)
    p = tl.exp(_bias(w_ptr, r0, j0, T, L, first, sw0, S, CAUSAL, LOCAL, BT, BK) - mw[:, None])
    ok = (rows[:, None] < T) & (keys[None, :] <= last)
    if LOCAL:
        offset = first + rows[:, None] - keys[None, :]
        ok = ok & (offset >= 0) & (offset < S)
        tl.store(dw_ptr + rows[:, None] * S + offset, p * acc, mask=ok)
    else:
        tl.store(dw_ptr + rows[:, None] * L + keys[None, :], p * acc, mask=ok)


# ---------------------------------------------------------------------------------------------
# Host side


class _Launch(NamedTuple):
    """What every launch of one call shares. ``window``: AFT-local's (0 for AFT-full)."""

    B: int
    T: int
    L: int
    D: int
    first: int
    causal: bool
    window: int
    tiles: dict
    consts: dict

    def nb(self, kernel: str) -> int:
        return triton.cdiv(self.D, self.tiles[kernel].BD)

    def args(self, kernel: str, products: bool = True) -> dict:
        t = self.tiles[kernel]
        extra = ({"BK": t.BK, "CAUSAL": self.causal, "LOCAL": self.window > 0, "GROUP": GROUP,
                  **self.consts} if products else {})
        stages = {} if t.stages is None else {"num_stages": t.stages}
        return {"BT": t.BT, "BD": t.BD, "num_warps": t.warps, **stages, **extra}


def _launch(q: torch.Tensor, k: torch.Tensor, first: int, causal: bool, window: int,
            op: str) -> _Launch:
    B, T, D = q.shape
    arch = _arch(q.device)
    # A direct call with float32 inputs (no spill-free tiling) runs the half tiling, correct.
    tiles = tile_config(arch, q.dtype, op) or tile_config(arch, torch.bfloat16, op)
    consts = {"PREC": precisions(q.dtype)[1]}  # TF32 for half inputs, exact for float32
    return _Launch(B, T, k.shape[1], D, first, causal, window, tiles, consts)


def _operands(L: _Launch, k, v):
    """(a): the column maxima M [B, D] and X_e, X_ev [B, L, D] (float32)."""
    M = k.amax(dim=1).to(torch.float32).contiguous()
    xe, xev = (torch.empty(L.B, L.L, L.D, dtype=torch.float32, device=k.device)
               for _ in range(2))
    t = L.tiles["prep"]
    _prep_kernel[(triton.cdiv(L.L, t.BT), L.B, L.nb("prep"))](
        k, v, M, xe, xev, L.L, L.D, **L.args("prep", products=False))
    return M, xe, xev


def _exclusive_prefix(x: torch.Tensor) -> torch.Tensor:
    """C [B, L + 1, D] with C[u] the sum of x [B, L, D] over rows < u."""
    return F.pad(cumsum_time(x), (0, 0, 1, 0))


def _forward(L: _Launch, q, k, v, w):
    """(a), (b): o [B, T, D] in q's dtype, what the backward keeps (the ratio, the
    denominators, the row maxima), flags [T] of lossy rows."""
    dev = q.device
    _, xe, xev = _operands(L, k, v)
    ce, cev = (_exclusive_prefix(xe), _exclusive_prefix(xev)) if L.window else (xe, xev)
    o = torch.empty_like(q)
    ratio, den = (torch.empty(q.shape, dtype=torch.float32, device=dev) for _ in range(2))
    mw = torch.empty(L.T, dtype=torch.float32, device=dev)
    flags = torch.zeros(L.T, dtype=torch.int32, device=dev)
    t = L.tiles["fwd"]
    _fwd_kernel[(L.B * L.nb("fwd") * triton.cdiv(L.T, t.BT),)](
        q, xe, xev, w, ce, cev, o, ratio, den, mw, flags, L.T, L.L, L.D, L.first, w.stride(0),
        max(L.window, 1), L.nb("fwd"), lossy_threshold(q.dtype, L.L), **L.args("fwd"))
    return o, (ratio, den, mw), flags


def _backward(L: _Launch, q, k, v, w, saved, do, needs):
    """(a) again, (c) to (e): dq, dk, dv, dw (None where not needed) in their inputs' dtypes."""
    ratio, den, mw = saved
    u, z = (torch.empty(L.B, L.T, L.D, dtype=torch.float32, device=q.device) for _ in range(2))
    dq = torch.empty_like(q)
    t = L.tiles["bwd_prep"]
    _bwd_prep_kernel[(triton.cdiv(L.T, t.BT), L.B, L.nb("bwd_prep"))](
        do, q, ratio, den, u, z, dq, L.T, L.D, **L.args("bwd_prep", products=False))
    dk = dv = dw = None
    if not (needs[1] or needs[2] or needs[3]):
        return dq, dk, dv, dw
    M, xe, xev = _operands(L, k, v)  # recomputed: cheaper than keeping two [B, L, D] in float32
    if needs[1] or needs[2]:
        su, sz = u, z  # AFT-local: suffix sums over the rows of e^-m U, e^-m Z
        if L.window:
            scale = torch.exp(-mw)[None, :, None]
            su, sz = (cumsum_time((scale * x).flip(1)).flip(1).contiguous() for x in (u, z))
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        t = L.tiles["bwd_kv"]
        _bwd_kv_kernel[(L.B * L.nb("bwd_kv") * triton.cdiv(L.L, t.BK),)](
            k, v, M, u, z, su, sz, w, mw, dk, dv, L.T, L.L, L.D, L.first, w.stride(0),
            max(L.window, 1), L.nb("bwd_kv"), **L.args("bwd_kv"))
    if needs[3]:
        t = L.tiles["bwd_w"]
        if L.window:  # the band's gradient
            dw = torch.zeros(L.T, L.window, dtype=torch.float32, device=q.device)
            nj = triton.cdiv(t.BT + L.window - 1, t.BK) + 1
        else:
            dw = (torch.zeros if L.causal else torch.empty)(L.T, L.L, dtype=torch.float32,
                                                            device=q.device)
            nj = triton.cdiv(L.L, t.BK)
        _bwd_w_kernel[(nj * triton.cdiv(L.T, t.BT),)](
            u, z, xe, xev, w, mw, dw, L.B, L.T, L.L, L.D, L.first, w.stride(0),
            max(L.window, 1), nj, **L.args("bwd_w"))
        dw = dw.to(w.dtype)
    return dq if needs[0] else None, dk, dv, dw


class _AFTTriton(torch.autograd.Function):
    """(o, flags) = the product form of rows first..L-1 with the gate (kernels above): AFT-full
    (``window`` 0; q [B, T, D], k, v [B, L, D], w [T, L]) or causal AFT-local (the band w
    [T, window], first 0); flags [T] int32 (1: a lossy row, o there 0)."""

    @staticmethod
    def forward(ctx, q, k, v, w, first, causal, window):  # type: ignore[override]
        L = _launch(q, k, first, causal, window, "aft_local" if window else "aft")
        o, saved, flags = _forward(L, q, k, v, w)
        ctx.save_for_backward(q, k, v, w, *saved)
        ctx.L = L
        ctx.mark_non_differentiable(flags)
        return o, flags

    @staticmethod
    def backward(ctx, do, _flags):  # type: ignore[override]
        q, k, v, w, *saved = ctx.saved_tensors
        grads = _backward(ctx.L, q, k, v, w, saved, do.contiguous(), ctx.needs_input_grad)
        return (*grads, None, None, None)


def _contiguous(q, k, v, w):
    """q, k, v contiguous, and w with contiguous rows."""
    return (*(x.contiguous() for x in (q, k, v)), w if w.stride(1) == 1 else w.contiguous())


def aft_full_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, first: int, causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """AFT-full (docs/maths.md 4.1) rows first..L-1 by the product form in the kernels above,
    gated: q [B, T, D] (float16/bfloat16/float32), k, v [B, L, D] (any float dtype; the first
    ``first`` keys a cached past), w [T, L] (rows the call's tokens; any float dtype; copied
    unless its keys are contiguous). Returns (o [B, T, D] in q's dtype, lossy [T] bool): a
    lossy row's o is 0 and gets no gradient; the caller redoes it (``product.redo_lossy``)."""
    o, flags = _AFTTriton.apply(*_contiguous(q, k, v, w), first, causal, 0)
    return o, flags.bool()


def aft_local_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, window: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal AFT-local (docs/maths.md 4.2) of a call without a carried state by the banded
    product form (docs/maths.md 4.4) in the kernels above, gated: q, k, v [B, T, D]; w the band
    [T, window] (w[i, o] the bias at offset o; entries before position 0 unread). Returns
    (o [B, T, D] in q's dtype, lossy [T] bool), as ``aft_full_triton``."""
    o, flags = _AFTTriton.apply(*_contiguous(q, k, v, w), 0, True, window)
    return o, flags.bool()
