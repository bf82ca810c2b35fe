"""Triton kernels for TTT's one-token step (ops/ttt/recurrent.py's ``linear_token`` and
``mlp_token`` for an int place): the whole step in one launch.

Dimension legend: B batch, H heads, Dk key/query dim, Dv value dim, b mini-batch size, p the
token's place in its mini-batch (the rows of the current mini-batch held before it); BK, BV the
key and value tiles (powers of two >= Dk, Dv, at least 16), KC the rows of a weight block, RB
the rows of a block of the mini-batch's rows; TTT-MLP: Dh = 4 Dk hidden units, HB the units of
a hidden block, BR >= b the mini-batch's rows as one tile.

One program per (batch, head): the inner LayerNorm needs all Dv columns of the key's Z = k W_0
+ b_0 (its mean and variance), so the value columns cannot go to separate programs (as for the
dual form's kernels, ops/ttt/triton.py). Per program, with x_j, eg_j the p rows of the current
mini-batch (its inputs and eta-scaled output gradients, ``TTTState.rows``), all at the start
weights W_0, b_0 (docs/maths.md 2.4's dual form, one row at a time):
    zk = k W_0 + b_0, zq = q W_0 + b_0      (one pass over W_0, in blocks of KC rows)
    eg = eta dl/dzk                          (the LayerNorm gradient, fused; target v [- k])
    zbar = zq - tau_p (sum_j (q . x_j [+ 1]) eg_j + (q . k [+ 1]) eg)
    o = [LN](zbar) [+ q]
and either the rows with the token appended (x_p = k, eg_p = eg; copied into fresh buffers, so
that a carry a caller keeps is never written), or, when the token completes the mini-batch
(p = b - 1, ``COMMIT``), the next start weights W_0 - tau_b sum_j x_j^T eg_j (and bias
b_0 - tau_b sum_j eg_j), a second pass over W_0.

TTT-MLP (``_mlp_decode_kernel``), the same program with W1 [Dk, Dh], b1, W2 [Dh, Dv], b2 and
two rows per layer (x1_j = k_j, eg1_j; x2_j = gelu(Z1 of k_j), eg2_j): the weights (2 x 256
KiB float32 per head at D = 128) do not fit on chip and stream from global memory in hidden
blocks of HB units, in passes over the blocks:
    1. Z1k = k W1_0 + b1_0, Z1q = q W1_0 + b1_0 (into a scratch [2, Dh] per program),
       Z2 = gelu(Z1k) W2_0 + b2_0; then eg2 = eta dl/dZ2 (the LayerNorm gradient);
    2. per block, eg1 = eta (G2 W2_0^T) * gelu'(Z1k), the query's
       z1 = Z1q - tau_p (sum_j (q . x1_j [+ 1]) eg1_j + (q . k [+ 1]) eg1), xq = gelu(z1)
       through W2_0 and into the coefficients xq . x2_j (summed over the blocks); then
       o = [LN](xq W2_0 + b2_0 - tau_p (sum_j (xq . x2_j [+ 1]) eg2_j + (xq . x2k [+ 1]) eg2))
       [+ q], and the rows with the token appended (fresh buffers, as above);
    3. (``COMMIT`` only) per block, eg1 again and W1_0 - tau_b X1^T EG1, W2_0 - tau_b X2^T EG2
       and the biases' sums (a pass of its own keeps pass 2's registers low).
W1 is read once (twice on a commit), W2 twice (three times).

Every product is a matrix-vector product or a sum of b rank-one terms: no tensor-core tiles,
float32 FMAs on float32 weights and rows throughout, the same arithmetic as the PyTorch step's
float32 products (q, k, v, eta in their own dtype, upcast on load). docs/gpu_ttt_kernels.md
estimates what a step costs on an H100.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from .._triton_common import _arch, _pow2, tiled_everywhere
from .common import LN_EPS
from .triton import _gelu
from .triton_tiles import _ln_affine

__all__ = ["MAX_D", "MAX_MINI_BATCH", "OPS", "DecodeTiles", "supports", "tile_config",
           "ttt_linear_decode_triton", "ttt_mlp_decode_triton"]

OPS = ("ttt_linear", "ttt_mlp")  # the ops whose one-token step is here (registered in inner_loop.py)
MAX_D = 128  # Dk and Dv (ops/backend.py TRITON_MAX_DK)
MAX_MINI_BATCH = 64
_EPS = tl.constexpr(LN_EPS)


class DecodeTiles(NamedTuple):
    """Warps of the decoding kernels, KC the rows of a weight block, RB of a row block
    (TTT-Linear's), HB the hidden units of a block (TTT-MLP's)."""

    warps: int
    KC: int = 32
    RB: int = 16
    HB: int = 16  # TTT-MLP's hidden block


def tile_config(arch: int, dtype: torch.dtype, op: str, D: int = MAX_D) -> DecodeTiles | None:
    """The launch choice for ``op`` (one of OPS) with head size D = max(Dk, Dv) <= 128 on
    compute capability ``arch`` (the same on sm_80 and sm_90) and ``dtype`` inputs, or None
    where the dispatcher leaves the step to PyTorch. tests/ops/test_ttt_triton_compile.py
    compiles the launches with these for sm_80 and sm_90 without register spills.

    Half inputs: 4 warps up to D = 64, 8 above; TTT-MLP's hidden blocks of 16 units (with
    blocks of 32 its step at b = 64 takes all 255 registers a thread has; Triton 3.6 spills
    with 8 warps at D = 64). Float32 inputs stay on PyTorch, as for the dual form's kernels (the dispatch rules are one for the TTT kernels; this kernel's
    arithmetic would take them as they are: it has no tensor-core products)."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if dtype not in (torch.float16, torch.bfloat16) or D > MAX_D:
        return None
    return DecodeTiles(warps=8 if D > 64 else 4)


def supports(op: str, dtype: torch.dtype) -> bool:
    """Whether ``op`` with ``dtype`` inputs has a tiling on every target for every head size up
    to MAX_D (the dispatcher's question, ops/backend.py)."""
    return tiled_everywhere(tile_config, op, dtype, MAX_D)


@triton.jit
def _row(ptr, c, n):
    """Entries c (mask c < n) of a vector as float32 (zero past n)."""
    return tl.load(ptr + c, mask=c < n, other=0.0).to(tl.float32)


@triton.jit
def _loss_grad_row(z, tgt, gam, bet, mv, Dv, HAS_LN: tl.constexpr):
    """dl/dz of l = 1/2 ||[LN](z) - tgt||^2 for one row z [BV] (zero past Dv, mask mv;
    docs/maths.md 2.2): the LayerNorm's backward fused."""
    G = z - tgt
    if HAS_LN:
        mu = tl.sum(z, axis=0) / Dv
        zc = tl.where(mv, z - mu, 0.0)
        rs = 1.0 / tl.sqrt(tl.sum(zc * zc, axis=0) / Dv + _EPS)
        xh = zc * rs
        g = gam * (gam * xh + bet - tgt)
        G = tl.where(mv, rs * (g - tl.sum(g, axis=0) / Dv - xh * (tl.sum(g * xh, axis=0) / Dv)),
                     0.0)
    return G


@triton.jit
def _store_out(o_ptr, z, qp, gam, bet, cv, Dv, HAS_LN: tl.constexpr, RESIDUAL: tl.constexpr):
    """o = [LN](z) [+ q] for one row z [BV] (columns cv, zero past Dv), stored in o's dtype."""
    mv = cv < Dv
    out = z
    if HAS_LN:
        mo = tl.sum(z, axis=0) / Dv
        zo = tl.where(mv, z - mo, 0.0)
        out = gam * zo / tl.sqrt(tl.sum(zo * zo, axis=0) / Dv + _EPS) + bet
    if RESIDUAL:
        out += _row(qp, cv, Dv)
    tl.store(o_ptr + cv, out.to(o_ptr.dtype.element_ty), mask=mv)


@triton.jit
def _linear_decode_kernel(
    q_ptr, k_ptr, v_ptr, eta_ptr, tau_ptr, lnw_ptr, lnb_ptr, w_ptr, b_ptr, x_ptr, eg_ptr,
    o_ptr, xn_ptr, egn_ptr, wn_ptr, bn_ptr,
    H, Dk, Dv, pos,
    sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, se_b, se_h, st_h,
    sw_b, sw_h, sb_b, sb_h, sx_b, sx_h, sx_r, sg_b, sg_h, sg_r,
    HAS_BIAS: tl.constexpr, HAS_LN: tl.constexpr, HAS_LNB: tl.constexpr,
    RESIDUAL: tl.constexpr, COMMIT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr, RB: tl.constexpr,
):
    """One TTT-Linear decoding step of one (batch, head) at place ``pos`` of its mini-batch.
    Reads q, k [B, 1, H, Dk], v [B, 1, H, Dv], eta [B, 1, H] (strides s*_b, s*_h; features
    contiguous), tau [H or 1, b] (st_h), the LayerNorm's lnw, lnb [H, Dv], the start weights
    w [B, H, Dk, Dv] and bias b [B, H, Dv] (strides; rows of a matrix contiguous) and the
    rows x [B, H, pos, Dk], eg [B, H, pos, Dv] (strides, row stride s*_r). Writes o
    [B, 1, H, Dv] and either (COMMIT) the next start weights wn [B, H, Dk, Dv], bias bn
    [B, H, Dv] or the rows with the token appended, xn [B, H, pos + 1, Dk], egn
    [B, H, pos + 1, Dv] (all contiguous)."""
    bh = tl.program_id(0).to(tl.int64)
    bb = bh // H
    h = bh % H
    ck = tl.arange(0, BK)
    cv = tl.arange(0, BV)
    mv = cv < Dv
    qp = q_ptr + bb * sq_b + h * sq_h
    kp = k_ptr + bb * sk_b + h * sk_h
    wp = w_ptr + bb * sw_b + h * sw_h
    xp = x_ptr + bb * sx_b + h * sx_h
    gp = eg_ptr + bb * sg_b + h * sg_h
    q = _row(qp, ck, Dk)
    eta = tl.load(eta_ptr + bb * se_b + h * se_h).to(tl.float32)
    t_pos = tl.load(tau_ptr + h * st_h + pos).to(tl.float32)
    # zk = k W_0 + b_0, zq = q W_0 + b_0: one pass over W_0, the sums over its rows reduced once
    ak = tl.zeros([KC, BV], dtype=tl.float32)
    aq = tl.zeros([KC, BV], dtype=tl.float32)
    for c0 in range(0, BK, KC):
        r = c0 + tl.arange(0, KC)
        w = tl.load(wp + r[:, None] * Dv + cv[None, :], mask=(r < Dk)[:, None] & mv[None, :],
                    other=0.0)
        ak += _row(kp, r, Dk)[:, None] * w
        aq += _row(qp, r, Dk)[:, None] * w
    zk = tl.sum(ak, axis=0)
    zq = tl.sum(aq, axis=0)
    b0 = tl.zeros([BV], dtype=tl.float32)
    if HAS_BIAS:
        b0 = _row(b_ptr + bb * sb_b + h * sb_h, cv, Dv)
        zk += b0
        zq += b0
    # eg = eta dl/dzk, l = 1/2 ||[LN](zk) - target||^2 (docs/maths.md 2.2)
    tgt = _row(v_ptr + bb * sv_b + h * sv_h, cv, Dv)
    if RESIDUAL:  # Dk == Dv
        tgt -= _row(kp, cv, Dv)
    gam, bet = _ln_affine(lnw_ptr, lnb_ptr, h, Dv, BV, HAS_LN, HAS_LNB)
    eg = eta * _loss_grad_row(zk, tgt, gam, bet, mv, Dv, HAS_LN)
    # zbar = zq - tau_pos sum_j (q . x_j [+ 1]) eg_j over the held rows and the token's own
    one = 1.0 if HAS_BIAS else 0.0
    acc = (tl.sum(q * _row(kp, ck, Dk), axis=0) + one) * eg
    egsum = eg
    for r0 in range(0, pos, RB):
        r = r0 + tl.arange(0, RB)
        mr = r < pos
        xb = tl.load(xp + r[:, None] * sx_r + ck[None, :], mask=mr[:, None] & (ck < Dk)[None, :],
                     other=0.0)
        gb = tl.load(gp + r[:, None] * sg_r + cv[None, :], mask=mr[:, None] & mv[None, :],
                     other=0.0)
        coef = tl.where(mr, tl.sum(xb * q[None, :], axis=1) + one, 0.0)
        acc += tl.sum(coef[:, None] * gb, axis=0)
        if COMMIT:
            egsum += tl.sum(gb, axis=0)
        else:  # the held rows, copied into the token's fresh buffers
            tl.store(xn_ptr + bh * (pos + 1) * Dk + r[:, None] * Dk + ck[None, :], xb,
                     mask=mr[:, None] & (ck < Dk)[None, :])
            tl.store(egn_ptr + bh * (pos + 1) * Dv + r[:, None] * Dv + cv[None, :], gb,
                     mask=mr[:, None] & mv[None, :])
    _store_out(o_ptr + bh * Dv, zq - t_pos * acc, qp, gam, bet, cv, Dv, HAS_LN, RESIDUAL)
    if COMMIT:
        # W_0 - tau_b (sum_j x_j^T eg_j + k^T eg), b_0 - tau_b (sum_j eg_j + eg); tau_b = tau_pos
        for c0 in range(0, BK, KC):
            r = c0 + tl.arange(0, KC)
            mk = r < Dk
            wm = mk[:, None] & mv[None, :]
            upd = _row(kp, r, Dk)[:, None] * eg[None, :]
            for j in range(0, pos):
                upd += _row(xp + j * sx_r, r, Dk)[:, None] * _row(gp + j * sg_r, cv, Dv)[None, :]
            w = tl.load(wp + r[:, None] * Dv + cv[None, :], mask=wm, other=0.0)
            tl.store(wn_ptr + bh * Dk * Dv + r[:, None] * Dv + cv[None, :], w - t_pos * upd,
                     mask=wm)
        if HAS_BIAS:
            tl.store(bn_ptr + bh * Dv + cv, b0 - t_pos * egsum, mask=mv)
    else:
        tl.store(xn_ptr + bh * (pos + 1) * Dk + pos * Dk + ck, _row(kp, ck, Dk), mask=ck < Dk)
        tl.store(egn_ptr + bh * (pos + 1) * Dv + pos * Dv + cv, eg, mask=mv)


@triton.jit
def _mlp_decode_kernel(
    q_ptr, k_ptr, v_ptr, eta_ptr, tau_ptr, lnw_ptr, lnb_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr,
    x1_ptr, g1_ptr, x2_ptr, g2_ptr, o_ptr, zs_ptr,
    x1n_ptr, g1n_ptr, x2n_ptr, g2n_ptr, w1n_ptr, b1n_ptr, w2n_ptr, b2n_ptr,
    H, Dk, Dv, Dh, pos,
    sq_b, sq_h, sk_b, sk_h, sv_b, sv_h, se_b, se_h, st_h,
    sw1_b, sw1_h, sb1_b, sb1_h, sw2_b, sw2_h, sb2_b, sb2_h,
    sx1_b, sx1_h, sx1_r, sg1_b, sg1_h, sg1_r, sx2_b, sx2_h, sx2_r, sg2_b, sg2_h, sg2_r,
    HAS_B1: tl.constexpr, HAS_B2: tl.constexpr, HAS_LN: tl.constexpr, HAS_LNB: tl.constexpr,
    RESIDUAL: tl.constexpr, COMMIT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BHD: tl.constexpr, BR: tl.constexpr, HB: tl.constexpr,
):
    """One TTT-MLP decoding step of one (batch, head) at place ``pos`` of its mini-batch.
    Reads q, k [B, 1, H, Dk], v [B, 1, H, Dv], eta [B, 1, H], tau [H or 1, b], lnw, lnb
    [H, Dv] (as ``_linear_decode_kernel``), the start weights w1 [B, H, Dk, Dh], b1
    [B, H, Dh], w2 [B, H, Dh, Dv], b2 [B, H, Dv] (strides; rows of a matrix contiguous) and
    the held rows x1 [B, H, pos, Dk], g1 [B, H, pos, Dh], x2 [B, H, pos, Dh], g2
    [B, H, pos, Dv] (strides, row strides s*_r). zs [B*H, 2, Dh]: scratch (the hidden
    pre-activations of the key and the query, from the first pass to the second). Writes o
    [B, 1, H, Dv] and either (COMMIT) the next start weights w1n, b1n, w2n, b2n or the rows
    with the token appended x1n [B, H, pos + 1, Dk], g1n, x2n [B, H, pos + 1, Dh], g2n
    [B, H, pos + 1, Dv] (all contiguous). BHD >= Dh in blocks of HB hidden units; BR >= pos
    rows."""
    bh = tl.program_id(0).to(tl.int64)
    bb = bh // H
    h = bh % H
    ck = tl.arange(0, BK)
    cv = tl.arange(0, BV)
    rr = tl.arange(0, BR)
    mk = ck < Dk
    mv = cv < Dv
    mr = rr < pos
    qp = q_ptr + bb * sq_b + h * sq_h
    kp = k_ptr + bb * sk_b + h * sk_h
    w1p = w1_ptr + bb * sw1_b + h * sw1_h
    w2p = w2_ptr + bb * sw2_b + h * sw2_h
    b1p = b1_ptr + bb * sb1_b + h * sb1_h
    x1p = x1_ptr + bb * sx1_b + h * sx1_h
    g1p = g1_ptr + bb * sg1_b + h * sg1_h
    x2p = x2_ptr + bb * sx2_b + h * sx2_h
    g2p = g2_ptr + bb * sg2_b + h * sg2_h
    zs = zs_ptr + bh * 2 * Dh
    q = _row(qp, ck, Dk)
    k = _row(kp, ck, Dk)
    eta = tl.load(eta_ptr + bb * se_b + h * se_h).to(tl.float32)
    t_pos = tl.load(tau_ptr + h * st_h + pos).to(tl.float32)
    one1 = 1.0 if HAS_B1 else 0.0
    one2 = 1.0 if HAS_B2 else 0.0
    # the first layer's read coefficients: q . x1_j [+ 1] of the held rows, q . k [+ 1]
    x1 = tl.load(x1p + rr[:, None] * sx1_r + ck[None, :], mask=mr[:, None] & mk[None, :],
                 other=0.0)
    c1 = tl.where(mr, tl.sum(x1 * q[None, :], axis=1) + one1, 0.0)
    c1k = tl.sum(q * k, axis=0) + one1
    if not COMMIT:  # the held rows and the token's, into fresh buffers
        x1n = x1n_ptr + bh * (pos + 1) * Dk
        tl.store(x1n + rr[:, None] * Dk + ck[None, :], x1, mask=mr[:, None] & mk[None, :])
        tl.store(x1n + pos * Dk + ck, k, mask=mk)
    # pass 1 over the hidden blocks: Z1 = [k; q] W1_0 + b1_0 (kept in zs), x2 = gelu(Z1k),
    # Z2 = x2 W2_0 + b2_0
    acc = tl.zeros([HB, BV], dtype=tl.float32)
    for j0 in range(0, BHD, HB):
        cj = j0 + tl.arange(0, HB)
        mj = cj < Dh
        w1 = tl.load(w1p + ck[:, None] * Dh + cj[None, :], mask=mk[:, None] & mj[None, :],
                     other=0.0)
        z1k = tl.sum(k[:, None] * w1, axis=0)
        z1q = tl.sum(q[:, None] * w1, axis=0)
        if HAS_B1:
            b1 = _row(b1p, cj, Dh)
            z1k += b1
            z1q += b1
        tl.store(zs + cj, z1k, mask=mj)
        tl.store(zs + Dh + cj, z1q, mask=mj)
        w2 = tl.load(w2p + cj[:, None] * Dv + cv[None, :], mask=mj[:, None] & mv[None, :],
                     other=0.0)
        acc += _gelu(z1k)[0][:, None] * w2
    b2 = tl.zeros([BV], dtype=tl.float32)
    if HAS_B2:
        b2 = _row(b2_ptr + bb * sb2_b + h * sb2_h, cv, Dv)
    z2k = tl.sum(acc, axis=0) + b2
    tgt = _row(v_ptr + bb * sv_b + h * sv_h, cv, Dv)
    if RESIDUAL:  # Dk == Dv
        tgt -= _row(kp, cv, Dv)
    gam, bet = _ln_affine(lnw_ptr, lnb_ptr, h, Dv, BV, HAS_LN, HAS_LNB)
    g2 = _loss_grad_row(z2k, tgt, gam, bet, mv, Dv, HAS_LN)  # dl/dZ2
    eg2 = eta * g2
    tl.debug_barrier()  # zs written before it is read
    # pass 2: per block G1 = (G2 W2_0^T) * gelu'(Z1k), the query's
    # z1 = Z1q - tau_pos (sum_j c1_j eg1_j + c1k eg1), xq = gelu(z1) through W2_0 and into the
    # second layer's coefficients xq . x2_j; the block's rows
    acc = tl.zeros([HB, BV], dtype=tl.float32)
    c2 = tl.zeros([BR], dtype=tl.float32)
    c2k = tl.zeros([HB], dtype=tl.float32)
    for j0 in range(0, BHD, HB):
        cj = j0 + tl.arange(0, HB)
        mj = cj < Dh
        rm = mr[:, None] & mj[None, :]
        x2k, gp = _gelu(tl.load(zs + cj, mask=mj, other=0.0))
        w2 = tl.load(w2p + cj[:, None] * Dv + cv[None, :], mask=mj[:, None] & mv[None, :],
                     other=0.0)
        eg1 = eta * tl.sum(w2 * g2[None, :], axis=1) * gp
        eg1r = tl.load(g1p + rr[:, None] * sg1_r + cj[None, :], mask=rm, other=0.0)
        z1 = tl.load(zs + Dh + cj, mask=mj, other=0.0) - t_pos * (
            tl.sum(c1[:, None] * eg1r, axis=0) + c1k * eg1)
        xq = _gelu(z1)[0]
        acc += xq[:, None] * w2
        x2r = tl.load(x2p + rr[:, None] * sx2_r + cj[None, :], mask=rm, other=0.0)
        c2 += tl.sum(x2r * xq[None, :], axis=1)
        c2k += xq * x2k
        if not COMMIT:  # the block's rows and the token's, into fresh buffers
            g1n = g1n_ptr + bh * (pos + 1) * Dh
            x2n = x2n_ptr + bh * (pos + 1) * Dh
            tl.store(g1n + rr[:, None] * Dh + cj[None, :], eg1r, mask=rm)
            tl.store(g1n + pos * Dh + cj, eg1, mask=mj)
            tl.store(x2n + rr[:, None] * Dh + cj[None, :], x2r, mask=rm)
            tl.store(x2n + pos * Dh + cj, x2k, mask=mj)
    # z2 = xq W2_0 + b2_0 - tau_pos (sum_j (xq . x2_j [+ 1]) eg2_j + (xq . x2k [+ 1]) eg2)
    eg2r = tl.load(g2p + rr[:, None] * sg2_r + cv[None, :], mask=mr[:, None] & mv[None, :],
                   other=0.0)
    c2 = tl.where(mr, c2 + one2, 0.0)
    z2 = tl.sum(acc, axis=0) + b2 - t_pos * (tl.sum(c2[:, None] * eg2r, axis=0)
                                              + (tl.sum(c2k, axis=0) + one2) * eg2)
    _store_out(o_ptr + bh * Dv, z2, qp, gam, bet, cv, Dv, HAS_LN, RESIDUAL)
    if COMMIT:
        # pass 3: W1_0 - tau_b (sum_j x1_j^T eg1_j + k^T eg1), W2_0 - tau_b (sum_j x2_j^T eg2_j
        # + x2k^T eg2) and the biases' sums, block by block (tau_b = tau_pos); eg1 formed again
        # as in pass 2 (a pass of its own, so that pass 2 holds no update tiles)
        for j0 in range(0, BHD, HB):
            cj = j0 + tl.arange(0, HB)
            mj = cj < Dh
            x2k, gp = _gelu(tl.load(zs + cj, mask=mj, other=0.0))
            m2 = mj[:, None] & mv[None, :]
            w2 = tl.load(w2p + cj[:, None] * Dv + cv[None, :], mask=m2, other=0.0)
            eg1 = eta * tl.sum(w2 * g2[None, :], axis=1) * gp
            u1 = k[:, None] * eg1[None, :]
            u2 = x2k[:, None] * eg2[None, :]
            s1 = eg1
            for j in range(0, pos):
                g1j = _row(g1p + j * sg1_r, cj, Dh)
                u1 += _row(x1p + j * sx1_r, ck, Dk)[:, None] * g1j[None, :]
                u2 += _row(x2p + j * sx2_r, cj, Dh)[:, None] * _row(g2p + j * sg2_r, cv,
                                                                    Dv)[None, :]
                s1 += g1j
            tl.store(w2n_ptr + bh * Dh * Dv + cj[:, None] * Dv + cv[None, :], w2 - t_pos * u2,
                     mask=m2)
            m1 = mk[:, None] & mj[None, :]
            w1 = tl.load(w1p + ck[:, None] * Dh + cj[None, :], mask=m1, other=0.0)
            tl.store(w1n_ptr + bh * Dk * Dh + ck[:, None] * Dh + cj[None, :], w1 - t_pos * u1,
                     mask=m1)
            if HAS_B1:
                tl.store(b1n_ptr + bh * Dh + cj, _row(b1p, cj, Dh) - t_pos * s1, mask=mj)
        if HAS_B2:
            tl.store(b2n_ptr + bh * Dv + cv, b2 - t_pos * (tl.sum(eg2r, axis=0) + eg2), mask=mv)
    else:
        g2n = g2n_ptr + bh * (pos + 1) * Dv
        tl.store(g2n + rr[:, None] * Dv + cv[None, :], eg2r, mask=mr[:, None] & mv[None, :])
        tl.store(g2n + pos * Dv + cv, eg2, mask=mv)


def _rows_major(x: torch.Tensor) -> torch.Tensor:
    """x with its last dim contiguous (a copy only where it is not)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _matrices(x: torch.Tensor) -> torch.Tensor:
    """Weights [B, H, R, C] with every matrix's rows contiguous (a copy only where not)."""
    return x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous()


def _strides(x: torch.Tensor, *dims: int) -> list[int]:
    return [x.stride(d) for d in dims]


class _Launch(NamedTuple):
    """What both kernels read of a step besides the weights and rows: the tensors (q, k, v,
    eta, tau, LayerNorm gain and bias, stand-ins where absent), their strides, the place, and
    whether the token commits."""

    tensors: list[torch.Tensor]
    strides: list[int]
    pos: int
    commit: bool


def _launch_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor,
                   carry: Any, ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None,
                   tau: torch.Tensor) -> _Launch:
    pos = carry.pos
    if not isinstance(pos, int):
        raise ValueError("the TTT decoding kernels take a state at one int place (recurrent.py "
                         "runs the others)")
    q, k, v, tau = (_rows_major(x) for x in (q, k, v, tau))
    ln_w = tau if ln_weight is None else ln_weight.contiguous()
    ln_b = tau if ln_bias is None else ln_bias.contiguous()
    strides = [*_strides(q, 0, 2), *_strides(k, 0, 2), *_strides(v, 0, 2),
               *_strides(eta, 0, 2), tau.stride(0) if tau.dim() == 2 else 0]
    return _Launch([q, k, v, eta, tau, ln_w, ln_b], strides, pos, pos + 1 == tau.shape[-1])


def _held_rows(rows: tuple[torch.Tensor, ...], pos: int, stand_in: torch.Tensor
               ) -> tuple[list[torch.Tensor], list[int]]:
    """The carry's rows (last dim contiguous) and their (batch, head, row) strides; with no
    rows held, stand-ins that are not read."""
    if not pos:
        return [stand_in] * len(rows), [0] * (3 * len(rows))
    rows = [_rows_major(x) for x in rows]
    return rows, [s for x in rows for s in _strides(x, 0, 1, 2)]


def _bias(x: torch.Tensor | None, stand_in: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """A bias [B, H, D] (last dim contiguous) and its strides, or a stand-in."""
    if x is None:
        return stand_in, [0, 0]
    x = _rows_major(x)
    return x, _strides(x, 0, 1)


def ttt_linear_decode_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, carry: Any,
    ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None, residual: bool,
    tau: torch.Tensor,
) -> tuple[torch.Tensor, tuple[Any, Any] | None, tuple[Any, Any] | None]:
    """One TTT-Linear decoding step in ``_linear_decode_kernel``: ``recurrent.linear_token``'s
    result for a state (``common.TTTState``) at an int place. q, k
    [B, 1, H, Dk], v [B, 1, H, Dv], eta [B, 1, H] in their own dtype (read as they are), tau
    [b] or [H, b]; the carry's weights and rows float32. Returns (o [B, 1, H, Dv] in q's dtype,
    committed, rows): on the token that completes the mini-batch ``committed`` is the new start
    weights (W [B, H, Dk, Dv], bias [B, H, Dv] or None) and ``rows`` None, otherwise
    ``committed`` is None and ``rows`` the mini-batch's rows with the token appended
    (X [B, H, pos + 1, Dk], EG [B, H, pos + 1, Dv]); fresh tensors, the given carry is not
    written. inner_loop.py builds the next state from them."""
    B, _, H, Dk = q.shape
    Dv = v.shape[-1]
    inputs = _launch_inputs(q, k, v, eta, carry, ln_weight, ln_bias, tau)
    pos, commit = inputs.pos, inputs.commit
    W0, b0 = carry.start
    W0 = _matrices(W0)
    tiles = tile_config(_arch(q.device), torch.bfloat16, OPS[0], max(Dk, Dv))
    f32 = {"dtype": torch.float32, "device": q.device}
    o = torch.empty(B, 1, H, Dv, dtype=q.dtype, device=q.device)
    if commit:
        Wn, bn = torch.empty(B, H, Dk, Dv, **f32), torch.empty(B, H, Dv, **f32)
        Xn = EGn = o  # stand-ins: not written
    else:
        Xn, EGn = torch.empty(B, H, pos + 1, Dk, **f32), torch.empty(B, H, pos + 1, Dv, **f32)
        Wn = bn = o
    rows, row_strides = _held_rows(carry.rows, pos, W0)
    bias, bias_strides = _bias(b0, W0)
    _linear_decode_kernel[(B * H,)](
        *inputs.tensors, W0, bias, *rows, o, Xn, EGn, Wn, bn,
        H, Dk, Dv, pos, *inputs.strides, *_strides(W0, 0, 1), *bias_strides, *row_strides,
        HAS_BIAS=b0 is not None, HAS_LN=ln_weight is not None, HAS_LNB=ln_bias is not None,
        RESIDUAL=residual, COMMIT=commit, BK=_pow2(Dk), BV=_pow2(Dv),
        KC=min(_pow2(Dk), tiles.KC), RB=tiles.RB, num_warps=tiles.warps, num_stages=1)
    if commit:
        return o, (Wn, None if b0 is None else bn), None
    return o, None, (Xn, EGn)


def ttt_mlp_decode_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, carry: Any,
    ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None, residual: bool,
    tau: torch.Tensor,
) -> tuple[torch.Tensor, tuple[Any, ...] | None, tuple[Any, ...] | None]:
    """One TTT-MLP decoding step in ``_mlp_decode_kernel``: ``recurrent.mlp_token``'s result,
    arguments and result as ``ttt_linear_decode_triton``'s with the MLP's weights and rows:
    committed (W1 [B, H, Dk, Dh], b1 [B, H, Dh] or None, W2 [B, H, Dh, Dv], b2 [B, H, Dv] or
    None), rows (X1 [B, H, pos + 1, Dk], EG1, X2 [B, H, pos + 1, Dh], EG2 [B, H, pos + 1, Dv])."""
    B, _, H, Dk = q.shape
    Dv = v.shape[-1]
    inputs = _launch_inputs(q, k, v, eta, carry, ln_weight, ln_bias, tau)
    pos, commit = inputs.pos, inputs.commit
    W1, b1, W2, b2 = carry.start
    W1, W2 = _matrices(W1), _matrices(W2)
    Dh = W1.shape[-1]
    tiles = tile_config(_arch(q.device), torch.bfloat16, OPS[1], max(Dk, Dv))
    f32 = {"dtype": torch.float32, "device": q.device}
    o = torch.empty(B, 1, H, Dv, dtype=q.dtype, device=q.device)
    zs = torch.empty(B * H, 2, Dh, **f32)
    if commit:
        new = [torch.empty(B, H, Dk, Dh, **f32), torch.empty(B, H, Dh, **f32),
               torch.empty(B, H, Dh, Dv, **f32), torch.empty(B, H, Dv, **f32)]
        outs = [o] * 4 + new  # stand-ins for the rows: not written
    else:
        new = [torch.empty(B, H, pos + 1, D, **f32) for D in (Dk, Dh, Dh, Dv)]
        outs = new + [o] * 4
    rows, row_strides = _held_rows(carry.rows, pos, W1)
    (b1, s1), (b2, s2) = _bias(b1, W1), _bias(b2, W1)
    _mlp_decode_kernel[(B * H,)](
        *inputs.tensors, W1, b1, W2, b2, *rows, o, zs, *outs,
        H, Dk, Dv, Dh, pos, *inputs.strides, *_strides(W1, 0, 1), *s1, *_strides(W2, 0, 1),
        *s2, *row_strides,
        HAS_B1=carry.start[1] is not None, HAS_B2=carry.start[3] is not None,
        HAS_LN=ln_weight is not None, HAS_LNB=ln_bias is not None, RESIDUAL=residual,
        COMMIT=commit, BK=_pow2(Dk), BV=_pow2(Dv), BHD=_pow2(Dh), BR=_pow2(tau.shape[-1]),
        HB=tiles.HB, num_warps=tiles.warps, num_stages=1)
    if commit:
        return o, tuple(None if carry.start[i] is None else x for i, x in enumerate(new)), None
    return o, None, tuple(new)
