"""Triton kernels for the dual form of TTT-Linear and TTT-MLP (docs/maths.md 2.2-2.4), forward
and backward: one program per (batch, head) walks the sequence one mini-batch at a time.

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim, b mini-batch size,
N = ceil(T / b) mini-batches, NF = floor(T / b) full ones; BB = max(16, next power of two >= b)
the mini-batch tile (b = 16 is one tensor-core tile), BK, BV the key and value tiles (powers of
two >= Dk, Dv, at least 16), KC the rows of a weight block. Rows past b or T and columns past
Dk, Dv load as zeros and are never stored.

Why one program per (batch, head): the weights a mini-batch starts from are the previous one's
result, and with the inner LayerNorm every row of Z = X W needs all Dv columns (its mean and
variance), so neither the mini-batches nor the value columns of a head can go to different
programs. docs/gpu_ttt_kernels.md estimates what that costs on an H100.

Per mini-batch with start weights (W, b), keys K, queries Q, targets V (- K with the residual),
eta, tau (the head's token scales; tau_b the last), E_ij = tau_i eta_j (j <= i):
    Zk = K W + b;  G = dl/dZk (the LayerNorm gradient, fused)
    Zbar = Q W + b - (E * (Q K^T [+ 1])) G;  o = [LN](Zbar) [+ q]   (output LayerNorm fused)
    W <- W - tau_b K^T (eta G);  b <- b - tau_b sum_j eta_j G_j
A last, partly filled mini-batch stores its gradient sums S = K^T (eta G), s = sum eta G
instead of updating (the state contract of ops/ttt/common.py's ``Carry``).

Layout. Every per-token tile is held transposed, [D, BB] (a mini-batch's tokens as columns),
so that the products' rows (M) are the head dim: Triton stacks the warps of a chain of
products along M, and with the b = 16 tokens as M every warp would hold whole [16, D] tiles.
The weights live in a per-program float32 buffer in global memory (64 KiB per head at
D = 128, L1/L2-resident) and stream through the products in blocks of KC rows: held in
registers whole, the weights and their gradient made the backward spill at D = 128 on both
targets (and at D = 64). The b x b scores Q K^T need no weights: ``_qk_kernel`` forms them
for all mini-batches in parallel.

Kernels. Forward: ``_qk_kernel`` (grid N x B*H), ``_linear_fwd_kernel`` (B*H programs,
sequential over mini-batches; stores the weights entering every ``seg``-th mini-batch as
checkpoints when gradients are needed). Backward, per segment of ``seg`` mini-batches, last
first (a partial last mini-batch first of all, as its own segment):
    ``_linear_bwd_a_kernel`` (B*H, sequential): the segment forward again from its checkpoint,
        each mini-batch's start weights into a scratch buffer, and the backward of its
        read-out (which needs no gradient of later weights): rows G, dZbar, the read-out's
        share of dG, the LayerNorm's x_hat and g, dA = dM * E;
    ``_linear_bwd_b_kernel`` (B*H, sequential, last mini-batch first): the carried gradient
        of the weights D through the gradient sums and the keys' LayerNorm gradient; dV,
        deta, and D <- D + Q^T dZbar + K^T dZk, keeping each mini-batch's D for
    ``_linear_bwd_c_kernel`` (segment x B*H, parallel): dQ, dK.
This split keeps each kernel spill-free (one kernel doing all of it spilled ~0.5-1 KiB).
The per-head parameters' gradients (gamma, beta, tau) are accumulated per program across the
launches and summed over the batch on the host.

Calls that start inside a mini-batch (a state with gradient sums, ``Carry.pos`` > 0): the
host runs the rest of that mini-batch (at most b - 1 tokens) through the PyTorch dual form
(chunk.py) and the kernels from the next boundary on, so the kernels never carry a previous
call's sums; the result is the state round trip the PyTorch forms make between pieces.

Precision: q, k, v arrive in their own dtype (float16, bfloat16, float32) and are upcast on
chip; weights, gradient sums, LayerNorm statistics and every accumulation are float32.
Products run with ``precisions``' float32 setting of ops/_triton_common.py: exact float32 for
float32 inputs, TF32 for half inputs (a bfloat16 or float16 value is exact in TF32).

TTT-MLP (``_mlp_fwd_kernel``): W1
[Dk, Dh], W2 [Dh, Dv] (Dh = 4 Dk; 2 x 256 KiB per head at D = 128) stream the same way, in
hidden blocks of HB units; per mini-batch two passes over the blocks: the first forms
Z2 = gelu(K W1 + b1) W2 + b2 and its LayerNorm gradient G2; the second per block G1 =
(G2 W2^T) * gelu'(Z1) (G2 read back from scratch by blocks of value rows), the queries'
Zbar1 = Q W1 + b1 - (E * (Q K^T [+ 1])) G1, Xbar2 = gelu(Zbar1) through W2 into the read-out,
the b x b scores Xbar2 X2^T, and the block's update; with gradients it also stores the
weights entering every ``seg``-th mini-batch. Backward, per segment, last first (a partial last
mini-batch first of all), split as TTT-Linear's:
    ``_mlp_recompute_kernel`` (B*H, sequential): the segment's forward again from its
        checkpoint, each mini-batch's start weights into slots;
    ``_mlp_bwd_a_kernel`` (segment x B*H, parallel): each mini-batch's forward again from its
        slot and the backward of its read-out (no gradient of later weights needed): dQ, the
        read-out's shares of dK, deta, dtau, dgamma, dbeta, and the hidden and value rows;
    ``_mlp_bwd_b_kernel`` (B*H, sequential, last mini-batch first): the carried gradient of
        the weights through the update and the keys' LayerNorm gradient: dV, the rest of dK
        and deta, the gradients of the start weights.
The weights stream in hidden blocks of 16 units, the hidden rows go through per-mini-batch
scratch; products whose depth is the value dim (G2 W2^T and the like) read their value rows
back by blocks of 16, as the forward does. Every kernel compiles without register spills
(docs/gpu_ttt_kernels.md has the figures and the costs; mlp_scan.py the formulas).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._triton_common import _arch, _pow2, _upcast_tiles, precisions, tiled_everywhere
from .common import Carry
from .triton_tiles import (
    _back_b_end,
    _back_b_start,
    _block,
    _blockT,
    _cols,
    _copy_flat,
    _copy_mat,
    _dot,
    _head,
    _keys_back,
    _linear_in,
    _linear_out,
    _ln,
    _ln_affine,
    _ln_back,
    _ln_grad_back,
    _load_tile,
    _loss_grad,
    _mb,
    _readout_back,
    _store_block,
    _store_blockT,
    _store_cols,
    _store_tile,
    _store_vec,
    _store_wrows,
    _vec,
    _wrows,
)

__all__ = ["BACKWARD_OPS", "MAX_D", "MAX_MINI_BATCH", "OPS", "TileConfig", "supports", "tile_config",
           "ttt_linear_triton", "ttt_mlp_triton"]

OPS = ("ttt_linear", "ttt_mlp")  # the ops with kernels here (registered in inner_loop.py)
MAX_D = 128  # Dk and Dv (ops/backend.py TRITON_MAX_DK)
# The dispatcher's head sizes are multiples of this (inner_loop.py): their launches get Triton's
# alignment specialisation, which the compile test covers; without it (an odd head size) the
# loads are not vectorised and the forward spills at D = 128.
HEAD_MULTIPLE = 16
MAX_MINI_BATCH = 64  # the mini-batch tile BB
# The ops whose backward kernels compile without register spills (the compile test,
# tests/ops/test_ttt_triton_compile.py): the dispatcher leaves calls of any other op that
# record gradients to PyTorch (inner_loop.py). Both are.
BACKWARD_OPS = ("ttt_linear", "ttt_mlp")
SEGMENT = 16  # mini-batches per checkpoint when no checkpoint_group is given
_GELU_C = tl.constexpr(math.sqrt(2.0 / math.pi))
_GELU_A = tl.constexpr(0.044715)


class TileConfig(NamedTuple):
    """Warps of the sequential kernels (and of the backward's parallel one), KC the rows of a
    weight block streamed through a product and HB, TTT-MLP's hidden block."""

    warps: int
    KC: int = 16
    HB: int = 32
    HBB: int = 16  # TTT-MLP's backward kernels' hidden block


def tile_config(arch: int, dtype: torch.dtype, op: str, D: int = MAX_D) -> TileConfig | None:
    """The launch choice for ``op`` (one of OPS) with head size D = max(Dk, Dv) <= 128 on
    compute capability ``arch`` (80 = sm_80, 90 = sm_90; the same tiles on both) and ``dtype``
    inputs, or None where no tiling compiles without register spills.
    tests/ops/test_ttt_triton_compile.py compiles every launch with these for sm_80 and sm_90.

    Half inputs: 4 warps up to D = 64, 8 above (the products' rows are the head dim, 16 per
    warp), weight blocks of 16 rows (KC; 32 spills at D = 64 on sm_80, 64 in the backward).
    Float32 inputs multiply in exact float32, FMA loops holding whole operand rows, and spill
    at these tiles (the forward at D = 64 on sm_90 by some 200 bytes, the backward's
    sequential pass at D = 128 by ~500): the dispatcher leaves them to PyTorch, as it does
    the float32 delta rule; a direct call still runs them, on the half tiling."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if dtype not in (torch.float16, torch.bfloat16) or D > MAX_D:
        return None
    return TileConfig(warps=8 if D > 64 else 4)


def supports(op: str, dtype: torch.dtype) -> bool:
    """Whether ``op`` with ``dtype`` inputs has a tiling on every target (sm_80 and up) for
    every head size up to MAX_D."""
    return tiled_everywhere(tile_config, op, dtype, MAX_D)


# ---------------------------------------------------------------------------------------------
# TTT-Linear


@triton.jit
def _qk_kernel(q_ptr, k_ptr, a_ptr, T, H, Dk, b, N, HAS_BIAS: tl.constexpr, PREC: tl.constexpr,
               BB: tl.constexpr, BK: tl.constexpr):
    """A^T = (Q K^T [+ 1])^T [BB, BB] of every mini-batch into a [B*H, N, BB, BB] (float32):
    the read-out's b x b scores, which need no weights, for all mini-batches in parallel."""
    n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    bb = bh // H
    h = bh % H
    base = (bb * T * H + h) * Dk
    _, t, m = _mb(n, b, T, BB)
    kt = _cols(k_ptr, base, t, m, H, Dk, BK)
    qt = _cols(q_ptr, base, t, m, H, Dk, BK)
    At = _dot(tl.trans(kt), qt, PREC)
    if HAS_BIAS:
        At += 1.0
    r = tl.arange(0, BB)
    tl.store(a_ptr + ((bh * N + n) * BB + r[:, None]) * BB + r[None, :], At)


@triton.jit
def _linear_z(w_ptr, bv, k_ptr, q_ptr, base_k, t, m, H, Dk, Dv, WITH_Q: tl.constexpr,
              PREC: tl.constexpr, BB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
              KC: tl.constexpr):
    """Zk^T = (K W + b)^T and (WITH_Q) Zq^T = (Q W + b)^T [BV, BB], the weights w [Dk, Dv]
    streamed in blocks of KC rows."""
    zk = tl.zeros([BV, BB], dtype=tl.float32) + bv[:, None]
    zq = zk
    for c0 in range(0, BK, KC):
        wc = _wrows(w_ptr, c0, Dk, Dv, BV, KC)
        zk = _dot(wc, _cols(k_ptr, base_k, t, m, H, Dk, KC, c0), PREC, zk)
        if WITH_Q:
            zq = _dot(wc, _cols(q_ptr, base_k, t, m, H, Dk, KC, c0), PREC, zq)
    return zk, zq


@triton.jit
def _linear_add(src_ptr, dst_ptr, Hm, k_ptr, base_k, t, m, H, Dk, Dv, PREC: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr):
    """dst = src + (Hm K)^T... as weights: dst [Dk, Dv] = src + K^T Hm^T... i.e. W + K^T H
    for H^T = Hm [BV, BB], in blocks of KC rows (dst may be src)."""
    for c0 in range(0, BK, KC):
        wc = _dot(Hm, tl.trans(_cols(k_ptr, base_k, t, m, H, Dk, KC, c0)), PREC,
                  _wrows(src_ptr, c0, Dk, Dv, BV, KC))
        tl.debug_barrier()  # every thread has read the block before it is overwritten
        _store_wrows(dst_ptr, wc, c0, Dk, Dv, BV, KC)
    tl.debug_barrier()  # written before anything reads the weights again


@triton.jit
def _linear_cols(w_ptr, bv, k_ptr, q_ptr, base_k, t, m, kt, vt, Mt, gam, bet, cm, H, Dk, Dv,
                 HAS_LN: tl.constexpr, RESIDUAL: tl.constexpr, PREC: tl.constexpr,
                 BB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr):
    """One mini-batch's forward from its start weights w [Dk, Dv], bias bv [BV], with values
    vt [BV, BB], keys kt [BV, BB] (read with the residual only) and
    Mt = (E * (Q K^T [+ 1]))^T: (G^T, x_hat, 1/s, g of the keys' LayerNorm gradient,
    Zbar^T [BV, BB])."""
    tgt = vt - kt if RESIDUAL else vt
    zk, zq = _linear_z(w_ptr, bv, k_ptr, q_ptr, base_k, t, m, H, Dk, Dv, True, PREC, BB, BK,
                       BV, KC)
    G, xh, r, g = _loss_grad(zk, tgt, gam, bet, cm, Dv, HAS_LN)
    zbar = zq - _dot(G, Mt, PREC)
    return G, xh, r, g, zbar


@triton.jit
def _linear_fwd_kernel(
    q_ptr, k_ptr, v_ptr, eta_ptr, tau_ptr, a_ptr, lnw_ptr, lnb_ptr, b0_ptr,
    o_ptr, w_ptr, bias_ptr, sw_ptr, sb_ptr, ckw_ptr, ckb_ptr,
    T, H, Dk, Dv, b, N, NF, seg, store_ck,
    HAS_BIAS: tl.constexpr, HAS_LN: tl.constexpr, HAS_LNB: tl.constexpr,
    RESIDUAL: tl.constexpr, PREC: tl.constexpr,
    BB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr,
):
    """TTT-Linear forward for one (batch, head) over N mini-batches, NF of them full.
    w [B*H, Dk, Dv] holds the start weights and is updated in place: the weights after the
    last full mini-batch (bias [B*H, Dv] likewise from b0). Writes o [B, T, H, Dv], the
    gradient sums of a last partial mini-batch (sw, sb, if NF < N) and, if ``store_ck``, the
    weights entering every ``seg``-th mini-batch (ckw [B*H, NC, Dk, Dv], ckb [B*H, NC, Dv]).
    a: the scores of ``_qk_kernel``."""
    bh = tl.program_id(0).to(tl.int64)
    h, base_k, base_v, ebase = _head(bh, H, T, Dk, Dv)
    NC = tl.cdiv(NF, seg)
    cm = tl.arange(0, BV) < Dv
    wp = w_ptr + bh * Dk * Dv
    bv = tl.zeros([BV], dtype=tl.float32)
    if HAS_BIAS:
        bv = _vec(b0_ptr + bh * Dv, Dv, BV)
    gam, bet = _ln_affine(lnw_ptr, lnb_ptr, h, Dv, BV, HAS_LN, HAS_LNB)
    tau_b = tl.load(tau_ptr + h * b + b - 1).to(tl.float32)
    kt = tl.zeros([BV, BB], dtype=tl.float32)
    for n in range(0, NF):
        if store_ck and n % seg == 0:
            _copy_mat(wp, ckw_ptr + (bh * NC + n // seg) * Dk * Dv, Dk, Dv, BK, BV, KC)
            if HAS_BIAS:
                _store_vec(ckb_ptr + (bh * NC + n // seg) * Dv, bv, Dv, BV)
        _, t, m, eta, _, Et, At = _linear_in(eta_ptr, tau_ptr, a_ptr, bh, h, ebase, n, T, H, b,
                                             N, BB)
        vt = _cols(v_ptr, base_v, t, m, H, Dv, BV)
        if RESIDUAL:  # Dk == Dv
            kt = _cols(k_ptr, base_v, t, m, H, Dv, BV)
        G, _, _, _, zbar = _linear_cols(wp, bv, k_ptr, q_ptr, base_k, t, m, kt, vt, Et * At,
                                        gam, bet, cm, H, Dk, Dv, HAS_LN, RESIDUAL, PREC, BB, BK,
                                        BV, KC)
        _linear_out(o_ptr, zbar, q_ptr, gam, bet, cm, base_v, t, m, H, Dv, HAS_LN, RESIDUAL, BV)
        # W <- W - tau_b K^T (eta G)
        Hm = G * (eta * -tau_b)[None, :]
        _linear_add(wp, wp, Hm, k_ptr, base_k, t, m, H, Dk, Dv, PREC, BK, BV, KC)
        if HAS_BIAS:
            bv += tl.sum(Hm, axis=1)
    if HAS_BIAS:
        _store_vec(bias_ptr + bh * Dv, bv, Dv, BV)
    if NF < N:  # a last, partly filled mini-batch: its sums S = K^T (eta G), not an update
        _, t, m, eta, _, Et, At = _linear_in(eta_ptr, tau_ptr, a_ptr, bh, h, ebase, NF, T, H, b,
                                             N, BB)
        vt = _cols(v_ptr, base_v, t, m, H, Dv, BV)
        if RESIDUAL:
            kt = _cols(k_ptr, base_v, t, m, H, Dv, BV)
        G, _, _, _, zbar = _linear_cols(wp, bv, k_ptr, q_ptr, base_k, t, m, kt, vt, Et * At,
                                        gam, bet, cm, H, Dk, Dv, HAS_LN, RESIDUAL, PREC, BB, BK,
                                        BV, KC)
        _linear_out(o_ptr, zbar, q_ptr, gam, bet, cm, base_v, t, m, H, Dv, HAS_LN, RESIDUAL, BV)
        Hm = G * eta[None, :]
        for c0 in range(0, BK, KC):
            kc = _cols(k_ptr, base_k, t, m, H, Dk, KC, c0)
            _store_wrows(sw_ptr + bh * Dk * Dv, _dot(Hm, tl.trans(kc), PREC), c0, Dk, Dv, BV, KC)
        if HAS_BIAS:
            _store_vec(sb_ptr + bh * Dv, tl.sum(Hm, axis=1), Dv, BV)


@triton.jit
def _scores_grad(gs_ptr, G, dzbar, PREC: tl.constexpr, BV: tl.constexpr, BB: tl.constexpr,
                 DC: tl.constexpr):
    """dM^T = -(dZbar G^T)^T [BB, BB] from G^T, dZbar^T [BV, BB], contracted over the value
    dim in blocks of DC rows read back from the program's scratch gs [2, BV, BB]: a product
    with BB rows has every warp hold its whole operands (the warps replicate its rows), which
    for a [BB, 128] float32 operand is 64 registers per thread."""
    _store_tile(gs_ptr, G, BV, BB)
    _store_tile(gs_ptr + BV * BB, dzbar, BV, BB)
    tl.debug_barrier()
    dMt = tl.zeros([BB, BB], dtype=tl.float32)
    c = tl.arange(0, BB)
    rc = tl.arange(0, DC)
    for d0 in range(0, BV, DC):
        offc = (d0 + rc)[:, None] * BB + c[None, :]
        gc = tl.load(gs_ptr + offc)
        dc = tl.load(gs_ptr + BV * BB + offc)
        dMt -= _dot(tl.trans(gc), dc, PREC)
    tl.debug_barrier()  # read before the next mini-batch writes
    return dMt


@triton.jit
def _linear_back_a(
    wp, bv, dgam, dbet, dtau,
    q_ptr, k_ptr, v_ptr, eta_ptr, tau_ptr, a_ptr, do_ptr, gs_ptr, rows_ptr, rr_ptr, at_ptr,
    bh, h, base_k, base_v, ebase, n, T, H, Dk, Dv, b, N, gam, bet, cm,
    HAS_LN: tl.constexpr, RESIDUAL: tl.constexpr, PREC: tl.constexpr, BB: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr, DC: tl.constexpr,
):
    """The part of mini-batch n's backward that needs its start weights (wp [Dk, Dv], bv) but
    not the gradient of later weights: the read-out's. Stores into the mini-batch's rows
    [5, BV, BB] G^T, dZbar^T, the read-out's share of dG^T (-(E * A)^T dZbar, transposed)
    and the keys' LayerNorm x_hat, g; into rr [2, BB] its 1/s and the read-out's share of
    deta; into at [BB, BB] dA^T. Returns the accumulators dgamma, dbeta, dtau."""
    i, t, m, eta, tau, Et, At = _linear_in(eta_ptr, tau_ptr, a_ptr, bh, h, ebase, n, T, H, b,
                                           N, BB)
    Mt = Et * At
    kt = tl.zeros([BV, BB], dtype=tl.float32)
    if RESIDUAL:
        kt = _cols(k_ptr, base_v, t, m, H, Dv, BV)
    G, xh, r, g, zbar = _linear_cols(wp, bv, k_ptr, q_ptr, base_k, t, m, kt,
                                     _cols(v_ptr, base_v, t, m, H, Dv, BV), Mt, gam, bet, cm,
                                     H, Dk, Dv, HAS_LN, RESIDUAL, PREC, BB, BK, BV, KC)
    rb = tl.arange(0, BB)
    if HAS_LN:
        _store_tile(rows_ptr + 3 * BV * BB, xh, BV, BB)
        _store_tile(rows_ptr + 4 * BV * BB, g, BV, BB)
        tl.store(rr_ptr + rb, r)
    dO = _cols(do_ptr, base_v, t, m, H, Dv, BV)
    # read-out: o = [LN](Zbar) [+ q]
    dzbar, dgam, dbet = _readout_back(dO, zbar, G, rows_ptr, gam, cm, dgam, dbet, Dv, HAS_LN,
                                      BB, BV)
    _store_tile(rows_ptr + 2 * BV * BB, -_dot(dzbar, tl.trans(Mt), PREC), BV, BB)
    # Zbar's b x b term -(E * A) G: dM = -dZbar G^T, dA = dM * E, dE = dM * A
    dMt = _scores_grad(gs_ptr, G, dzbar, PREC, BV, BB, DC)
    causal = i[:, None] <= i[None, :]
    _store_tile(at_ptr, tl.where(causal, dMt * Et, 0.0), BB, BB)
    dEt = tl.where(causal, dMt * At, 0.0)
    dtau += tl.sum(dEt * eta[:, None], axis=0)
    tl.store(rr_ptr + BB + rb, tl.sum(dEt * tau[None, :], axis=1))
    return dgam, dbet, dtau


@triton.jit
def _linear_bwd_a_kernel(
    q_ptr, k_ptr, v_ptr, eta_ptr, tau_ptr, a_ptr, lnw_ptr, lnb_ptr, w_ptr, bias_ptr,
    wn_ptr, scb_ptr, gs_ptr, rows_ptr, rr_ptr, at_ptr, do_ptr, acc_ptr, dtau_ptr,
    T, H, Dk, Dv, b, N, n0, n1, w_stride, seg,
    HAS_BIAS: tl.constexpr, HAS_LN: tl.constexpr, HAS_LNB: tl.constexpr,
    RESIDUAL: tl.constexpr, PREC: tl.constexpr,
    BB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr, DC: tl.constexpr,
):
    """Backward, first pass over mini-batches n0..n1-1 of one (batch, head), forward in time
    from the weights entering n0 (w + bh * w_stride [Dk, Dv], bias likewise: a checkpoint,
    or the weights a last partial mini-batch starts from): each mini-batch's start weights
    into wn [B*H, seg, Dk, Dv], bias into scb [B*H, seg, Dv], and ``_linear_back_a``'s rows
    (rows [B*H, seg, 5, BV, BB], rr [B*H, seg, 2, BB], at [B*H, seg, BB, BB]); gs
    [B*H, 2, BV, BB] is ``_scores_grad``'s scratch. Adds to the accumulators acc [B*H, 3, BV]
    (d, dgamma, dbeta) and dtau [B*H, BB]."""
    bh = tl.program_id(0).to(tl.int64)
    h, base_k, base_v, ebase = _head(bh, H, T, Dk, Dv)
    cm = tl.arange(0, BV) < Dv
    gam, bet = _ln_affine(lnw_ptr, lnb_ptr, h, Dv, BV, HAS_LN, HAS_LNB)
    tau_b = tl.load(tau_ptr + h * b + b - 1).to(tl.float32)
    acc = acc_ptr + bh * 3 * BV
    dgam = _vec(acc + BV, BV, BV)
    dbet = _vec(acc + 2 * BV, BV, BV)
    dtau = _vec(dtau_ptr + bh * BB, BB, BB)
    gs = gs_ptr + bh * 2 * BV * BB
    wn = wn_ptr + bh * seg * Dk * Dv
    _copy_mat(w_ptr + bh * w_stride, wn, Dk, Dv, BK, BV, KC)
    bv = tl.zeros([BV], dtype=tl.float32)
    if HAS_BIAS:
        bv = _vec(bias_ptr + bh * (w_stride // Dk), Dv, BV)
    for n in range(n0, n1):
        j = n - n0
        if HAS_BIAS:
            _store_vec(scb_ptr + (bh * seg + j) * Dv, bv, Dv, BV)
        wj = wn + j * Dk * Dv
        rows = rows_ptr + (bh * seg + j) * 5 * BV * BB
        dgam, dbet, dtau = _linear_back_a(
            wj, bv, dgam, dbet, dtau, q_ptr, k_ptr, v_ptr, eta_ptr, tau_ptr, a_ptr, do_ptr, gs,
            rows, rr_ptr + (bh * seg + j) * 2 * BB, at_ptr + (bh * seg + j) * BB * BB, bh, h,
            base_k, base_v, ebase, n, T, H, Dk, Dv, b, N, gam, bet, cm, HAS_LN, RESIDUAL, PREC,
            BB, BK, BV, KC, DC)
        if n + 1 < n1:  # the next mini-batch's start weights
            _, t, m = _mb(n, b, T, BB)
            eta = tl.load(eta_ptr + ebase + t * H, mask=m, other=0.0).to(tl.float32)
            Hm = _load_tile(rows, BV, BB) * (eta * -tau_b)[None, :]
            _linear_add(wj, wj + Dk * Dv, Hm, k_ptr, base_k, t, m, H, Dk, Dv, PREC, BK, BV, KC)
            if HAS_BIAS:
                bv += tl.sum(Hm, axis=1)
    _store_vec(acc + BV, dgam, BV, BV)
    _store_vec(acc + 2 * BV, dbet, BV, BV)
    _store_vec(dtau_ptr + bh * BB, dtau, BB, BB)


@triton.jit
def _linear_bwd_c_kernel(
    q_ptr, k_ptr, eta_ptr, tau_ptr, do_ptr, wn_ptr, dn_ptr, rows_ptr, at_ptr, dq_ptr, dk_ptr,
    dv_ptr, T, H, Dk, Dv, b, n0, seg, dn_stride,
    TAIL: tl.constexpr, RESIDUAL: tl.constexpr, PREC: tl.constexpr,
    BB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr,
):
    """Backward, the gradients of the queries and keys of mini-batch n0 + j (program
    (j, b*h), in parallel) after both passes: dQ = dZbar W^T + dA K [+ dO] and
    dK = dA^T Q + dZk W^T + (eta G) D^T [- dtgt], D the gradient of the weights leaving the
    mini-batch (-tau_b dn[j]; TAIL: dS, dn = dS with dn_stride 0 between mini-batches),
    from the rows, the scores' gradient at and the start weights wn[j]."""
    j = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    bb = bh // H
    h = bh % H
    base_k = (bb * T * H + h) * Dk
    _, t, m = _mb(n0 + j, b, T, BB)
    wp = wn_ptr + (bh * seg + j) * Dk * Dv
    dp = dn_ptr + bh * Dk * Dv * (seg if dn_stride else 1) + j * dn_stride
    rows = rows_ptr + (bh * seg + j) * 5 * BV * BB
    eta = tl.load(eta_ptr + bh // H * T * H + h + t * H, mask=m, other=0.0).to(tl.float32)
    coef = 1.0
    if not TAIL:
        coef = -tl.load(tau_ptr + h * b + b - 1).to(tl.float32)
    Hm = _load_tile(rows, BV, BB) * (eta * coef)[None, :]
    dzbar = _load_tile(rows + BV * BB, BV, BB)
    dzk = _load_tile(rows + 2 * BV * BB, BV, BB)
    dAt = _load_tile(at_ptr + (bh * seg + j) * BB * BB, BB, BB)
    for c0 in range(0, BK, KC):
        kc = _cols(k_ptr, base_k, t, m, H, Dk, KC, c0)
        qc = _cols(q_ptr, base_k, t, m, H, Dk, KC, c0)
        wc = tl.trans(_wrows(wp, c0, Dk, Dv, BV, KC))
        dq = _dot(wc, dzbar, PREC, _dot(kc, dAt, PREC))
        dk = _dot(tl.trans(_wrows(dp, c0, Dk, Dv, BV, KC)), Hm, PREC,
                  _dot(wc, dzk, PREC, _dot(qc, tl.trans(dAt), PREC)))
        if RESIDUAL:
            dq += _cols(do_ptr, base_k, t, m, H, Dk, KC, c0)
            dk -= _cols(dv_ptr, base_k, t, m, H, Dk, KC, c0)
        _store_cols(dq_ptr, dq, base_k, t, m, H, Dk, KC, c0)
        _store_cols(dk_ptr, dk, base_k, t, m, H, Dk, KC, c0)


@triton.jit
def _linear_back_b(
    dp, dn_ptr, d, dgam, dbet, dtau_b,
    q_ptr, k_ptr, v_ptr, eta_ptr, dsw_ptr, dsb_ptr, rows_ptr, rr_ptr, dv_ptr,
    deta_ptr, bh, base_k, base_v, ebase, n, T, H, Dk, Dv, b, tau_b, gam, bet, cm,
    TAIL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LN: tl.constexpr, RESIDUAL: tl.constexpr,
    PREC: tl.constexpr, BB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    KC: tl.constexpr,
):
    """The sequential rest of mini-batch n's backward, with the gradient of the weights it
    hands on (dp [Dk, Dv], updated in place into that of its start weights, and d; TAIL: the
    weights it hands on unchanged, its sums' gradient being dS, ds) and the rows of
    ``_linear_back_a``: the gradient sums' and the keys' loss gradient's backward. Stores
    dV, deta, dZk^T (into the rows, for dK) and the gradient it was given into dn [Dk, Dv];
    returns d and the accumulators."""
    _, t, m = _mb(n, b, T, BB)
    eta = tl.load(eta_ptr + ebase + t * H, mask=m, other=0.0).to(tl.float32)
    G = _load_tile(rows_ptr, BV, BB)
    Hm = G * eta[None, :]
    # the gradient sums S = K^T (eta G), s = sum eta G: handed on (TAIL, gradient dS, ds) or
    # applied, W' = W - tau_b S (gradient -tau_b D, and tau_b's -<D, S>)
    kd = tl.zeros([BV, BB], dtype=tl.float32)
    for c0 in range(0, BK, KC):
        kc = _cols(k_ptr, base_k, t, m, H, Dk, KC, c0)
        if TAIL:
            kd = _dot(_wrows(dsw_ptr + bh * Dk * Dv, c0, Dk, Dv, BV, KC), kc, PREC, kd)
        else:
            kd = _dot(_wrows(dp, c0, Dk, Dv, BV, KC), kc, PREC, kd)
    if TAIL:
        dHm = kd
        if HAS_BIAS:
            dHm += _vec(dsb_ptr + bh * Dv, Dv, BV)[:, None]
    else:
        if HAS_BIAS:
            kd += d[:, None]
        dtau_b -= tl.sum(tl.sum(Hm * kd, axis=1), axis=0)
        dHm = -tau_b * kd
    dzk, dgam, dbet = _keys_back(dHm, G, eta, rows_ptr, rr_ptr, v_ptr, k_ptr, dv_ptr, deta_ptr,
                                 dgam, dbet, gam, bet, cm, base_v, ebase, t, m, H, Dv, HAS_LN,
                                 RESIDUAL, BB, BV)
    dzbar = _load_tile(rows_ptr + BV * BB, BV, BB)
    # D <- D + Q^T dZbar + K^T dZk, the gradient leaving the mini-batch kept in dn for dK
    for c0 in range(0, BK, KC):
        dc = _wrows(dp, c0, Dk, Dv, BV, KC)
        _store_wrows(dn_ptr, dc, c0, Dk, Dv, BV, KC)
        dc = _dot(dzk, tl.trans(_cols(k_ptr, base_k, t, m, H, Dk, KC, c0)), PREC,
                  _dot(dzbar, tl.trans(_cols(q_ptr, base_k, t, m, H, Dk, KC, c0)), PREC, dc))
        tl.debug_barrier()  # every thread has read the block before it is overwritten
        _store_wrows(dp, dc, c0, Dk, Dv, BV, KC)
    tl.debug_barrier()
    if HAS_BIAS:
        d += tl.sum(dzbar + dzk, axis=1)
    return d, dgam, dbet, dtau_b


@triton.jit
def _linear_bwd_b_kernel(
    q_ptr, k_ptr, v_ptr, eta_ptr, tau_ptr, lnw_ptr, lnb_ptr, dn_ptr, rows_ptr, rr_ptr,
    dsw_ptr, dsb_ptr, dw_ptr, acc_ptr, dtau_ptr, dv_ptr, deta_ptr,
    T, H, Dk, Dv, b, n0, n1, seg,
    TAIL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LN: tl.constexpr, HAS_LNB: tl.constexpr,
    RESIDUAL: tl.constexpr, PREC: tl.constexpr,
    BB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr,
):
    """Backward, second pass over mini-batches n1-1 down to n0 of one (batch, head) with the
    carried gradient of the weights, dW [B*H, Dk, Dv] (that of the weights leaving n1-1,
    updated in place into that of the weights entering n0; TAIL: n0 is a last partial
    mini-batch, whose sums' gradient is dS, ds) and the first pass's rows
    (``_linear_bwd_a_kernel``). Writes dv, deta, each mini-batch's dZk^T into its rows and
    the gradient leaving it into dn [B*H, seg, Dk, Dv], and adds to the accumulators
    acc [B*H, 3, BV] (d, dgamma, dbeta) and dtau [B*H, BB] (tau_b's share)."""
    bh = tl.program_id(0).to(tl.int64)
    base_k, base_v, ebase, cm, gam, bet, tau_b, d, dgam, dbet, dtau_b = _back_b_start(
        bh, lnw_ptr, lnb_ptr, tau_ptr, acc_ptr, T, H, Dk, Dv, b, HAS_LN, HAS_LNB, BB, BV)
    dp = dw_ptr + bh * Dk * Dv
    for nr in range(n0, n1):
        n = n1 - 1 + n0 - nr
        j = n - n0
        d, dgam, dbet, dtau_b = _linear_back_b(
            dp, dn_ptr + (bh * seg + j) * Dk * Dv, d, dgam, dbet, dtau_b, q_ptr, k_ptr, v_ptr,
            eta_ptr, dsw_ptr, dsb_ptr, rows_ptr + (bh * seg + j) * 5 * BV * BB,
            rr_ptr + (bh * seg + j) * 2 * BB, dv_ptr, deta_ptr, bh, base_k, base_v,
            ebase, n, T, H, Dk, Dv, b, tau_b, gam, bet, cm, TAIL, HAS_BIAS, HAS_LN, RESIDUAL,
            PREC, BB, BK, BV, KC)
    _back_b_end(bh, acc_ptr, dtau_ptr, d, dgam, dbet, dtau_b, b, BB, BV)


# ---------------------------------------------------------------------------------------------
# TTT-MLP (forward)


@triton.jit
def _gelu(x):
    """gelu_tanh(x) and its derivative (mlp_scan.py's ``_gelu_parts``): with
    s = sigmoid(2 u), u = c (x + a x^3): gelu = x s, gelu' = s + 2 x u' s (1 - s)."""
    x2 = x * x  # (tensors first: a constexpr on the left would wrap the product)
    s = tl.sigmoid(x * (x2 * _GELU_A + 1.0) * (2.0 * _GELU_C))
    return x * s, s + x * (x2 * (3.0 * _GELU_A) + 1.0) * s * (1.0 - s) * (2.0 * _GELU_C)


@triton.jit
def _mlp_hidden(w1_ptr, b1_ptr, x_ptr, base_k, t, m, j0, H, Dk, Dh, PREC: tl.constexpr,
                BK: tl.constexpr, BB: tl.constexpr, HB: tl.constexpr, KC: tl.constexpr,
                HAS_B1: tl.constexpr):
    """(X W1 + b1)^T of hidden units j0..j0+HB for the mini-batch's tokens t of x
    [B, T, H, Dk]: [HB, BB], W1 [Dk, Dh] streamed in blocks of KC rows."""
    z = tl.zeros([HB, BB], dtype=tl.float32)
    if HAS_B1:
        z += _vec(b1_ptr + j0, Dh - j0, HB)[:, None]
    for c0 in range(0, BK, KC):
        z = _dot(_blockT(w1_ptr, c0, j0, Dk, Dh, KC, HB),
                 _cols(x_ptr, base_k, t, m, H, Dk, KC, c0), PREC, z)
    return z


@triton.jit
def _mlp_minibatch(
    q_ptr, k_ptr, v_ptr, eta_ptr, tau_ptr, a_ptr, o_ptr, w1, b1, w2, d1, db1, d2, gs,
    b2, gam, bet, cm, bh, h, base_k, base_v, ebase, n, T, H, Dk, Dv, Dh, b, N, coef,
    TAIL: tl.constexpr, HAS_B1: tl.constexpr, HAS_B2: tl.constexpr, HAS_LN: tl.constexpr,
    RESIDUAL: tl.constexpr, PREC: tl.constexpr, BB: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, BHD: tl.constexpr, HB: tl.constexpr, KC: tl.constexpr,
):
    """Mini-batch n of TTT-MLP from the weights w1 [Dk, Dh], b1 [Dh], w2 [Dh, Dv] (global,
    float32) and b2 [BV]: stores o, and adds coef * (eta-weighted gradient) to the weights
    (d1 = w1, db1 = b1, d2 = w2, coef = -tau_b), or (TAIL) writes the gradient sums into
    d1, db1, d2 (coef = 1). Returns the gradient's share of b2 (coef * sum eta G2)."""
    _, t, m, eta, _, Et, At = _linear_in(eta_ptr, tau_ptr, a_ptr, bh, h, ebase, n, T, H, b,
                                         N, BB)
    tgt = _cols(v_ptr, base_v, t, m, H, Dv, BV)
    if RESIDUAL:  # Dk == Dv
        tgt -= _cols(k_ptr, base_v, t, m, H, Dv, BV)
    # the keys' Z2 = gelu(K W1 + b1) W2 + b2 and its loss gradient G2 (one pass over the
    # hidden blocks)
    z2 = tl.zeros([BV, BB], dtype=tl.float32) + b2[:, None]
    for j0 in range(0, BHD, HB):
        x2 = _gelu(_mlp_hidden(w1, b1, k_ptr, base_k, t, m, j0, H, Dk, Dh, PREC, BK, BB, HB, KC,
                               HAS_B1))[0]
        z2 = _dot(_blockT(w2, j0, 0, Dh, Dv, HB, BV), x2, PREC, z2)
    G2, _, _, _ = _loss_grad(z2, tgt, gam, bet, cm, Dv, HAS_LN)
    _store_tile(gs, G2, BV, BB)  # read back by blocks of value rows for G2 W2^T
    tl.debug_barrier()
    e2 = eta * coef
    M1t = Et * At
    # per hidden block: G1 = (G2 W2^T) * gelu'(Z1), the queries' Zbar1 = Q W1 + b1 - M1 G1,
    # Xbar2 = gelu(Zbar1) through W2 into Zq2, Xbar2 X2^T for the second layer's scores, and
    # the block's update (or gradient sums)
    zq2 = tl.zeros([BV, BB], dtype=tl.float32) + b2[:, None]
    A2t = tl.zeros([BB, BB], dtype=tl.float32)
    r = tl.arange(0, KC)
    c = tl.arange(0, BB)
    for j0 in range(0, BHD, HB):
        x2, g1p = _gelu(_mlp_hidden(w1, b1, k_ptr, base_k, t, m, j0, H, Dk, Dh, PREC, BK, BB,
                                    HB, KC, HAS_B1))
        a = tl.zeros([HB, BB], dtype=tl.float32)
        for v0 in range(0, BV, KC):
            a = _dot(_block(w2, j0, v0, Dh, Dv, HB, KC),
                     tl.load(gs + (v0 + r)[:, None] * BB + c[None, :]), PREC, a)
        G1 = a * g1p
        zbar1 = _mlp_hidden(w1, b1, q_ptr, base_k, t, m, j0, H, Dk, Dh, PREC, BK, BB, HB, KC,
                            HAS_B1) - _dot(G1, M1t, PREC)
        xbar2 = _gelu(zbar1)[0]
        w2b = _blockT(w2, j0, 0, Dh, Dv, HB, BV)  # [BV, HB]
        zq2 = _dot(w2b, xbar2, PREC, zq2)
        A2t = _dot(tl.trans(x2), xbar2, PREC, A2t)
        H1 = G1 * e2[None, :]
        tl.debug_barrier()  # the block's weights are read before they are overwritten
        for c0 in range(0, BK, KC):
            acc = tl.zeros([HB, KC], dtype=tl.float32)
            if not TAIL:
                acc = _blockT(w1, c0, j0, Dk, Dh, KC, HB)
            acc = _dot(H1, tl.trans(_cols(k_ptr, base_k, t, m, H, Dk, KC, c0)), PREC, acc)
            _store_blockT(d1, acc, c0, j0, Dk, Dh, KC, HB)
        if HAS_B1:
            s1 = tl.sum(H1, axis=1)
            if not TAIL:
                s1 += _vec(b1 + j0, Dh - j0, HB)
            _store_vec(db1 + j0, s1, Dh - j0, HB)
        acc2 = tl.zeros([BV, HB], dtype=tl.float32)
        if not TAIL:
            acc2 = w2b
        _store_blockT(d2, _dot(G2 * e2[None, :], tl.trans(x2), PREC, acc2), j0, 0, Dh, Dv, HB,
                      BV)
        tl.debug_barrier()
    if HAS_B2:
        A2t += 1.0
    zbar2 = zq2 - _dot(G2, Et * A2t, PREC)
    _linear_out(o_ptr, zbar2, q_ptr, gam, bet, cm, base_v, t, m, H, Dv, HAS_LN, RESIDUAL, BV)
    return tl.sum(G2 * e2[None, :], axis=1)


@triton.jit
def _mlp_fwd_kernel(
    q_ptr, k_ptr, v_ptr, eta_ptr, tau_ptr, a_ptr, lnw_ptr, lnb_ptr, w1_ptr, b1_ptr, w2_ptr,
    b2_ptr, o_ptr, s1_ptr, sb1_ptr, s2_ptr, sb2_ptr, gs_ptr, ck1_ptr, ckb1_ptr, ck2_ptr,
    ckb2_ptr, T, H, Dk, Dv, Dh, b, N, NF, seg, store_ck,
    HAS_B1: tl.constexpr, HAS_B2: tl.constexpr, HAS_LN: tl.constexpr, HAS_LNB: tl.constexpr,
    RESIDUAL: tl.constexpr, PREC: tl.constexpr, BB: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, BHD: tl.constexpr, HB: tl.constexpr, KC: tl.constexpr,
):
    """TTT-MLP forward for one (batch, head) over N mini-batches, NF of them full: w1
    [B*H, Dk, Dh], b1 [B*H, Dh], w2 [B*H, Dh, Dv], b2 [B*H, Dv] hold the start weights and are
    updated in place into the weights after the last full mini-batch; writes o and the
    gradient sums of a last partial mini-batch (s1, sb1, s2, sb2, if NF < N). a: the scores of
    ``_qk_kernel``; gs [B*H, BV, BB]: scratch (G2 read back by blocks). With ``store_ck``, the
    weights entering every ``seg``-th mini-batch into ck1 [B*H, NC, Dk, Dh], ckb1, ck2, ckb2."""
    bh = tl.program_id(0).to(tl.int64)
    h, base_k, base_v, ebase = _head(bh, H, T, Dk, Dv)
    cm = tl.arange(0, BV) < Dv
    w1 = w1_ptr + bh * Dk * Dh
    b1 = b1_ptr + bh * Dh
    w2 = w2_ptr + bh * Dh * Dv
    gs = gs_ptr + bh * BV * BB
    b2 = tl.zeros([BV], dtype=tl.float32)
    if HAS_B2:
        b2 = _vec(b2_ptr + bh * Dv, Dv, BV)
    gam, bet = _ln_affine(lnw_ptr, lnb_ptr, h, Dv, BV, HAS_LN, HAS_LNB)
    tau_b = tl.load(tau_ptr + h * b + b - 1).to(tl.float32)
    NC = tl.cdiv(NF, seg)
    for n in range(0, NF):
        if store_ck and n % seg == 0:  # the weights entering every seg-th mini-batch
            c = bh * NC + n // seg
            _copy_flat(w1, ck1_ptr + c * Dk * Dh, Dk * Dh, KC * BV)
            _copy_flat(w2, ck2_ptr + c * Dh * Dv, Dh * Dv, KC * BV)
            if HAS_B1:
                _copy_flat(b1, ckb1_ptr + c * Dh, Dh, KC * BV)
            if HAS_B2:
                _store_vec(ckb2_ptr + c * Dv, b2, Dv, BV)
        db2 = _mlp_minibatch(
            q_ptr, k_ptr, v_ptr, eta_ptr, tau_ptr, a_ptr, o_ptr, w1, b1, w2, w1, b1, w2, gs,
            b2, gam, bet, cm, bh, h, base_k, base_v, ebase, n, T, H, Dk, Dv, Dh, b, N, -tau_b,
            False, HAS_B1, HAS_B2, HAS_LN, RESIDUAL, PREC, BB, BK, BV, BHD, HB, KC)
        if HAS_B2:
            b2 += db2
    if HAS_B2:
        _store_vec(b2_ptr + bh * Dv, b2, Dv, BV)
    if NF < N:
        sb2 = _mlp_minibatch(
            q_ptr, k_ptr, v_ptr, eta_ptr, tau_ptr, a_ptr, o_ptr, w1, b1, w2,
            s1_ptr + bh * Dk * Dh, sb1_ptr + bh * Dh, s2_ptr + bh * Dh * Dv, gs, b2, gam, bet,
            cm, bh, h, base_k, base_v, ebase, NF, T, H, Dk, Dv, Dh, b, N, 1.0, True, HAS_B1,
            HAS_B2, HAS_LN, RESIDUAL, PREC, BB, BK, BV, BHD, HB, KC)
        if HAS_B2:
            _store_vec(sb2_ptr + bh * Dv, sb2, Dv, BV)


# ---------------------------------------------------------------------------------------------
# TTT-MLP (backward)


@triton.jit
def _gelu2(x):
    """gelu_tanh(x), gelu'(x) and gelu''(x) (mlp_scan.py's ``_gelu_parts``): with
    u' = c (1 + 3 a x^2), gelu'' = 4 s (1 - s) (u' + 3 a c x^2 + x u'^2 (1 - 2 s))."""
    y, g1 = _gelu(x)
    x2 = x * x
    s = tl.sigmoid(x * (x2 * _GELU_A + 1.0) * (2.0 * _GELU_C))
    up = (x2 * (3.0 * _GELU_A) + 1.0) * _GELU_C
    g2 = s * (1.0 - s) * 4.0 * (up + x2 * (3.0 * _GELU_A) * _GELU_C + x * up * up * (1.0 - 2.0 * s))
    return y, g1, g2


@triton.jit
def _mlp_recompute_kernel(
    q_ptr, k_ptr, v_ptr, eta_ptr, tau_ptr, a_ptr, lnw_ptr, lnb_ptr, w1_ptr, b1_ptr, w2_ptr,
    b2_ptr, o_ptr, gs_ptr, T, H, Dk, Dv, Dh, b, N, n0, n1, seg,
    HAS_B1: tl.constexpr, HAS_B2: tl.constexpr, HAS_LN: tl.constexpr, HAS_LNB: tl.constexpr,
    RESIDUAL: tl.constexpr, PREC: tl.constexpr, BB: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, BHD: tl.constexpr, HB: tl.constexpr, KC: tl.constexpr,
):
    """Backward, first pass over mini-batches n0..n1-1 of one (batch, head): the forward
    again from the weights in slot 0 of w1 [B*H, seg + 1, Dk, Dh], b1 [B*H, seg + 1, Dh],
    w2 [B*H, seg + 1, Dh, Dv], b2 [B*H, seg + 1, Dv] (a checkpoint), writing the weights
    entering mini-batch n0 + j into slot j (its read-out goes to the scratch o)."""
    bh = tl.program_id(0).to(tl.int64)
    h, base_k, base_v, ebase = _head(bh, H, T, Dk, Dv)
    cm = tl.arange(0, BV) < Dv
    S = seg + 1
    gs = gs_ptr + bh * BV * BB
    b2 = tl.zeros([BV], dtype=tl.float32)
    if HAS_B2:
        b2 = _vec(b2_ptr + bh * S * Dv, Dv, BV)
    gam, bet = _ln_affine(lnw_ptr, lnb_ptr, h, Dv, BV, HAS_LN, HAS_LNB)
    tau_b = tl.load(tau_ptr + h * b + b - 1).to(tl.float32)
    for n in range(n0, n1 - 1):
        j = bh * S + n - n0
        db2 = _mlp_minibatch(
            q_ptr, k_ptr, v_ptr, eta_ptr, tau_ptr, a_ptr, o_ptr, w1_ptr + j * Dk * Dh,
            b1_ptr + j * Dh, w2_ptr + j * Dh * Dv, w1_ptr + (j + 1) * Dk * Dh,
            b1_ptr + (j + 1) * Dh, w2_ptr + (j + 1) * Dh * Dv, gs, b2, gam, bet, cm, bh, h,
            base_k, base_v, ebase, n, T, H, Dk, Dv, Dh, b, N, -tau_b, False, HAS_B1, HAS_B2,
            HAS_LN, RESIDUAL, PREC, BB, BK, BV, BHD, HB, KC)
        if HAS_B2:
            b2 += db2
            _store_vec(b2_ptr + (j + 1) * Dv, b2, Dv, BV)


@triton.jit
def _rows_through(w_ptr, j0, rows_ptr, acc, Dh, Dv, PREC: tl.constexpr, BB: tl.constexpr,
                  BV: tl.constexpr, HB: tl.constexpr, KC: tl.constexpr):
    """acc + W[j0:j0+HB] R [HB, BB] for w [Dh, Dv] (row-major) and R [BV, BB], a tile in the
    program's global scratch (``rows_ptr``, row-major) read back by blocks of KC value rows:
    held whole, a product with HB rows and the value dim as its depth has every warp hold its
    whole operands (the warps replicate its rows)."""
    a = acc
    r = tl.arange(0, KC)
    c = tl.arange(0, BB)
    for v0 in range(0, BV, KC):
        a = _dot(_block(w_ptr, j0, v0, Dh, Dv, HB, KC),
                 tl.load(rows_ptr + (v0 + r)[:, None] * BB + c[None, :]), PREC, a)
    return a


@triton.jit
def _mlp_bwd_a_kernel(
    q_ptr, k_ptr, v_ptr, eta_ptr, tau_ptr, a_ptr, lnw_ptr, lnb_ptr, w1_ptr, b1_ptr, w2_ptr,
    b2_ptr, do_ptr, hs_ptr, vs_ptr, rr_ptr, at_ptr, acc_ptr, dtau_ptr, dq_ptr, dk_ptr,
    deta_ptr, T, H, Dk, Dv, Dh, b, N, n0, seg, w_bh, w_j,
    HAS_B1: tl.constexpr, HAS_B2: tl.constexpr, HAS_LN: tl.constexpr, HAS_LNB: tl.constexpr,
    RESIDUAL: tl.constexpr, PREC: tl.constexpr, BB: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, BHD: tl.constexpr, HB: tl.constexpr, KC: tl.constexpr,
    DC: tl.constexpr,
):
    """Backward, first pass: mini-batch n = n0 + j of one (batch, head) (program (j, b*h), in
    parallel), its forward again from its start weights (slot bh * w_bh + j * w_j of w1
    [., Dk, Dh], b1 [., Dh], w2 [., Dh, Dv], b2 [., Dv]) and the backward of its read-out,
    which needs no gradient of later weights. Writes dq (final), dk and deta (the read-out's
    shares), acc [B*H, N, 2, BV] (dgamma, dbeta) and dtau [B*H, N, BB] of the mini-batch, and
    its rows for ``_mlp_bwd_b_kernel``: hidden hs [B*H, seg, 4, BHD, BB] (Z1, A = G2 W2^T,
    Zbar1, dZbar1), value vs [B*H, seg, 5, BV, BB] (G2, dZbar2, the read-out's share of dG2,
    the keys' LayerNorm x_hat and g), rr [B*H, seg, BB] (that LayerNorm's 1/s), at [B*H, seg,
    BB, BB] (dA2^T, A2 = Xbar2 X2^T [+ 1]). Passes over hidden blocks of HB units (each
    loop's body small, its invariants not hoisted: held across the loop they spilled):
    (1) Z1 = K W1 + b1, Z2 = gelu(Z1) W2 + b2 and the loss gradient G2; (2) A, G1 = A
    gelu'(Z1), Zbar1 = Q W1 + b1 - M1 G1; (3) Xbar2 = gelu(Zbar1), A2, Zbar2 = Xbar2 W2 + b2
    - M2 G2 (M = E * A); the read-out o = [LN](Zbar2) [+ q] differentiated; (4) dXbar2 =
    dZbar2 W2^T + dA2 X2, dZbar1, M1's gradient, dQ."""
    j = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    n = n0 + j
    h, base_k, base_v, ebase = _head(bh, H, T, Dk, Dv)
    cm = tl.arange(0, BV) < Dv
    gam, bet = _ln_affine(lnw_ptr, lnb_ptr, h, Dv, BV, HAS_LN, HAS_LNB)
    slot = bh * w_bh + j * w_j
    w1 = w1_ptr + slot * Dk * Dh
    b1 = b1_ptr + slot * Dh
    w2 = w2_ptr + slot * Dh * Dv
    row = bh * seg + j
    hs = hs_ptr + row * 4 * BHD * BB
    SL = BHD * BB
    vs = vs_ptr + row * 5 * BV * BB
    VS = BV * BB
    i, t, m, eta, tau, Et, A1t = _linear_in(eta_ptr, tau_ptr, a_ptr, bh, h, ebase, n, T, H, b,
                                            N, BB)
    tgt = _cols(v_ptr, base_v, t, m, H, Dv, BV)
    if RESIDUAL:  # Dk == Dv
        tgt -= _cols(k_ptr, base_v, t, m, H, Dv, BV)
    b2v = tl.zeros([BV], dtype=tl.float32)
    if HAS_B2:
        b2v = _vec(b2_ptr + slot * Dv, Dv, BV)
    # (1) the keys' forward
    Z2 = tl.zeros([BV, BB], dtype=tl.float32) + b2v[:, None]
    for j0 in tl.range(0, BHD, HB, disable_licm=True):
        Z1 = _mlp_hidden(w1, b1, k_ptr, base_k, t, m, j0, H, Dk, Dh, PREC, BK, BB, HB, KC,
                         HAS_B1)
        _store_tile(hs + j0 * BB, Z1, HB, BB)
        Z2 = _dot(_blockT(w2, j0, 0, Dh, Dv, HB, BV), _gelu(Z1)[0], PREC, Z2)
    G2, xh, r, g = _loss_grad(Z2, tgt, gam, bet, cm, Dv, HAS_LN)
    _store_tile(vs, G2, BV, BB)
    if HAS_LN:
        _store_tile(vs + 3 * VS, xh, BV, BB)
        _store_tile(vs + 4 * VS, g, BV, BB)
        tl.store(rr_ptr + row * BB + tl.arange(0, BB), r)
    tl.debug_barrier()
    # (2) the queries' read-out
    M1t = Et * A1t
    Zb2 = tl.zeros([BV, BB], dtype=tl.float32) + b2v[:, None]
    A2t = tl.zeros([BB, BB], dtype=tl.float32)
    for j0 in tl.range(0, BHD, HB, disable_licm=True):
        A = _rows_through(w2, j0, vs, tl.zeros([HB, BB], dtype=tl.float32), Dh, Dv, PREC, BB,
                          BV, HB, KC)
        G1 = A * _gelu(_load_tile(hs + j0 * BB, HB, BB))[1]
        _store_tile(hs + SL + j0 * BB, A, HB, BB)
        _store_tile(hs + 2 * SL + j0 * BB, _mlp_hidden(
            w1, b1, q_ptr, base_k, t, m, j0, H, Dk, Dh, PREC, BK, BB, HB, KC, HAS_B1)
            - _dot(G1, M1t, PREC), HB, BB)
    tl.debug_barrier()
    for j0 in tl.range(0, BHD, HB, disable_licm=True):
        Xb2 = _gelu(_load_tile(hs + 2 * SL + j0 * BB, HB, BB))[0]
        A2t = _dot(tl.trans(_gelu(_load_tile(hs + j0 * BB, HB, BB))[0]), Xb2, PREC, A2t)
        Zb2 = _dot(_blockT(w2, j0, 0, Dh, Dv, HB, BV), Xb2, PREC, Zb2)
    if HAS_B2:
        A2t += 1.0
    M2t = Et * A2t
    Zb2 -= _dot(G2, M2t, PREC)
    # the read-out o = [LN](Zbar2) [+ q] and Zbar2's b x b term -M2 G2
    dO = _cols(do_ptr, base_v, t, m, H, Dv, BV)
    dzb2 = dO
    acc = acc_ptr + (bh * N + n) * 2 * BV
    if HAS_LN:
        xo, ro = _ln(Zb2, cm, Dv)
        _store_vec(acc, tl.sum(dO * xo, axis=1), BV, BV)
        _store_vec(acc + BV, tl.sum(dO, axis=1), BV, BV)
        dzb2 = _ln_back(gam[:, None] * dO, xo, ro, cm, Dv)
    _store_tile(vs + 2 * VS, -_dot(dzb2, tl.trans(M2t), PREC), BV, BB)
    dM2t = _scores_grad(vs, G2, dzb2, PREC, BV, BB, DC)  # G2, dZbar2 into slots 0, 1
    causal = i[:, None] <= i[None, :]
    dA2t = tl.where(causal, dM2t * Et, 0.0)
    _store_tile(at_ptr + row * BB * BB, dA2t, BB, BB)
    dEt = tl.where(causal, dM2t * A2t, 0.0)
    # (3) per block: dXbar2, dZbar1, M1's gradient -dZbar1 G1^T, dQ's share dZbar1 W1^T
    dM1t = tl.zeros([BB, BB], dtype=tl.float32)
    dq = tl.zeros([BK, BB], dtype=tl.float32)
    for j0 in tl.range(0, BHD, HB, disable_licm=True):
        X2, g1p = _gelu(_load_tile(hs + j0 * BB, HB, BB))
        G1 = _load_tile(hs + SL + j0 * BB, HB, BB) * g1p
        dzb1 = _rows_through(w2, j0, vs + VS, _dot(X2, dA2t, PREC), Dh, Dv, PREC, BB, BV,
                             HB, KC)
        dzb1 *= _gelu(_load_tile(hs + 2 * SL + j0 * BB, HB, BB))[1]
        _store_tile(hs + 3 * SL + j0 * BB, dzb1, HB, BB)
        dM1t = _dot(tl.trans(G1), dzb1, PREC, dM1t)
        dq = _dot(_block(w1, 0, j0, Dk, Dh, BK, HB), dzb1, PREC, dq)
    dM1t = -dM1t
    dA1t = tl.where(causal, dM1t * Et, 0.0)
    dEt += tl.where(causal, dM1t * A1t, 0.0)
    dq = _dot(_cols(k_ptr, base_k, t, m, H, Dk, BK), dA1t, PREC, dq)
    if RESIDUAL:  # Dk == Dv
        dq += dO
    _store_cols(dq_ptr, dq, base_k, t, m, H, Dk, BK)
    _store_cols(dk_ptr, _dot(_cols(q_ptr, base_k, t, m, H, Dk, BK), tl.trans(dA1t), PREC),
                base_k, t, m, H, Dk, BK)
    tl.store(deta_ptr + ebase + t * H, tl.sum(dEt * tau[None, :], axis=1), mask=m)
    _store_vec(dtau_ptr + (bh * N + n) * BB, tl.sum(dEt * eta[:, None], axis=0), BB, BB)


@triton.jit
def _mlp_bwd_b_kernel(
    q_ptr, k_ptr, v_ptr, eta_ptr, tau_ptr, a_ptr, lnw_ptr, lnb_ptr, w1_ptr, w2_ptr,
    ds1_ptr, dsb1_ptr, ds2_ptr, dsb2_ptr, dw1_ptr, db1_ptr, dw2_ptr, db2_ptr,
    hs_ptr, vs_ptr, rr_ptr, at_ptr, sc_ptr, acc_ptr, dtau_ptr, dk_ptr, dv_ptr, deta_ptr,
    T, H, Dk, Dv, Dh, b, N, n0, n1, seg, w_bh, w_j,
    TAIL: tl.constexpr, HAS_B1: tl.constexpr, HAS_B2: tl.constexpr, HAS_LN: tl.constexpr,
    HAS_LNB: tl.constexpr, RESIDUAL: tl.constexpr, PREC: tl.constexpr, BB: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BHD: tl.constexpr, HB: tl.constexpr,
    KC: tl.constexpr,
):
    """Backward, second pass over mini-batches n1-1 down to n0 of one (batch, head) with the
    carried gradient of the weights leaving each, dw1 [B*H, Dk, Dh], db1, dw2, db2 (updated
    in place into that of the weights entering n0; TAIL: n0 is a last partial mini-batch,
    whose sums' gradient is ds1, dsb1, ds2, dsb2), the start weights w1, w2 (slots as
    ``_mlp_bwd_a_kernel``'s) and its rows; sc [B*H, 3 BHD BB + BV BB] is the program's
    scratch. Per mini-batch, passes over hidden blocks: the update W' = W - tau_b S
    (S1 = K^T (eta G1), S2 = X2^T (eta G2); gradient coef D) gives (1a) dG1 = coef eta
    (K D1 + d1) - dZbar1 M1^T, (1b) dG2 += dA W2 (dA = dG1 gelu'(Z1)) and X2 D2 + d2; the
    keys' LayerNorm gradient differentiated (dZ2, dV); (2a) dX2 = dZ2 W2^T + coef (eta G2)
    D2^T + dA2^T Xbar2 and dZ1 (gelu'' enters); (2b) dK's shares coef (eta G1) D1^T +
    dZ1 W1^T; (2c, 2d) the gradient of the start weights. Completes dk and deta (adds to
    ``_mlp_bwd_a_kernel``'s shares), writes dv; adds to acc [B*H, 2, BV] (dgamma, dbeta) and
    dtau [B*H, BB] (tau_b's share) in memory each mini-batch: it holds no tile across
    mini-batches or passes that it can read back, and its loops hoist no invariants (with
    either, the kernel spilled)."""
    bh = tl.program_id(0).to(tl.int64)
    h, base_k, base_v, ebase = _head(bh, H, T, Dk, Dv)
    tau_b = tl.load(tau_ptr + h * b + b - 1).to(tl.float32)
    acc = acc_ptr + bh * 2 * BV
    dw1 = dw1_ptr + bh * Dk * Dh
    db1 = db1_ptr + bh * Dh
    dw2 = dw2_ptr + bh * Dh * Dv
    db2 = db2_ptr + bh * Dv
    # the gradient of the sums S: coef D (the weights' carried gradient) or dS (TAIL)
    d1, e1, d2, e2 = dw1, db1, dw2, db2
    coef = -tau_b
    if TAIL:
        d1, e1 = ds1_ptr + bh * Dk * Dh, dsb1_ptr + bh * Dh
        d2, e2 = ds2_ptr + bh * Dh * Dv, dsb2_ptr + bh * Dv
        coef = 1.0
    SL = BHD * BB
    VS = BV * BB
    rb = tl.arange(0, BB)
    for nr in tl.range(n0, n1, disable_licm=True):
        sc = sc_ptr + bh * (3 * SL + VS)  # dG1, dZ1, part of dX2 [BHD, BB]; dZ2 [BV, BB]
        n = n1 - 1 + n0 - nr
        row = bh * seg + n - n0
        slot = bh * w_bh + (n - n0) * w_j
        w1 = w1_ptr + slot * Dk * Dh
        w2 = w2_ptr + slot * Dh * Dv
        hs = hs_ptr + row * 4 * BHD * BB
        vs = vs_ptr + row * 5 * BV * BB
        _, t, m, eta, _, Et, A1t = _linear_in(eta_ptr, tau_ptr, a_ptr, bh, h, ebase, n, T, H,
                                              b, N, BB)
        M1t = Et * A1t
        ce = coef * eta
        # (1a) per block: dG1 = coef eta (K D1 + d1) - dZbar1 M1^T, and G1 . (K D1 + d1)
        se1 = tl.zeros([BB], dtype=tl.float32)
        for j0 in tl.range(0, BHD, HB, disable_licm=True):
            G1 = _load_tile(hs + SL + j0 * BB, HB, BB) * _gelu(_load_tile(hs + j0 * BB, HB,
                                                                          BB))[1]
            kD1 = _mlp_hidden(d1, e1, k_ptr, base_k, t, m, j0, H, Dk, Dh, PREC, BK, BB, HB, KC,
                              HAS_B1)
            se1 += tl.sum(G1 * kD1, axis=0)
            dG1 = kD1 * ce[None, :] - _dot(_load_tile(hs + 3 * SL + j0 * BB, HB, BB),
                                           tl.trans(M1t), PREC)
            _store_tile(sc + j0 * BB, dG1, HB, BB)
        tl.debug_barrier()
        # (1b) the sums over blocks dG2 += dA W2 (dA = dG1 gelu'(Z1)) and X2 D2 + d2
        dG2 = _load_tile(vs + 2 * VS, BV, BB)
        xD2 = tl.zeros([BV, BB], dtype=tl.float32)
        if HAS_B2:
            xD2 += _vec(e2, Dv, BV)[:, None]
        for j0 in tl.range(0, BHD, HB, disable_licm=True):
            X2, g1p = _gelu(_load_tile(hs + j0 * BB, HB, BB))
            dG2 = _dot(_blockT(w2, j0, 0, Dh, Dv, HB, BV),
                       _load_tile(sc + j0 * BB, HB, BB) * g1p, PREC, dG2)
            xD2 = _dot(_blockT(d2, j0, 0, Dh, Dv, HB, BV), X2, PREC, xD2)
        G2 = _load_tile(vs, BV, BB)
        dG2 += xD2 * ce[None, :]
        se = se1 + tl.sum(G2 * xD2, axis=0)  # per token: G1 . (K D1 + d1) + G2 . (X2 D2 + d2)
        p = deta_ptr + ebase + t * H
        tl.store(p, tl.load(p, mask=m, other=0.0) + coef * se, mask=m)
        if not TAIL:  # tau_b's share (no accumulator held across iterations)
            p = dtau_ptr + bh * BB + b - 1
            tl.store(p, tl.load(p) - tl.sum(se * eta, axis=0))
        # G2 = dl/dZ2 of the keys' loss
        dtgt = -dG2
        dZ2 = dG2
        if HAS_LN:  # (the LayerNorm's parameters and gradients not held across iterations)
            gam, bet = _ln_affine(lnw_ptr, lnb_ptr, h, Dv, BV, HAS_LN, HAS_LNB)
            xh = _load_tile(vs + 3 * VS, BV, BB)
            dZ2, dg = _ln_grad_back(dG2, G2, xh, tl.load(rr_ptr + row * BB + rb),
                                    _load_tile(vs + 4 * VS, BV, BB), gam, tl.arange(0, BV) < Dv,
                                    Dv)
            dtgt = -gam[:, None] * dg
            e = gam[:, None] * xh + bet[:, None] - _cols(v_ptr, base_v, t, m, H, Dv, BV)
            if RESIDUAL:
                e += _cols(k_ptr, base_v, t, m, H, Dv, BV)
            _store_vec(acc, _vec(acc, BV, BV) + tl.sum(dg * (e + gam[:, None] * xh), axis=1),
                       BV, BV)
            _store_vec(acc + BV, _vec(acc + BV, BV, BV) - tl.sum(dtgt, axis=1), BV, BV)
        _store_cols(dv_ptr, dtgt, base_v, t, m, H, Dv, BV)
        _store_tile(sc + 3 * SL, dZ2, BV, BB)  # read back by blocks of value rows
        if HAS_B2:
            _store_vec(db2, _vec(db2, Dv, BV) + tl.sum(_load_tile(vs + VS, BV, BB) + dZ2, axis=1),
                       Dv, BV)
        tl.debug_barrier()
        # (2a) per block: dX2 = dZ2 W2^T + coef (eta G2) D2^T + dA2^T Xbar2 (the last two
        # first, then the first), dZ1 (gelu'' enters)
        dA2t = _load_tile(at_ptr + row * BB * BB, BB, BB)
        for j0 in tl.range(0, BHD, HB, disable_licm=True):
            dX2 = _rows_through(d2, j0, vs, tl.zeros([HB, BB], dtype=tl.float32), Dh, Dv, PREC,
                                BB, BV, HB, KC) * ce[None, :]
            dX2 = _dot(_gelu(_load_tile(hs + 2 * SL + j0 * BB, HB, BB))[0], tl.trans(dA2t),
                       PREC, dX2)
            _store_tile(sc + 2 * SL + j0 * BB, dX2, HB, BB)
        tl.debug_barrier()
        for j0 in tl.range(0, BHD, HB, disable_licm=True):
            X2, g1p, g1pp = _gelu2(_load_tile(hs + j0 * BB, HB, BB))
            dX2 = _rows_through(w2, j0, sc + 3 * SL, _load_tile(sc + 2 * SL + j0 * BB, HB, BB),
                                Dh, Dv, PREC, BB, BV, HB, KC)
            dZ1 = (_load_tile(sc + j0 * BB, HB, BB) * _load_tile(hs + SL + j0 * BB, HB,
                                                                          BB) * g1pp
                   + dX2 * g1p)
            _store_tile(sc + SL + j0 * BB, dZ1, HB, BB)
        tl.debug_barrier()
        # (2b) dK's shares coef (eta G1) D1^T and dZ1 W1^T
        dk = tl.zeros([BK, BB], dtype=tl.float32)
        if RESIDUAL:  # Dk == Dv
            dk = -dtgt
        for j0 in tl.range(0, BHD, HB, disable_licm=True):
            H1 = _load_tile(hs + SL + j0 * BB, HB, BB) * _gelu(_load_tile(hs + j0 * BB, HB,
                                                                          BB))[1]
            dk = _dot(_block(w1, 0, j0, Dk, Dh, BK, HB), _load_tile(sc + SL + j0 * BB, HB, BB),
                      PREC, _dot(_block(d1, 0, j0, Dk, Dh, BK, HB), H1 * ce[None, :], PREC, dk))
        _store_cols(dk_ptr, _cols(dk_ptr, base_k, t, m, H, Dk, BK) + dk, base_k, t, m, H, Dk,
                    BK)
        tl.debug_barrier()  # D1, D2 are read before they are updated
        # (2c) the gradient of the blocks' start weights: D1 += Q^T dZbar1 + K^T dZ1
        for j0 in tl.range(0, BHD, HB, disable_licm=True):
            dzb1 = _load_tile(hs + 3 * SL + j0 * BB, HB, BB)
            dZ1 = _load_tile(sc + SL + j0 * BB, HB, BB)
            D1c = _dot(_cols(q_ptr, base_k, t, m, H, Dk, BK), tl.trans(dzb1), PREC,
                       _dot(_cols(k_ptr, base_k, t, m, H, Dk, BK), tl.trans(dZ1), PREC,
                            _block(dw1, 0, j0, Dk, Dh, BK, HB)))
            s1 = tl.sum(dzb1 + dZ1, axis=1)
            if HAS_B1:
                s1 += _vec(db1 + j0, Dh - j0, HB)
            tl.debug_barrier()  # every thread has read the block before it is overwritten
            _store_block(dw1, D1c, 0, j0, Dk, Dh, BK, HB)
            if HAS_B1:
                _store_vec(db1 + j0, s1, Dh - j0, HB)
        # (2d) D2 += Xbar2^T dZbar2 + X2^T dZ2 + dA^T G2 (as D2^T blocks)
        dzb2 = _load_tile(vs + VS, BV, BB)
        dZ2 = _load_tile(sc + 3 * SL, BV, BB)
        G2 = _load_tile(vs, BV, BB)
        for j0 in tl.range(0, BHD, HB, disable_licm=True):
            X2, g1p = _gelu(_load_tile(hs + j0 * BB, HB, BB))
            dA = _load_tile(sc + j0 * BB, HB, BB) * g1p
            D2c = _dot(dzb2, tl.trans(_gelu(_load_tile(hs + 2 * SL + j0 * BB, HB, BB))[0]),
                       PREC, _dot(dZ2, tl.trans(X2), PREC, _dot(
                           G2, tl.trans(dA), PREC, _blockT(dw2, j0, 0, Dh, Dv, HB, BV))))
            tl.debug_barrier()
            _store_blockT(dw2, D2c, j0, 0, Dh, Dv, HB, BV)
        tl.debug_barrier()


# ---------------------------------------------------------------------------------------------
# Host side


class _Shape(NamedTuple):
    """What every launch of one call shares."""

    B: int
    T: int
    H: int
    Dk: int
    Dv: int
    b: int
    N: int
    seg: int
    NC: int
    consts: dict
    cfg: TileConfig

    @property
    def BH(self) -> int:
        return self.B * self.H

    @property
    def dims(self) -> tuple[int, ...]:
        """The sequential kernels' sizes: T, H, Dk, Dv, b, N, NF (full mini-batches), seg."""
        return self.T, self.H, self.Dk, self.Dv, self.b, self.N, self.T // self.b, self.seg

    def launch(self) -> dict:
        """The sequential kernels' constexprs, warps and stages (no software pipelining:
        each mini-batch's loads wait on the previous one's stores)."""
        return {**self.consts, "num_warps": self.cfg.warps, "num_stages": 1}


def _shape(op: str, q: torch.Tensor, v: torch.Tensor, b: int, seg: int | None,
           flags: dict) -> _Shape:
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    if not 1 <= b <= MAX_MINI_BATCH:
        raise ValueError(f"mini_batch_size must be in 1..{MAX_MINI_BATCH} for the TTT Triton "
                         f"kernels, got {b}")
    if max(Dk, Dv) > MAX_D:
        raise ValueError(f"the TTT Triton kernels take Dk, Dv <= {MAX_D}, got {Dk}, {Dv}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"the TTT Triton kernels take float16, bfloat16 or float32 inputs, "
                         f"got {q.dtype}")
    # A direct call with float32 inputs (no spill-free tiling) runs the half tiling: the same
    # arithmetic, correct, with spilled registers; the dispatcher does not send it here.
    cfg = tile_config(_arch(q.device), torch.bfloat16, op, max(Dk, Dv))
    N = triton.cdiv(T, b)
    seg = max(1, min(seg or SEGMENT, T // b))
    prec = precisions(torch.float32 if _upcast_tiles(q.dtype) else q.dtype)[1]
    BK = _pow2(Dk)
    consts = {"PREC": prec, "BB": _pow2(b), "BK": BK, "BV": _pow2(Dv), "KC": min(BK, cfg.KC),
              **flags}
    return _Shape(B, T, H, Dk, Dv, b, N, seg, triton.cdiv(T // b, seg), consts, cfg)


def _f32(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.to(torch.float32).contiguous()


def _grad_in(x: torch.Tensor | None, shape: tuple[int, ...], device: torch.device
             ) -> torch.Tensor:
    """An incoming gradient of a backward as a fresh float32 contiguous tensor that the kernels
    may update in place (zeros where autograd passes None)."""
    if x is None:
        return torch.zeros(shape, dtype=torch.float32, device=device)
    return x.to(torch.float32, copy=True).contiguous()


class _LinearTriton(torch.autograd.Function):
    """(o, W, b, S, s) = TTT-Linear from a mini-batch boundary in the kernels above.
    q, k [B, T, H, Dk], v [B, T, H, Dv] contiguous in their dtype; eta [B, T, H], tau [H, b],
    lnw, lnb [H, Dv] or None, W0 [B*H, Dk, Dv], b0 [B*H, Dv] or None, float32 contiguous."""

    @staticmethod
    def forward(ctx, q, k, v, eta, tau, lnw, lnb, W0, b0, residual, seg):  # type: ignore[override]
        flags = {"HAS_BIAS": b0 is not None, "HAS_LN": lnw is not None,
                 "HAS_LNB": lnb is not None, "RESIDUAL": residual}
        L = _shape("ttt_linear", q, v, tau.shape[-1], seg, flags)
        f32 = {"dtype": torch.float32, "device": q.device}
        A = _scores(L, q, k, b0 is not None)
        o = torch.empty(*q.shape[:3], L.Dv, dtype=q.dtype, device=q.device)
        W = W0.clone()  # updated in place by the kernel
        bias = torch.zeros(L.BH, L.Dv, **f32)
        S = torch.zeros(L.BH, L.Dk, L.Dv, **f32)
        s = torch.zeros(L.BH, L.Dv, **f32)
        store = any(ctx.needs_input_grad)
        ckw = torch.empty(L.BH, L.NC, L.Dk, L.Dv, **f32) if store else W
        ckb = torch.empty(L.BH, L.NC, L.Dv, **f32) if store else bias
        args = (q, k, v, eta, tau, A, _or(lnw, tau), _or(lnb, tau), _or(b0, W0),
                o, W, bias, S, s, ckw, ckb, *L.dims)
        from . import triton_regs  # the register-resident variant (FASTWEIGHTS_TTT_FWD)

        if not triton_regs.launch_forward(L, store, *args):
            _linear_fwd_kernel[(L.BH,)](*args, store, **L.launch())
        if store:
            ctx.save_for_backward(q, k, v, eta, tau, lnw, lnb, ckw, ckb, W, bias, A)
            ctx.L = L
        return o, W, bias, S, s

    @staticmethod
    def backward(ctx, do, dW, db, dS, ds):  # type: ignore[override]
        q, k, v, eta, tau, lnw, lnb, ckw, ckb, W, bias, A = ctx.saved_tensors
        L = ctx.L
        f32 = {"dtype": torch.float32, "device": q.device}
        do = _grad_in(do, (*q.shape[:3], L.Dv), q.device)
        dS, ds = _grad_in(dS, (L.BH, L.Dk, L.Dv), q.device), _grad_in(ds, (L.BH, L.Dv), q.device)
        # the gradient of the returned weights, turned into that of W0 in place
        dW0 = _grad_in(dW, (L.BH, L.Dk, L.Dv), q.device)
        BB, BV = L.consts["BB"], L.consts["BV"]
        acc = torch.zeros(L.BH, 3, BV, **f32)  # d (the bias's), dgamma, dbeta per program
        if db is not None:
            acc[:, 0, :L.Dv] = db
        dtau = torch.zeros(L.BH, BB, **f32)
        dq = torch.empty(q.shape, **f32)
        dk = torch.empty(q.shape, **f32)
        dv = torch.empty(v.shape, **f32)
        deta = torch.empty(eta.shape, **f32)
        seg = L.seg
        wn = torch.empty(L.BH, seg, L.Dk, L.Dv, **f32)
        dn = torch.empty(L.BH, seg, L.Dk, L.Dv, **f32)
        scb = torch.empty(L.BH, seg, L.Dv, **f32)
        gs = torch.empty(L.BH, 2, BV, BB, **f32)
        rows = torch.empty(L.BH, seg, 5, BV, BB, **f32)
        rr = torch.empty(L.BH, seg, 2, BB, **f32)
        at = torch.empty(L.BH, seg, BB, BB, **f32)
        ln = (_or(lnw, tau), _or(lnb, tau))
        T, H, Dk, Dv, b, N, NF, _ = L.dims
        consts = {n: L.consts[n] for n in ("RESIDUAL", "PREC", "BB", "BK", "BV", "KC")}
        DC = min(BV, 32)
        from . import triton_resident  # the resident backward kernels (FASTWEIGHTS_TTT_BWD)

        def segment(n0, n1, w, wb, w_stride, tail):
            args_a = (q, k, v, eta, tau, A, *ln, w, wb, wn, scb, gs, rows, rr, at, do, acc, dtau,
                      T, H, Dk, Dv, b, N, n0, n1, w_stride, seg)
            if not triton_resident.launch_backward_a(L, *args_a):  # FASTWEIGHTS_TTT_BWD
                _linear_bwd_a_kernel[(L.BH,)](*args_a, DC=DC, **L.launch())
            args_b = (q, k, v, eta, tau, *ln, dn, rows, rr, dS, ds, dW0, acc, dtau, dv, deta,
                      T, H, Dk, Dv, b, n0, n1, seg)
            if not triton_resident.launch_backward_b(L, tail, *args_b):  # FASTWEIGHTS_TTT_BWD
                _linear_bwd_b_kernel[(L.BH,)](*args_b, TAIL=tail, **L.launch())
            _linear_bwd_c_kernel[(n1 - n0, L.BH)](
                q, k, eta, tau, do, wn, dS if tail else dn, rows, at, dq, dk, dv,
                T, H, Dk, Dv, b, n0, seg, 0 if tail else Dk * Dv, TAIL=tail, **consts,
                num_warps=L.cfg.warps, num_stages=1)

        if NF < N:  # the last, partial mini-batch starts from the returned weights
            segment(NF, N, W, bias, Dk * Dv, True)
        for s in reversed(range(L.NC)):
            segment(s * seg, min(s * seg + seg, NF), ckw[:, s], ckb[:, s], L.NC * Dk * Dv, False)
        dtau = dtau.view(L.B, L.H, BB)[..., :L.b].sum(0)
        acc = acc[..., :L.Dv]
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), deta.to(eta.dtype), dtau,
                None if lnw is None else acc[:, 1].reshape(L.B, L.H, L.Dv).sum(0),
                None if lnb is None else acc[:, 2].reshape(L.B, L.H, L.Dv).sum(0),
                dW0, acc[:, 0] if L.consts["HAS_BIAS"] else None, None, None)


class _MLPTriton(torch.autograd.Function):
    """(o, W1, b1, W2, b2, S1, s1, S2, s2) = TTT-MLP from a mini-batch boundary in the kernels
    above. q, k [B, T, H, Dk], v [B, T, H, Dv] contiguous in their dtype; eta [B, T, H],
    tau [H, b], lnw, lnb [H, Dv] or None; W1 [B*H, Dk, Dh], b1 [B*H, Dh] or None,
    W2 [B*H, Dh, Dv], b2 [B*H, Dv] or None, float32 contiguous. The biases returned are
    zeros where the input is None."""

    @staticmethod
    def forward(ctx, q, k, v, eta, tau, lnw, lnb, W1, b1, W2, b2, residual, seg):  # type: ignore[override]
        flags = {"HAS_B1": b1 is not None, "HAS_B2": b2 is not None, "HAS_LN": lnw is not None,
                 "HAS_LNB": lnb is not None, "RESIDUAL": residual}
        L = _shape("ttt_mlp", q, v, tau.shape[-1], seg, flags)
        BH, Dk, Dv, Dh = L.BH, L.Dk, L.Dv, W1.shape[-1]
        f32 = {"dtype": torch.float32, "device": q.device}
        BB, BV = L.consts["BB"], L.consts["BV"]
        w1, w2 = W1.clone(), W2.clone()  # updated in place by the kernel
        c1 = torch.zeros(BH, Dh, **f32) if b1 is None else b1.clone()
        c2 = torch.zeros(BH, Dv, **f32) if b2 is None else b2.clone()
        sums = [torch.zeros_like(x) for x in (w1, c1, w2, c2)]
        o = torch.empty(*q.shape[:3], Dv, dtype=q.dtype, device=q.device)
        store = any(ctx.needs_input_grad)
        NC = L.NC if store else 0
        cks = [torch.empty(BH, NC, *x.shape[1:], **f32) for x in (w1, c1, w2, c2)]
        from . import cluster  # the thread-block-cluster forward (FASTWEIGHTS_TTT_MLP_FWD)

        ran = cluster.launch_forward(L, store, q, k, v, eta, tau, lnw, lnb, w1, c1, w2, c2, o,
                                     sums, cks)
        A = _scores(L, q, k, b1 is not None) if store or not ran else None
        if not ran:
            _mlp_fwd_kernel[(BH,)](
                q, k, v, eta, tau, A, _or(lnw, tau), _or(lnb, tau), w1, c1, w2, c2, o, *sums,
                torch.empty(BH, BV, BB, **f32), *cks, L.T, L.H, Dk, Dv, Dh, L.b, L.N,
                L.T // L.b, L.seg, store, BHD=_pow2(Dh), HB=L.cfg.HB, **L.launch())
        if store:
            ctx.save_for_backward(q, k, v, eta, tau, lnw, lnb, A, w1, c1, w2, c2, *cks)
            ctx.L = L
        return o, w1, c1, w2, c2, *sums

    @staticmethod
    def backward(ctx, do, dw1, dc1, dw2, dc2, ds1, dsb1, ds2, dsb2):  # type: ignore[override]
        from . import cluster  # recomputes the segments (FASTWEIGHTS_TTT_MLP_FWD)

        q, k, v, eta, tau, lnw, lnb, A, w1, c1, w2, c2, *cks = ctx.saved_tensors
        L = ctx.L
        T, H, Dk, Dv, b, N, NF, seg = L.dims
        BH, Dh = L.BH, w1.shape[-1]
        f32 = {"dtype": torch.float32, "device": q.device}
        shapes = [x.shape for x in (w1, c1, w2, c2)]
        do = _grad_in(do, (*q.shape[:3], Dv), q.device)
        carried = [_grad_in(x, s, q.device) for x, s in zip((dw1, dc1, dw2, dc2), shapes)]
        dsums = [_grad_in(x, s, q.device) for x, s in zip((ds1, dsb1, ds2, dsb2), shapes)]
        BB, BV = L.consts["BB"], L.consts["BV"]
        acc = torch.zeros(BH, 2, BV, **f32)  # dgamma, dbeta per program
        dtau = torch.zeros(BH, BB, **f32)
        dq, dk = torch.empty(q.shape, **f32), torch.empty(k.shape, **f32)
        dv, deta = torch.empty(v.shape, **f32), torch.empty(eta.shape, **f32)
        slots = [torch.empty(BH, seg + 1, *s[1:], **f32) for s in shapes]
        o = torch.empty(*q.shape[:3], Dv, **f32)  # the recomputed read-out (unused)
        gs = torch.empty(BH, BV, BB, **f32)
        BHD = _pow2(Dh)
        # each mini-batch's rows (``_mlp_bwd_a_kernel``), the first pass's accumulators
        hs = torch.empty(BH, seg, 4, BHD, BB, **f32)
        vs = torch.empty(BH, seg, 5, BV, BB, **f32)
        rr = torch.empty(BH, seg, BB, **f32)
        at = torch.empty(BH, seg, BB, BB, **f32)
        sc = torch.empty(BH, 3 * BHD * BB + BV * BB, **f32)  # ``_mlp_bwd_b_kernel``'s scratch
        acc_a = torch.zeros(BH, N, 2, BV, **f32)
        dtau_a = torch.zeros(BH, N, BB, **f32)
        ln = (_or(lnw, tau), _or(lnb, tau))
        fl = {n: L.consts[n] for n in ("HAS_B1", "HAS_B2", "HAS_LN", "HAS_LNB", "RESIDUAL",
                                       "PREC", "BB", "BK", "BV", "KC")}
        hb = {"BHD": BHD, "HB": min(L.cfg.HBB, BHD)}
        warps = {"num_warps": L.cfg.warps, "num_stages": 1}

        def back(n0, n1, ws, w_bh, w_j, tail):
            args_a = (q, k, v, eta, tau, A, *ln, *ws, do, hs, vs, rr, at, acc_a, dtau_a, dq, dk,
                      deta, T, H, Dk, Dv, Dh, b, N, n0)
            if not cluster.launch_backward_a(L, (*args_a, n1, seg, w_bh, w_j), tail):
                _mlp_bwd_a_kernel[(n1 - n0, BH)](*args_a, seg, w_bh, w_j, DC=min(BV, 32), **hb,
                                                 **fl, **warps)
            args_b = (q, k, v, eta, tau, A, *ln, ws[0], ws[2], *dsums, *carried, hs, vs, rr, at,
                      sc, acc, dtau, dk, dv, deta, T, H, Dk, Dv, Dh, b, N, n0, n1, seg, w_bh, w_j)
            if not cluster.launch_backward_b(L, args_b, tail):
                _mlp_bwd_b_kernel[(BH,)](*args_b, TAIL=tail, **hb, **fl, **warps)

        if NF < N:  # the last, partial mini-batch starts from the returned weights
            back(NF, N, (w1, c1, w2, c2), 1, 0, True)
        for s in reversed(range(L.NC)):
            n0, n1 = s * seg, min(s * seg + seg, NF)
            for x, ck in zip(slots, cks):
                x[:, 0] = ck[:, s]
            if n1 - n0 > 1 and not cluster.launch_recompute(L, q, k, v, eta, tau, lnw, lnb,
                                                            slots, n0, n1):
                _mlp_recompute_kernel[(BH,)](
                    q, k, v, eta, tau, A, *ln, *slots, o, gs, T, H, Dk, Dv, Dh, b, N, n0, n1,
                    seg, BHD=BHD, HB=L.cfg.HB, **fl, **warps)
            back(n0, n1, slots, seg + 1, 1, False)
        acc += acc_a.sum(1)
        dtau += dtau_a.sum(1)
        dtau = dtau.view(L.B, L.H, BB)[..., :b].sum(0)
        acc = acc[..., :Dv]
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), deta.to(eta.dtype), dtau,
                None if lnw is None else acc[:, 0].reshape(L.B, H, Dv).sum(0),
                None if lnb is None else acc[:, 1].reshape(L.B, H, Dv).sum(0),
                carried[0], carried[1] if L.consts["HAS_B1"] else None, carried[2],
                carried[3] if L.consts["HAS_B2"] else None, None, None)


def _or(x: torch.Tensor | None, other: torch.Tensor) -> torch.Tensor:
    """x, or a stand-in pointer for an argument the kernel does not read (its flag is off)."""
    return other if x is None else x


def _scores(L: _Shape, q: torch.Tensor, k: torch.Tensor, has_bias: bool) -> torch.Tensor:
    """``_qk_kernel``'s A^T [B*H, N, BB, BB] of every mini-batch (+ 1 with ``has_bias``)."""
    BB = L.consts["BB"]
    A = torch.empty(L.BH, L.N, BB, BB, dtype=torch.float32, device=q.device)
    _qk_kernel[(L.N, L.BH)](q, k, A, L.T, L.H, L.Dk, L.b, L.N, HAS_BIAS=has_bias, num_warps=4,
                            **{n: L.consts[n] for n in ("PREC", "BB", "BK")})
    return A


def _split_first(run_torch, q, k, v, eta, carry: Carry, b: int):
    """A call that starts inside a mini-batch: (o of its first b - pos tokens through the
    PyTorch dual form, the carry after them, the remaining q, k, v, eta); else (None, carry,
    q, k, v, eta)."""
    if carry.pos == 0:
        return None, carry, q, k, v, eta
    n = min(b - carry.pos, q.shape[1])
    o, carry = run_torch(*(x[:, :n] for x in (q, k, v, eta)), carry)
    return o, carry, *(x[:, n:] for x in (q, k, v, eta))


def _join(first: torch.Tensor | None, o: torch.Tensor | None) -> torch.Tensor:
    if first is None:
        return o
    return first if o is None else torch.cat([first.to(o.dtype), o], dim=1)


def ttt_linear_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, carry: Carry,
    ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None, residual: bool,
    tau: torch.Tensor, checkpoint_group: int | None = None,
) -> tuple[torch.Tensor, Carry]:
    """TTT-Linear's dual form (``chunk.ttt_linear_dual``'s arguments and results) in the
    kernels above. q, k, v in float16, bfloat16 or float32 (read as they are); eta, tau, the
    LayerNorm's parameters and the carry in float32. Returns (o [B, T, H, Dv] in q's dtype,
    Carry in float32). ``checkpoint_group``: mini-batches per checkpoint of the backward's
    recomputation (default ``SEGMENT``); results do not depend on it."""
    from .chunk import ttt_linear_dual

    b = tau.shape[-1]

    def run_torch(q, k, v, eta, carry):
        f = torch.float32
        return ttt_linear_dual(q.to(f), k.to(f), v.to(f), eta, carry, ln_weight, ln_bias,
                               residual, tau)

    first, carry, q, k, v, eta = _split_first(run_torch, q, k, v, eta, carry, b)
    if q.shape[1] == 0:
        return first, carry
    B, T, H, Dk = q.shape
    W0, b0 = carry.start
    o, W, bias, S, s = _LinearTriton.apply(
        q.contiguous(), k.contiguous(), v.contiguous(), _f32(eta), _f32(tau), _f32(ln_weight),
        _f32(ln_bias), _f32(W0.reshape(B * H, Dk, -1)),
        None if b0 is None else _f32(b0.reshape(B * H, -1)), residual, checkpoint_group)
    tail = T % b
    Dv = v.shape[-1]
    W, bias = W.view(B, H, Dk, Dv), (None if b0 is None else bias.view(B, H, Dv))
    grads = None
    if tail:
        grads = (S.view(B, H, Dk, Dv), None if b0 is None else s.view(B, H, Dv))
    return _join(first, o), Carry((W, bias), grads, tail)


def ttt_mlp_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, carry: Carry,
    ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None, residual: bool,
    tau: torch.Tensor, checkpoint_group: int | None = None,
) -> tuple[torch.Tensor, Carry]:
    """TTT-MLP's dual form (``chunk.ttt_mlp_dual``'s arguments and results) in the kernels
    above, forward and backward; inputs as ``ttt_linear_triton``'s. ``checkpoint_group``:
    mini-batches per checkpoint of the backward's recomputation (default ``SEGMENT``);
    results do not depend on it."""
    from .chunk import ttt_mlp_dual

    b = tau.shape[-1]

    def run_torch(q, k, v, eta, carry):
        f = torch.float32
        return ttt_mlp_dual(q.to(f), k.to(f), v.to(f), eta, carry, ln_weight, ln_bias, residual,
                            tau)

    first, carry, q, k, v, eta = _split_first(run_torch, q, k, v, eta, carry, b)
    if q.shape[1] == 0:
        return first, carry
    (B, T, H, Dk), Dv = q.shape, v.shape[-1]
    W1, b1, W2, b2 = carry.start
    Dh = W1.shape[-1]

    def flat(x, *shape):
        return None if x is None else _f32(x.reshape(*shape))

    o, *out = _MLPTriton.apply(
        q.contiguous(), k.contiguous(), v.contiguous(), _f32(eta), _f32(tau), _f32(ln_weight),
        _f32(ln_bias), flat(W1, B * H, Dk, Dh), flat(b1, B * H, Dh), flat(W2, B * H, Dh, Dv),
        flat(b2, B * H, Dv), residual, checkpoint_group)
    tail = T % b

    def weights(x1, x2, x3, x4):
        return (x1.view(B, H, Dk, Dh), None if b1 is None else x2.view(B, H, Dh),
                x3.view(B, H, Dh, Dv), None if b2 is None else x4.view(B, H, Dv))

    return _join(first, o), Carry(weights(*out[:4]), weights(*out[4:]) if tail else None, tail)
