"""The Triton pieces every TTT kernel shares (ops/ttt/triton.py, triton_regs.py,
triton_resident.py): tokens of a mini-batch as tile columns, transposed weight blocks, the inner
LayerNorm's loss gradient and its backward, the causal step sizes, TTT-Linear's mini-batch
inputs and read-out, and the sequential backward passes' common steps. Jit helpers only; no
kernel or host code here."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import LN_EPS

_EPS = tl.constexpr(LN_EPS)

# ---------------------------------------------------------------------------------------------
# Shared pieces. Token t of batch row bb, head h of a [B, T, H, D] tensor sits at
# ((bb*T + t)*H + h)*D: a scalar int64 base per program, int32 offsets inside a tile.
#
# Every per-token tile is held transposed, [D, BB] (a mini-batch's rows as columns), and every
# weight as W^T [Dv, Dk]: the products then have the head dim, not the mini-batch, as their M
# (rows) dimension. Triton stacks the warps of a chain of products along M (sm_80's mma), and
# Hopper's wgmma takes M in multiples of 64 per warp group: with b = 16 rows as M, 8 warps would
# each hold a whole [16, D] tile (the same rows replicated), and a [16, 128] float32 tile alone
# is then 64 registers per thread.


@triton.jit
def _head(bh, H, T, Dk, Dv):
    """Program bh's head h (batch row bh // H) and the offsets of its token 0 in [B, T, H, Dk],
    [B, T, H, Dv] and [B, T, H] tensors."""
    bb = bh // H
    h = bh % H
    ebase = bb * T * H + h
    return h, ebase * Dk, ebase * Dv, ebase


@triton.jit
def _mb(n, b, T, BB: tl.constexpr):
    """Positions 0..BB-1 of mini-batch n, their token indices and the mask of real rows."""
    i = tl.arange(0, BB)
    t = n * b + i
    return i, t, (i < b) & (t < T)


@triton.jit
def _cols(ptr, base, t, m, H, D, BD: tl.constexpr, c0=0):
    """Tokens t (mask m) of a [B, T, H, D] tensor at ``base`` (the (batch, head)'s token 0),
    features c0..c0+BD, as the columns of a float32 [BD, BB] tile."""
    c = c0 + tl.arange(0, BD)
    offs = c[:, None] + (t * H * D)[None, :]
    return tl.load(ptr + base + offs, mask=(c < D)[:, None] & m[None, :], other=0.0).to(tl.float32)


@triton.jit
def _store_cols(ptr, x, base, t, m, H, D, BD: tl.constexpr, c0=0):
    c = c0 + tl.arange(0, BD)
    offs = c[:, None] + (t * H * D)[None, :]
    tl.store(ptr + base + offs, x.to(ptr.dtype.element_ty), mask=(c < D)[:, None] & m[None, :])


@triton.jit
def _blockT(ptr, r0, c0, R, C, BR: tl.constexpr, BC: tl.constexpr):
    """Rows r0..r0+BR, columns c0..c0+BC of a row-major float32 [R, C] matrix, transposed:
    a [BC, BR] tile."""
    r = r0 + tl.arange(0, BR)
    c = c0 + tl.arange(0, BC)
    return tl.load(ptr + c[:, None] + r[None, :] * C, mask=(c < C)[:, None] & (r < R)[None, :],
                   other=0.0)


@triton.jit
def _store_blockT(ptr, x, r0, c0, R, C, BR: tl.constexpr, BC: tl.constexpr):
    r = r0 + tl.arange(0, BR)
    c = c0 + tl.arange(0, BC)
    tl.store(ptr + c[:, None] + r[None, :] * C, x, mask=(c < C)[:, None] & (r < R)[None, :])


@triton.jit
def _block(ptr, r0, c0, R, C, BR: tl.constexpr, BC: tl.constexpr):
    """Rows r0..r0+BR, columns c0..c0+BC of a row-major float32 [R, C] matrix: [BR, BC]."""
    r = r0 + tl.arange(0, BR)
    c = c0 + tl.arange(0, BC)
    return tl.load(ptr + r[:, None] * C + c[None, :], mask=(r < R)[:, None] & (c < C)[None, :],
                   other=0.0)


@triton.jit
def _store_block(ptr, x, r0, c0, R, C, BR: tl.constexpr, BC: tl.constexpr):
    r = r0 + tl.arange(0, BR)
    c = c0 + tl.arange(0, BC)
    tl.store(ptr + r[:, None] * C + c[None, :], x, mask=(r < R)[:, None] & (c < C)[None, :])


@triton.jit
def _wrows(ptr, c0, R, C, BC: tl.constexpr, KC: tl.constexpr):
    """Rows c0..c0+KC of a row-major float32 [R, C] matrix, transposed: a [BC, KC] tile."""
    return _blockT(ptr, c0, 0, R, C, KC, BC)


@triton.jit
def _store_wrows(ptr, x, c0, R, C, BC: tl.constexpr, KC: tl.constexpr):
    _store_blockT(ptr, x, c0, 0, R, C, KC, BC)


@triton.jit
def _copy_mat(src, dst, R, C, BR: tl.constexpr, BC: tl.constexpr, KC: tl.constexpr):
    """dst = src for row-major [R, C] matrices, in blocks of KC rows."""
    for c0 in tl.static_range(0, BR, KC):
        _store_wrows(dst, _wrows(src, c0, R, C, BC, KC), c0, R, C, BC, KC)
    tl.debug_barrier()


@triton.jit
def _copy_flat(src, dst, n, BLK: tl.constexpr):
    """dst[:n] = src[:n] (float32), BLK elements at a time."""
    for o in range(0, n, BLK):
        c = o + tl.arange(0, BLK)
        tl.store(dst + c, tl.load(src + c, mask=c < n), mask=c < n)


@triton.jit
def _vec(ptr, n, BN: tl.constexpr):
    c = tl.arange(0, BN)
    return tl.load(ptr + c, mask=c < n, other=0.0).to(tl.float32)


@triton.jit
def _ln_affine(lnw_ptr, lnb_ptr, h, Dv, BV: tl.constexpr, HAS_LN: tl.constexpr,
               HAS_LNB: tl.constexpr):
    """Head h's inner-LayerNorm gain and bias [BV] as float32 (zero without them)."""
    gam = tl.zeros([BV], dtype=tl.float32)
    bet = tl.zeros([BV], dtype=tl.float32)
    if HAS_LN:
        gam = _vec(lnw_ptr + h * Dv, Dv, BV)
        if HAS_LNB:
            bet = _vec(lnb_ptr + h * Dv, Dv, BV)
    return gam, bet


@triton.jit
def _store_vec(ptr, x, n, BN: tl.constexpr):
    c = tl.arange(0, BN)
    tl.store(ptr + c, x, mask=c < n)


@triton.jit
def _dot(a, b, PREC: tl.constexpr, acc=None):
    return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def _ln(z, cm, Dv):
    """LayerNorm statistics of the columns of z [BV, BB] (rows past Dv zero, cm their mask):
    (x_hat, 1/s), x_hat zero past Dv."""
    mu = tl.sum(z, axis=0) / Dv
    zc = tl.where(cm[:, None], z - mu[None, :], 0.0)
    r = 1.0 / tl.sqrt(tl.sum(zc * zc, axis=0) / Dv + _EPS)
    return zc * r[None, :], r


@triton.jit
def _ln_back(dy, xh, r, cm, Dv):
    """The backward of LayerNorm without affine at columns with x_hat, 1/s: r (dy - mean(dy)
    - x_hat mean(dy x_hat)), zero past Dv."""
    mean_dy = tl.sum(dy, axis=0) / Dv
    mean_dyx = tl.sum(dy * xh, axis=0) / Dv
    return tl.where(cm[:, None], r[None, :] * (dy - mean_dy[None, :] - xh * mean_dyx[None, :]),
                    0.0)


@triton.jit
def _loss_grad(z, tgt, gam, bet, cm, Dv, HAS_LN: tl.constexpr):
    """dl/dZ of l = 1/2 ||[LN](Z) - tgt||^2 per column (token) of z [BV, BB] (docs/maths.md
    2.2), and the LayerNorm's x_hat, 1/s and g = gamma (LN(Z) - tgt) that its backward reads
    (placeholders without LayerNorm)."""
    G = z - tgt
    xh = z
    r = tl.sum(z, axis=0)  # placeholders without LayerNorm (unused there)
    g = z
    if HAS_LN:
        xh, r = _ln(z, cm, Dv)
        g = gam[:, None] * (gam[:, None] * xh + bet[:, None] - tgt)
        G = _ln_back(g, xh, r, cm, Dv)
    return G, xh, r, g


@triton.jit
def _ln_grad_back(dG, G, xh, r, g, gam, cm, Dv):
    """Vector-Jacobian product of ``_loss_grad`` (with LayerNorm) w.r.t. Z, and dg (the
    gradient w.r.t. g = gamma (LN(Z) - tgt)); as mlp_scan.py's ``_ln_grad_backward``:
    dg = LNB(dG), dx_hat = gamma^2 dg - r mean(g x_hat) dG - g mean(dG r x_hat),
    dZ = LNB(dx_hat) - r x_hat mean(dG G)."""
    dg = _ln_back(dG, xh, r, cm, Dv)
    c = r * (tl.sum(g * xh, axis=0) / Dv)
    m = tl.sum(dG * xh, axis=0) / Dv * r
    dxh = gam[:, None] * gam[:, None] * dg - c[None, :] * dG - g * m[None, :]
    mdg = tl.sum(dG * G, axis=0) / Dv
    return _ln_back(dxh, xh, r, cm, Dv) - (r * mdg)[None, :] * xh, dg


@triton.jit
def _step_scales(eta_ptr, tau_ptr, ebase, h, t, m, i, b, H, BB: tl.constexpr):
    """eta [BB] of the mini-batch's tokens (0 past b and T), tau [BB] of the head's positions,
    and the transposed causal step sizes Et [BB, BB], Et_ji = E_ij = tau_i eta_j for j <= i."""
    eta = tl.load(eta_ptr + ebase + t * H, mask=m, other=0.0).to(tl.float32)
    tau = tl.load(tau_ptr + h * b + i, mask=i < b, other=0.0).to(tl.float32)
    Et = tl.where(i[:, None] <= i[None, :], eta[:, None] * tau[None, :], 0.0)
    return eta, tau, Et


# TTT-Linear's mini-batch inputs and read-out (the streamed and register-resident forwards)


@triton.jit
def _linear_in(eta_ptr, tau_ptr, a_ptr, bh, h, ebase, n, T, H, b, N, BB: tl.constexpr):
    """Mini-batch n's positions i, tokens t, mask m, eta, tau [BB], Et and A^T [BB, BB]
    (``_step_scales``, ``_qk_kernel``)."""
    i, t, m = _mb(n, b, T, BB)
    eta, tau, Et = _step_scales(eta_ptr, tau_ptr, ebase, h, t, m, i, b, H, BB)
    r = tl.arange(0, BB)
    At = tl.load(a_ptr + ((bh * N + n) * BB + r[:, None]) * BB + r[None, :])
    return i, t, m, eta, tau, Et, At


@triton.jit
def _linear_out(o_ptr, zbar, q_ptr, gam, bet, cm, base_v, t, m, H, Dv,
                HAS_LN: tl.constexpr, RESIDUAL: tl.constexpr, BV: tl.constexpr):
    """o = [LN](Zbar) [+ q] stored for the mini-batch's tokens."""
    out = zbar
    if HAS_LN:
        xo, _ = _ln(zbar, cm, Dv)
        out = gam[:, None] * xo + bet[:, None]
    if RESIDUAL:  # Dk == Dv: q's rows have o's address
        out += _cols(q_ptr, base_v, t, m, H, Dv, BV)
    _store_cols(o_ptr, out, base_v, t, m, H, Dv, BV)


# The pieces the sequential backward passes share (ops/ttt/triton.py's streamed one and
# triton_resident.py's resident one), and the row tiles they read back


@triton.jit
def _store_tile(ptr, x, R: tl.constexpr, C: tl.constexpr):
    r = tl.arange(0, R)
    c = tl.arange(0, C)
    tl.store(ptr + r[:, None] * C + c[None, :], x)


@triton.jit
def _load_tile(ptr, R: tl.constexpr, C: tl.constexpr):
    r = tl.arange(0, R)
    c = tl.arange(0, C)
    return tl.load(ptr + r[:, None] * C + c[None, :])


@triton.jit
def _readout_back(dO, zbar, G, rows_ptr, gam, cm, dgam, dbet, Dv, HAS_LN: tl.constexpr,
                  BB: tl.constexpr, BV: tl.constexpr):
    """The backward of a mini-batch's read-out o = [LN](Zbar) [+ q] from dO and Zbar^T
    [BV, BB] (the recompute/read-out kernels): dZbar^T, the LayerNorm's dgamma and dbeta added
    to; G^T and dZbar^T stored as the mini-batch's first two rows. Returns (dZbar^T, dgamma,
    dbeta)."""
    dzbar = dO
    if HAS_LN:
        xo, ro = _ln(zbar, cm, Dv)
        dgam += tl.sum(dO * xo, axis=1)
        dbet += tl.sum(dO, axis=1)
        dzbar = _ln_back(gam[:, None] * dO, xo, ro, cm, Dv)
    _store_tile(rows_ptr, G, BV, BB)
    _store_tile(rows_ptr + BV * BB, dzbar, BV, BB)
    return dzbar, dgam, dbet


@triton.jit
def _keys_back(dHm, G, eta, rows_ptr, rr_ptr, v_ptr, k_ptr, dv_ptr, deta_ptr, dgam, dbet, gam,
               bet, cm, base_v, ebase, t, m, H, Dv, HAS_LN: tl.constexpr,
               RESIDUAL: tl.constexpr, BB: tl.constexpr, BV: tl.constexpr):
    """The part of a mini-batch's sequential backward after dHm, the gradient of its eta G
    (the rows of ``_linear_back_a`` at rows_ptr, rr_ptr): the keys' loss gradient G = dl/dZk
    differentiated. Stores dV, deta and dZk^T (into the rows, for ``_linear_bwd_c_kernel``'s
    dK); returns dZk^T and the accumulators dgamma, dbeta."""
    rb = tl.arange(0, BB)
    dG = _load_tile(rows_ptr + 2 * BV * BB, BV, BB) + dHm * eta[None, :]
    deta = tl.load(rr_ptr + BB + rb) + tl.sum(G * dHm, axis=0)
    dtgt = -dG
    dzk = dG
    if HAS_LN:
        xh = _load_tile(rows_ptr + 3 * BV * BB, BV, BB)
        g = _load_tile(rows_ptr + 4 * BV * BB, BV, BB)
        dzk, dg = _ln_grad_back(dG, G, xh, tl.load(rr_ptr + rb), g, gam, cm, Dv)
        dtgt = -gam[:, None] * dg
        e = gam[:, None] * xh + bet[:, None] - _cols(v_ptr, base_v, t, m, H, Dv, BV)
        if RESIDUAL:
            e += _cols(k_ptr, base_v, t, m, H, Dv, BV)
        dgam += tl.sum(dg * (e + gam[:, None] * xh), axis=1)
        dbet -= tl.sum(dtgt, axis=1)
    _store_cols(dv_ptr, dtgt, base_v, t, m, H, Dv, BV)
    tl.store(deta_ptr + ebase + t * H, deta, mask=m)
    _store_tile(rows_ptr + 2 * BV * BB, dzk, BV, BB)
    return dzk, dgam, dbet


@triton.jit
def _back_b_start(bh, lnw_ptr, lnb_ptr, tau_ptr, acc_ptr, T, H, Dk, Dv, b,
                  HAS_LN: tl.constexpr, HAS_LNB: tl.constexpr, BB: tl.constexpr,
                  BV: tl.constexpr):
    """What a sequential backward pass over program bh's mini-batches starts from: its
    offsets (``_head``), the column mask, the LayerNorm's gain and bias, tau_b, and the
    accumulators d, dgamma, dbeta (from acc [B*H, 3, BV]) and tau_b's gradient (zero)."""
    h, base_k, base_v, ebase = _head(bh, H, T, Dk, Dv)
    gam, bet = _ln_affine(lnw_ptr, lnb_ptr, h, Dv, BV, HAS_LN, HAS_LNB)
    tau_b = tl.load(tau_ptr + h * b + b - 1).to(tl.float32)
    acc = acc_ptr + bh * 3 * BV
    return (base_k, base_v, ebase, tl.arange(0, BV) < Dv, gam, bet, tau_b, _vec(acc, BV, BV),
            _vec(acc + BV, BV, BV), _vec(acc + 2 * BV, BV, BV),
            tl.sum(tl.zeros([BB], dtype=tl.float32), axis=0))


@triton.jit
def _back_b_end(bh, acc_ptr, dtau_ptr, d, dgam, dbet, dtau_b, b, BB: tl.constexpr,
                BV: tl.constexpr):
    """The accumulators of ``_back_b_start`` stored back (tau_b's gradient added)."""
    acc = acc_ptr + bh * 3 * BV
    _store_vec(acc, d, BV, BV)
    _store_vec(acc + BV, dgam, BV, BV)
    _store_vec(acc + 2 * BV, dbet, BV, BV)
    p = dtau_ptr + bh * BB + b - 1
    tl.store(p, tl.load(p) + dtau_b)
