"""A Triton kernel for the TTT-Linear one-token decoding step (ops/ttt/decode.py's
``_linear_step`` for an int place, no prior sums): the whole step in one launch.

Dimension legend: B batch, H heads, Dk key/query dim, Dv value dim, b mini-batch size, p the
token's place in its mini-batch (the rows of the current mini-batch held before it); BK, BV the
key and value tiles (powers of two >= Dk, Dv, at least 16), KC the rows of a weight block, RB
the rows of a block of the mini-batch's rows.

One program per (batch, head): the inner LayerNorm needs all Dv columns of the key's Z = k W_0
+ b_0 (its mean and variance), so the value columns cannot go to separate programs (as for the
dual form's kernels, ops/ttt/triton.py). Per program, with x_j, eg_j the p rows of the current
mini-batch (its inputs and eta-scaled output gradients, ``DecodeCarry.rows``), all at the start
weights W_0, b_0 (docs/maths.md 2.4's dual form, one row at a time):
    zk = k W_0 + b_0, zq = q W_0 + b_0      (one pass over W_0, in blocks of KC rows)
    eg = eta dl/dzk                          (the LayerNorm gradient, fused; target v [- k])
    zbar = zq - tau_p (sum_j (q . x_j [+ 1]) eg_j + (q . k [+ 1]) eg)
    o = [LN](zbar) [+ q]
and either the rows with the token appended (x_p = k, eg_p = eg; copied into fresh buffers, so
that a carry a caller keeps is never written), or, when the token completes the mini-batch
(p = b - 1, ``COMMIT``), the next start weights W_0 - tau_b sum_j x_j^T eg_j (and bias
b_0 - tau_b sum_j eg_j), a second pass over W_0.

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
from .triton import _ln_affine

__all__ = ["MAX_D", "MAX_MINI_BATCH", "OPS", "DecodeTiles", "supports", "tile_config",
           "ttt_linear_decode_triton"]

OPS = ("ttt_decode_linear",)  # the ops with kernels here (registered in decode.py)
MAX_D = 128  # Dk and Dv (ops/backend.py TRITON_MAX_DK)
MAX_MINI_BATCH = 64
_EPS = tl.constexpr(LN_EPS)


class DecodeTiles(NamedTuple):
    """Warps of the decoding kernel, KC the rows of a weight block, RB of a row block."""

    warps: int
    KC: int = 32
    RB: int = 16


def tile_config(arch: int, dtype: torch.dtype, op: str, D: int = MAX_D) -> DecodeTiles | None:
    """The launch choice for ``op`` (one of OPS) with head size D = max(Dk, Dv) <= 128 on
    compute capability ``arch`` (the same on sm_80 and sm_90) and ``dtype`` inputs, or None
    where the dispatcher leaves the step to PyTorch. tests/ops/test_ttt_triton_compile.py
    compiles the launches with these for sm_80 and sm_90 without register spills.

    Half inputs: 4 warps up to D = 64, 8 above. Float32 inputs stay on PyTorch, as for the
    dual form's kernels (the dispatch rules are one for the TTT kernels; this kernel's
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
    G = zk - tgt
    gam, bet = _ln_affine(lnw_ptr, lnb_ptr, h, Dv, BV, HAS_LN, HAS_LNB)
    if HAS_LN:
        mu = tl.sum(zk, axis=0) / Dv
        zc = tl.where(mv, zk - mu, 0.0)
        rs = 1.0 / tl.sqrt(tl.sum(zc * zc, axis=0) / Dv + _EPS)
        xh = zc * rs
        g = gam * (gam * xh + bet - tgt)
        G = tl.where(mv, rs * (g - tl.sum(g, axis=0) / Dv - xh * (tl.sum(g * xh, axis=0) / Dv)),
                     0.0)
    eg = eta * G
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
    zbar = zq - t_pos * acc
    out = zbar
    if HAS_LN:
        mo = tl.sum(zbar, axis=0) / Dv
        zo = tl.where(mv, zbar - mo, 0.0)
        out = gam * zo / tl.sqrt(tl.sum(zo * zo, axis=0) / Dv + _EPS) + bet
    if RESIDUAL:
        out += _row(qp, cv, Dv)
    tl.store(o_ptr + bh * Dv + cv, out.to(o_ptr.dtype.element_ty), mask=mv)
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


def _rows_major(x: torch.Tensor) -> torch.Tensor:
    """x with its last dim contiguous (a copy only where it is not)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _strides(x: torch.Tensor, *dims: int) -> list[int]:
    return [x.stride(d) for d in dims]


def ttt_linear_decode_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, carry: Any,
    ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None, residual: bool,
    tau: torch.Tensor,
) -> tuple[torch.Tensor, tuple[Any, Any] | None, tuple[Any, Any] | None]:
    """One TTT-Linear decoding step in ``_linear_decode_kernel``: ``decode._linear_step``'s
    result for a carry (``decode.DecodeCarry``) at an int place without prior sums. q, k
    [B, 1, H, Dk], v [B, 1, H, Dv], eta [B, 1, H] in their own dtype (read as they are), tau
    [b] or [H, b]; the carry's weights and rows float32. Returns (o [B, 1, H, Dv] in q's dtype,
    committed, rows): on the token that completes the mini-batch ``committed`` is the new start
    weights (W [B, H, Dk, Dv], bias [B, H, Dv] or None) and ``rows`` None, otherwise
    ``committed`` is None and ``rows`` the mini-batch's rows with the token appended
    (X [B, H, pos + 1, Dk], EG [B, H, pos + 1, Dv]); fresh tensors, the given carry is not
    written. decode.py builds the next carry from them."""
    B, _, H, Dk = q.shape
    Dv, b, pos = v.shape[-1], tau.shape[-1], carry.pos
    if not isinstance(pos, int) or carry.prior is not None:
        raise ValueError("the TTT decoding kernel takes a carry at one int place without prior "
                         "sums (decode.py runs the others)")
    W0, b0 = carry.start
    X, EG = carry.rows
    q, k, v, W0 = (_rows_major(x) for x in (q, k, v, W0))
    if W0.stride(-2) != Dv:
        W0 = W0.contiguous()
    b0 = None if b0 is None else _rows_major(b0)
    tau = _rows_major(tau)
    commit = pos + 1 == b
    tiles = tile_config(_arch(q.device), torch.bfloat16, OPS[0], max(Dk, Dv))
    f32 = {"dtype": torch.float32, "device": q.device}
    o = torch.empty(B, 1, H, Dv, dtype=q.dtype, device=q.device)
    if commit:
        Wn, bn = torch.empty(B, H, Dk, Dv, **f32), torch.empty(B, H, Dv, **f32)
        Xn = EGn = o  # stand-ins: not written
    else:
        Xn, EGn = torch.empty(B, H, pos + 1, Dk, **f32), torch.empty(B, H, pos + 1, Dv, **f32)
        Wn = bn = o
    if pos:
        X, EG = _rows_major(X), _rows_major(EG)
    else:
        X = EG = W0  # no rows: stand-ins, not read
    bias = W0 if b0 is None else b0
    ln_w = tau if ln_weight is None else ln_weight.contiguous()
    ln_b = tau if ln_bias is None else ln_bias.contiguous()
    _linear_decode_kernel[(B * H,)](
        q, k, v, eta, tau, ln_w, ln_b, W0, bias, X, EG, o, Xn, EGn, Wn, bn,
        H, Dk, Dv, pos,
        *_strides(q, 0, 2), *_strides(k, 0, 2), *_strides(v, 0, 2), *_strides(eta, 0, 2),
        tau.stride(0) if tau.dim() == 2 else 0,
        *_strides(W0, 0, 1), *(_strides(b0, 0, 1) if b0 is not None else (0, 0)),
        *(_strides(X, 0, 1, 2) if pos else (0, 0, 0)),
        *(_strides(EG, 0, 1, 2) if pos else (0, 0, 0)),
        HAS_BIAS=b0 is not None, HAS_LN=ln_weight is not None, HAS_LNB=ln_bias is not None,
        RESIDUAL=residual, COMMIT=commit, BK=_pow2(Dk), BV=_pow2(Dv),
        KC=min(_pow2(Dk), tiles.KC), RB=tiles.RB, num_warps=tiles.warps, num_stages=1)
    if commit:
        return o, (Wn, None if b0 is None else bn), None
    return o, None, (Xn, EGn)
