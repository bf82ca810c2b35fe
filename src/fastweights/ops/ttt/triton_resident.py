"""TTT-Linear's forward with the inner weights resident on chip for the whole sequence and
half-precision products (docs/gpu_ttt_kernels.md, "Weights resident, half-precision
products"; the precision rule: docs/design.md, "Precision"): the outputs and state of
ops/ttt/triton.py's ``_linear_fwd_kernel``, whose legend, layout and arguments it shares.

One program per (batch, head) holds W^T [BV, BK] and the bias [BV] in float32 registers across
the whole sequence (the master state). Each mini-batch casts W^T to the inputs' dtype (bfloat16
or float16) once and takes it as the left operand of its products, accumulating in float32:
    Zk^T = W^T K^T + b,  Zq^T = W^T Q^T + b       (one product each over the full key dim)
    G = dl/dZk (the LayerNorm gradient, fused),  Zbar^T = Zq^T - G^T (E * A)^T
    o = [LN](Zbar) [+ q],  W^T <- W^T - tau_b (eta G)^T K   (W^T the product's accumulator)
Every product's operands are in the inputs' dtype (W^T, G^T, (eta G)^T and the scores cast;
keys and queries as they are loaded); sums, LayerNorm statistics and the state stay float32.
On sm_90 the products are wgmma with the left operand in registers and W^T in the
accumulator's layout, so no product stages W^T through shared memory: only the [D, b] tiles of
keys and queries go there. Float32 inputs multiply in float32 (the interpreter's exactness
check); the dispatcher never sends them here.

Under Triton's CPU interpreter, whose bfloat16 cast truncates and whose bfloat16 ``tl.dot`` is
wrong (ops/_triton_common.py ``_upcast_tiles``), a bfloat16 operand is rounded to the nearest
even bfloat16 by its bits and kept in float32 (``EMU``): the interpreter then multiplies the
same operand values the tensor cores do, in another summation order.

The backward (ops/ttt/triton.py's three kernels per checkpoint segment) has resident versions
of its two sequential kernels, with the same arguments, rows and results:
``_linear_bwd_a_res_kernel`` (the segment's forward again with W^T resident, as above, and the
read-out's backward) and ``_linear_bwd_b_res_kernel`` (the carried gradient of the weights
resident); the parallel ``_linear_bwd_c_kernel`` reads what they store.

Opt-in: ``FASTWEIGHTS_TTT_FWD=resident`` (ops/ttt/triton_regs.py ``fwd_variant``) and
``FASTWEIGHTS_TTT_BWD=resident`` (both backward kernels; sm_90 and newer) until a GPU record
shows them exact (docs/gpu_ttt_kernels.md says why).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._triton_common import _arch, _upcast_tiles
from .triton_tiles import (
    _back_b_end,
    _back_b_start,
    _cols,
    _dot,
    _head,
    _keys_back,
    _ln,
    _ln_affine,
    _load_tile,
    _loss_grad,
    _mb,
    _readout_back,
    _store_cols,
    _store_tile,
    _store_vec,
    _store_wrows,
    _vec,
    _wrows,
)

__all__ = ["BWD_ENV", "VARIANT", "ResidentConfig", "bwd_variant", "launch_backward_a",
           "launch_backward_b", "launch_forward", "resident_config"]

VARIANT = "resident"  # FASTWEIGHTS_TTT_FWD's (and FASTWEIGHTS_TTT_BWD's) value that selects it
BWD_ENV = "FASTWEIGHTS_TTT_BWD"
BWD_VARIANTS = ("stream", VARIANT)
# The resident backward kernels compile without spills on sm_90 (Triton 3.6, 3.8, 3.9); on
# sm_80 (mma.sync operands held per warp) the sequential pass spills at head size 128: both
# are refused there.
BWD_MIN_ARCH = 90


def bwd_variant() -> str:
    """The backward a TTT-Linear call runs: ``FASTWEIGHTS_TTT_BWD`` (read at every call)
    "resident" (``_linear_bwd_a_res_kernel`` and ``_linear_bwd_b_res_kernel``) or "stream"
    (ops/ttt/triton.py's ``_linear_bwd_a_kernel`` and ``_linear_bwd_b_kernel``, also when
    unset or empty); any other value is a ValueError."""
    env = os.environ.get(BWD_ENV, "")
    if env and env not in BWD_VARIANTS:
        raise ValueError(f"{BWD_ENV} must be one of {BWD_VARIANTS} or unset, got {env!r}")
    return env or "stream"


class ResidentConfig(NamedTuple):
    """Warps and software-pipelining stages of ``_linear_fwd_res_kernel``."""

    warps: int
    stages: int = 1


def resident_config(arch: int, dtype: torch.dtype, D: int) -> ResidentConfig | None:
    """The launch of ``_linear_fwd_res_kernel`` for head size D = max(Dk, Dv) <= 128 on compute
    capability ``arch`` with ``dtype`` inputs: one warp group (4 warps) per 64 value rows, the
    rows of a wgmma (tests/ops/test_ttt_resident.py compiles these for sm_80 and sm_90 and
    checks them for spills); None for float32 inputs (the dispatcher leaves them to PyTorch)
    and head sizes above 128."""
    if dtype not in (torch.float16, torch.bfloat16) or D > 128 or arch < 80:
        return None
    return ResidentConfig(warps=8 if D > 64 else 4)


@triton.jit
def _op(x, DT: tl.constexpr, EMU: tl.constexpr):
    """The float32 tile x as a product operand of dtype DT: cast; under the interpreter with
    bfloat16 (EMU) the value of that cast (round to nearest even, by its bits) in float32."""
    if EMU:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        return u.to(tl.float32, bitcast=True)
    else:
        return x.to(DT)


@triton.jit
def _cols_op(ptr, base, t, m, H, D, BD: tl.constexpr, EMU: tl.constexpr, c0=0):
    """Tokens t (mask m) of a [B, T, H, D] tensor at ``base`` (the (batch, head)'s token 0 plus
    c0), features c0..c0+BD, as the columns of a [BD, BB] tile in its own dtype, the operand of
    a product (upcast, exactly, under EMU)."""
    c = tl.arange(0, BD)
    x = tl.load(ptr + base + c[:, None] + (t * H * D)[None, :],
                mask=(c0 + c < D)[:, None] & m[None, :], other=0.0)
    if EMU:
        x = x.to(tl.float32)
    return x


@triton.jit
def _res_inputs(n, q_ptr, k_ptr, v_ptr, eta_ptr, a_ptr, bh, base_k, base_v, ebase, T, H,
                Dk, Dv, b, N, RESIDUAL: tl.constexpr, EMU: tl.constexpr, BB: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, QROWS: tl.constexpr):
    """Everything mini-batch n reads from global memory, its loads issued together (one round
    trip; the loop issues them a mini-batch ahead): K^T and Q^T [BK, BB] in the inputs' dtype
    (the products' operands); V^T and, with the residual, K^T and (QROWS, the forward's
    output) Q^T again as [BV, BB] value rows, in the inputs' dtype; eta [BB]; A^T [BB, BB].
    Past the last mini-batch (n = N) every load is masked off."""
    _, t, m = _mb(n, b, T, BB)
    kt = _cols_op(k_ptr, base_k, t, m, H, Dk, BK, EMU)
    qt = _cols_op(q_ptr, base_k, t, m, H, Dk, BK, EMU)
    vt = _cols_op(v_ptr, base_v, t, m, H, Dv, BV, EMU)
    kr = vt
    qr = vt
    if RESIDUAL:  # Dk == Dv: the keys and queries as value rows (target v - k, output q + ...)
        kr = _cols_op(k_ptr, base_v, t, m, H, Dv, BV, EMU)
        if QROWS:
            qr = _cols_op(q_ptr, base_v, t, m, H, Dv, BV, EMU)
    eta = tl.load(eta_ptr + ebase + t * H, mask=m, other=0.0).to(tl.float32)
    r = tl.arange(0, BB)
    At = tl.load(a_ptr + ((bh * N + n) * BB + r[:, None]) * BB + r[None, :],
                 mask=tl.zeros([BB, BB], dtype=tl.int32) + n < N, other=0.0)
    return kt, qt, vt, kr, qr, eta, At


@triton.jit
def _res_forward(w, bv, inp, tau, gam, bet, cm, Dv, HAS_LN: tl.constexpr,
                 RESIDUAL: tl.constexpr, EMU: tl.constexpr, PREC: tl.constexpr,
                 BB: tl.constexpr, BV: tl.constexpr):
    """A mini-batch's forward from W^T [BV, BK] and the bias bv [BV] (float32) and its inputs
    ``inp`` (``_res_inputs``): (G^T, the keys' LayerNorm x_hat, 1/s and g (``_loss_grad``),
    Zbar^T [BV, BB], Et [BB, BB]), every product's operands in the inputs' dtype."""
    kt, qt, vt, kr, _, eta, At = inp
    DT: tl.constexpr = kt.dtype
    i = tl.arange(0, BB)
    Et = tl.where(i[:, None] <= i[None, :], eta[:, None] * tau[None, :], 0.0)
    zb = tl.zeros([BV, BB], dtype=tl.float32) + bv[:, None]
    wd = _op(w, DT, EMU)  # this mini-batch's operand copy of the weights
    zk = _dot(wd, kt, PREC, zb)
    zq = _dot(wd, qt, PREC, zb)
    tgt = vt.to(tl.float32)
    if RESIDUAL:
        tgt -= kr.to(tl.float32)
    G, xh, r, g = _loss_grad(zk, tgt, gam, bet, cm, Dv, HAS_LN)
    zbar = zq - _dot(_op(G, DT, EMU), _op(Et * At, DT, EMU), PREC)
    return G, xh, r, g, zbar, Et


@triton.jit
def _res_readout(w, bv, inp, n, o_ptr, tau, gam, bet, cm, base_v, T, H, Dv, b,
                 HAS_LN: tl.constexpr, RESIDUAL: tl.constexpr, EMU: tl.constexpr,
                 PREC: tl.constexpr, BB: tl.constexpr, BV: tl.constexpr):
    """Mini-batch n's read-out (``_res_forward``); o stored. Returns (eta G)^T [BV, BB] in
    float32, what the update needs with K^T."""
    G, _, _, _, zbar, _ = _res_forward(w, bv, inp, tau, gam, bet, cm, Dv, HAS_LN, RESIDUAL,
                                       EMU, PREC, BB, BV)
    _, t, m = _mb(n, b, T, BB)
    out = zbar
    if HAS_LN:
        xo, _ = _ln(zbar, cm, Dv)
        out = gam[:, None] * xo + bet[:, None]
    if RESIDUAL:
        out += inp[4].to(tl.float32)
    _store_cols(o_ptr, out, base_v, t, m, H, Dv, BV)
    return G * inp[5][None, :]


@triton.jit
def _res_update(w, bv, hm, kt, tau_b, HAS_BIAS: tl.constexpr, EMU: tl.constexpr,
                PREC: tl.constexpr):
    """The update of W^T and the bias by (eta G)^T = hm [BV, BB] and K^T (kt):
    W^T <- W^T - tau_b (eta G)^T K (W^T the product's accumulator), b <- b - tau_b sum eta G."""
    hm *= -tau_b
    w = _dot(_op(hm, kt.dtype, EMU), tl.trans(kt), PREC, w)
    if HAS_BIAS:
        bv += tl.sum(hm, axis=1)
    return w, bv


@triton.jit
def _linear_fwd_res_kernel(
    q_ptr, k_ptr, v_ptr, eta_ptr, tau_ptr, a_ptr, lnw_ptr, lnb_ptr, b0_ptr,
    o_ptr, w_ptr, bias_ptr, sw_ptr, sb_ptr, ckw_ptr, ckb_ptr,
    T, H, b, N, NF, seg, store_ck,
    HAS_BIAS: tl.constexpr, HAS_LN: tl.constexpr, HAS_LNB: tl.constexpr,
    RESIDUAL: tl.constexpr, EMU: tl.constexpr, PREC: tl.constexpr,
    Dk: tl.constexpr, Dv: tl.constexpr,
    BB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, STAGES: tl.constexpr,
):
    """TTT-Linear forward for one (batch, head) over N mini-batches, NF of them full, W^T and
    the bias resident in registers; arguments and results those of ops/ttt/triton.py's
    ``_linear_fwd_kernel`` (w [B*H, Dk, Dv] the start weights, overwritten with the weights
    after the last full mini-batch; bias likewise from b0; sw, sb the sums of a last partial
    mini-batch; ckw, ckb the weights entering every ``seg``-th one if ``store_ck``), but for
    the head sizes Dk, Dv, compile-time constants here. Each mini-batch's inputs are loaded
    while the previous one computes. EMU: bfloat16 operands emulated in float32 (the
    interpreter); STAGES: Triton's software pipelining of the loop (1: none)."""
    bh = tl.program_id(0).to(tl.int64)
    h, base_k, base_v, ebase = _head(bh, H, T, Dk, Dv)
    NC = tl.cdiv(NF, seg)
    cm = tl.arange(0, BV) < Dv
    w = _wrows(w_ptr + bh * Dk * Dv, 0, Dk, Dv, BV, BK)  # W^T [BV, BK]
    bv = tl.zeros([BV], dtype=tl.float32)
    if HAS_BIAS:
        bv = _vec(b0_ptr + bh * Dv, Dv, BV)
    gam, bet = _ln_affine(lnw_ptr, lnb_ptr, h, Dv, BV, HAS_LN, HAS_LNB)
    i = tl.arange(0, BB)
    tau = tl.load(tau_ptr + h * b + i, mask=i < b, other=0.0).to(tl.float32)
    tau_b = tl.load(tau_ptr + h * b + b - 1).to(tl.float32)
    inp = _res_inputs(0, q_ptr, k_ptr, v_ptr, eta_ptr, a_ptr, bh, base_k, base_v, ebase, T, H,
                      Dk, Dv, b, N, RESIDUAL, EMU, BB, BK, BV, RESIDUAL)
    for n in tl.range(0, NF, num_stages=STAGES, disable_licm=True):
        nxt = _res_inputs(n + 1, q_ptr, k_ptr, v_ptr, eta_ptr, a_ptr, bh, base_k, base_v,
                          ebase, T, H, Dk, Dv, b, N, RESIDUAL, EMU, BB, BK, BV, RESIDUAL)
        if store_ck and n % seg == 0:
            c = bh * NC + n // seg
            _store_wrows(ckw_ptr + c * Dk * Dv, w, 0, Dk, Dv, BV, BK)
            if HAS_BIAS:
                _store_vec(ckb_ptr + c * Dv, bv, Dv, BV)
        hm = _res_readout(w, bv, inp, n, o_ptr, tau, gam, bet, cm, base_v, T, H, Dv, b,
                          HAS_LN, RESIDUAL, EMU, PREC, BB, BV)
        w, bv = _res_update(w, bv, hm, inp[0], tau_b, HAS_BIAS, EMU, PREC)
        inp = nxt
    _store_wrows(w_ptr + bh * Dk * Dv, w, 0, Dk, Dv, BV, BK)
    if HAS_BIAS:
        _store_vec(bias_ptr + bh * Dv, bv, Dv, BV)
    if NF < N:  # a last, partly filled mini-batch: its sums S = K^T (eta G), s, not an update
        hm = _res_readout(w, bv, inp, NF, o_ptr, tau, gam, bet, cm, base_v, T, H, Dv, b,
                          HAS_LN, RESIDUAL, EMU, PREC, BB, BV)
        S = _dot(_op(hm, inp[0].dtype, EMU), tl.trans(inp[0]), PREC)
        _store_wrows(sw_ptr + bh * Dk * Dv, S, 0, Dk, Dv, BV, BK)
        if HAS_BIAS:
            _store_vec(sb_ptr + bh * Dv, tl.sum(hm, axis=1), Dv, BV)


@triton.jit
def _res_scores_grad(rows, DT: tl.constexpr, EMU: tl.constexpr, PREC: tl.constexpr,
                     BB: tl.constexpr, BV: tl.constexpr, DC: tl.constexpr):
    """dM^T = -(dZbar G^T)^T [BB, BB] from a mini-batch's rows (G^T, dZbar^T [BV, BB], just
    stored), contracted over the value dim in blocks of DC rows read back, operands in the
    inputs' dtype DT. Held in registers, G^T and dZbar^T would be whole operands of one
    product with BB rows, which every warp replicates (its operands are 64 registers per
    thread at BV 128): with W^T resident that spills. The loop is kept rolled for the same
    reason."""
    tl.debug_barrier()  # the rows stored by every thread
    dMt = tl.zeros([BB, BB], dtype=tl.float32)
    c = tl.arange(0, BB)
    rc = tl.arange(0, DC)
    for d0 in tl.range(0, BV, DC, loop_unroll_factor=1):
        offc = (d0 + rc)[:, None] * BB + c[None, :]
        gc = _op(tl.load(rows + offc), DT, EMU)
        dc = _op(tl.load(rows + BV * BB + offc), DT, EMU)
        dMt -= _dot(tl.trans(gc), dc, PREC)
    return dMt


@triton.jit
def _linear_bwd_a_res_kernel(
    q_ptr, k_ptr, v_ptr, eta_ptr, tau_ptr, a_ptr, lnw_ptr, lnb_ptr, w_ptr, bias_ptr,
    wn_ptr, scb_ptr, gs_ptr, rows_ptr, rr_ptr, at_ptr, do_ptr, acc_ptr, dtau_ptr,
    T, H, b, N, n0, n1, w_stride, seg,
    HAS_BIAS: tl.constexpr, HAS_LN: tl.constexpr, HAS_LNB: tl.constexpr,
    RESIDUAL: tl.constexpr, EMU: tl.constexpr, PREC: tl.constexpr,
    Dk: tl.constexpr, Dv: tl.constexpr,
    BB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DC: tl.constexpr,
    AHEAD: tl.constexpr,
):
    """ops/ttt/triton.py's ``_linear_bwd_a_kernel`` (the backward's first pass over
    mini-batches n0..n1-1 of one (batch, head): the segment's forward again from the weights
    entering n0, w + bh * w_stride, and the backward of each mini-batch's read-out; the same
    arguments, results and rows, the head sizes Dk, Dv compile-time constants; gs unused)
    with W^T [BV, BK] and the bias resident in float32 registers across the segment, as the
    resident forward holds them, and its products (``_res_forward``, ``_res_update``): each
    mini-batch's start weights stored into wn for ``_linear_bwd_c_kernel``, its rows (G^T,
    dZbar^T, the read-out's share of dG^T, the keys' LayerNorm x_hat and g; 1/s and the
    read-out's share of deta; dA^T) for ``_linear_bwd_b_res_kernel``, the accumulators dgamma,
    dbeta (acc) and dtau added to; the scores' gradient dM = -dZbar G^T from the rows just
    stored (``_res_scores_grad``, in blocks of DC value rows). Each mini-batch's inputs are
    loaded together, after its start weights' store: with AHEAD while the previous mini-batch
    computes (as the forward's), else at its top; dO at its top (the tilings that compile
    without spills, docs/gpu_ttt_kernels.md)."""
    bh = tl.program_id(0).to(tl.int64)
    h, base_k, base_v, ebase = _head(bh, H, T, Dk, Dv)
    cm = tl.arange(0, BV) < Dv
    gam, bet = _ln_affine(lnw_ptr, lnb_ptr, h, Dv, BV, HAS_LN, HAS_LNB)
    i = tl.arange(0, BB)
    tau = tl.load(tau_ptr + h * b + i, mask=i < b, other=0.0).to(tl.float32)
    tau_b = tl.load(tau_ptr + h * b + b - 1).to(tl.float32)
    acc = acc_ptr + bh * 3 * BV
    dgam = _vec(acc + BV, BV, BV)
    dbet = _vec(acc + 2 * BV, BV, BV)
    dtau = _vec(dtau_ptr + bh * BB, BB, BB)
    w = _wrows(w_ptr + bh * w_stride, 0, Dk, Dv, BV, BK)  # W^T [BV, BK]
    bv = tl.zeros([BV], dtype=tl.float32)
    if HAS_BIAS:
        bv = _vec(bias_ptr + bh * (w_stride // Dk), Dv, BV)
    inp = _res_inputs(n0, q_ptr, k_ptr, v_ptr, eta_ptr, a_ptr, bh, base_k, base_v, ebase, T,
                      H, Dk, Dv, b, N, RESIDUAL, EMU, BB, BK, BV, False)
    for n in tl.range(n0, n1, disable_licm=True):
        j = n - n0
        # this mini-batch's start weights, for dQ, dK (fire and forget)
        _store_wrows(wn_ptr + (bh * seg + j) * Dk * Dv, w, 0, Dk, Dv, BV, BK)
        if HAS_BIAS:
            _store_vec(scb_ptr + (bh * seg + j) * Dv, bv, Dv, BV)
        if not AHEAD:
            inp = _res_inputs(n, q_ptr, k_ptr, v_ptr, eta_ptr, a_ptr, bh, base_k, base_v,
                              ebase, T, H, Dk, Dv, b, N, RESIDUAL, EMU, BB, BK, BV, False)
        nxt = inp
        if AHEAD:
            nxt = _res_inputs(n + 1, q_ptr, k_ptr, v_ptr, eta_ptr, a_ptr, bh, base_k, base_v,
                              ebase, T, H, Dk, Dv, b, N, RESIDUAL, EMU, BB, BK, BV, False)
        _, t, m = _mb(n, b, T, BB)
        dO = _cols(do_ptr, base_v, t, m, H, Dv, BV)
        G, xh, r, g, zbar, Et = _res_forward(w, bv, inp, tau, gam, bet, cm, Dv, HAS_LN,
                                             RESIDUAL, EMU, PREC, BB, BV)
        eta = inp[5]
        At = inp[6]
        DT: tl.constexpr = inp[0].dtype
        rows = rows_ptr + (bh * seg + j) * 5 * BV * BB
        rr = rr_ptr + (bh * seg + j) * 2 * BB
        if HAS_LN:
            _store_tile(rows + 3 * BV * BB, xh, BV, BB)
            _store_tile(rows + 4 * BV * BB, g, BV, BB)
            tl.store(rr + i, r)
        # the read-out o = [LN](Zbar) [+ q]
        dzbar, dgam, dbet = _readout_back(dO, zbar, G, rows, gam, cm, dgam, dbet, Dv, HAS_LN,
                                          BB, BV)
        # Zbar's b x b term -(E * A) G: the read-out's share of dG, -dZbar (E * A) as
        # columns, and dM = -dZbar G^T, dA = dM * E, dE = dM * A
        dzo = _op(dzbar, DT, EMU)
        Mo = _op(Et * At, DT, EMU)
        _store_tile(rows + 2 * BV * BB, -_dot(dzo, tl.trans(Mo), PREC), BV, BB)
        dMt = _res_scores_grad(rows, DT, EMU, PREC, BB, BV, DC)
        causal = i[:, None] <= i[None, :]
        _store_tile(at_ptr + (bh * seg + j) * BB * BB, tl.where(causal, dMt * Et, 0.0), BB, BB)
        dEt = tl.where(causal, dMt * At, 0.0)
        dtau += tl.sum(dEt * eta[:, None], axis=0)
        tl.store(rr + BB + i, tl.sum(dEt * tau[None, :], axis=1))
        # the next mini-batch's start weights, as the forward forms them
        w, bv = _res_update(w, bv, G * eta[None, :], inp[0], tau_b, HAS_BIAS, EMU, PREC)
        inp = nxt
    _store_vec(acc + BV, dgam, BV, BV)
    _store_vec(acc + 2 * BV, dbet, BV, BV)
    _store_vec(dtau_ptr + bh * BB, dtau, BB, BB)


@triton.jit
def _linear_bwd_b_res_kernel(
    q_ptr, k_ptr, v_ptr, eta_ptr, tau_ptr, lnw_ptr, lnb_ptr, dn_ptr, rows_ptr, rr_ptr,
    dsw_ptr, dsb_ptr, dw_ptr, acc_ptr, dtau_ptr, dv_ptr, deta_ptr,
    T, H, b, n0, n1, seg,
    TAIL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LN: tl.constexpr, HAS_LNB: tl.constexpr,
    RESIDUAL: tl.constexpr, EMU: tl.constexpr, PREC: tl.constexpr,
    Dk: tl.constexpr, Dv: tl.constexpr,
    BB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    """ops/ttt/triton.py's ``_linear_bwd_b_kernel`` (the backward's sequential pass over
    mini-batches n1-1 down to n0 of one (batch, head); the same arguments, results and rows,
    the head sizes Dk, Dv compile-time constants) with the carried gradient of the weights
    D = dL/dW resident: D^T [BV, BK] in float32 registers across the pass, loaded once from
    dw and stored back once, taken as an operand in the inputs' dtype for K D and accumulating
    Q^T dZbar + K^T dZk (operands in the inputs' dtype) as the resident forward does W; the D
    leaving each mini-batch still goes to dn for ``_linear_bwd_c_kernel``. TAIL: n0 is a last
    partial mini-batch, whose sums' gradient is dS, ds (dsw, dsb)."""
    bh = tl.program_id(0).to(tl.int64)
    base_k, base_v, ebase, cm, gam, bet, tau_b, d, dgam, dbet, dtau_b = _back_b_start(
        bh, lnw_ptr, lnb_ptr, tau_ptr, acc_ptr, T, H, Dk, Dv, b, HAS_LN, HAS_LNB, BB, BV)
    dp = dw_ptr + bh * Dk * Dv
    dt = _wrows(dp, 0, Dk, Dv, BV, BK)  # D^T [BV, BK]
    for nr in tl.range(n0, n1, disable_licm=True):
        n = n1 - 1 + n0 - nr
        j = n - n0
        rows = rows_ptr + (bh * seg + j) * 5 * BV * BB
        rr = rr_ptr + (bh * seg + j) * 2 * BB
        _, t, m = _mb(n, b, T, BB)
        kt = _cols_op(k_ptr, base_k, t, m, H, Dk, BK, EMU)
        qt = _cols_op(q_ptr, base_k, t, m, H, Dk, BK, EMU)
        DT: tl.constexpr = kt.dtype
        eta = tl.load(eta_ptr + ebase + t * H, mask=m, other=0.0).to(tl.float32)
        G = _load_tile(rows, BV, BB)
        # the gradient sums S = K^T (eta G), s = sum eta G: handed on (TAIL, gradient dS, ds)
        # or applied, W' = W - tau_b S (gradient -tau_b D, and tau_b's -<D, S>)
        Hm = G * eta[None, :]
        if TAIL:
            kd = _dot(_op(_wrows(dsw_ptr + bh * Dk * Dv, 0, Dk, Dv, BV, BK), DT, EMU), kt,
                      PREC)
            dHm = kd
            if HAS_BIAS:
                dHm += _vec(dsb_ptr + bh * Dv, Dv, BV)[:, None]
        else:
            kd = _dot(_op(dt, DT, EMU), kt, PREC)
            if HAS_BIAS:
                kd += d[:, None]
            dtau_b -= tl.sum(tl.sum(Hm * kd, axis=1), axis=0)
            dHm = -tau_b * kd
        dzk, dgam, dbet = _keys_back(dHm, G, eta, rows, rr, v_ptr, k_ptr, dv_ptr, deta_ptr,
                                     dgam, dbet, gam, bet, cm, base_v, ebase, t, m, H, Dv,
                                     HAS_LN, RESIDUAL, BB, BV)
        # D <- D + Q^T dZbar + K^T dZk, the D leaving the mini-batch kept in dn for dK
        _store_wrows(dn_ptr + (bh * seg + j) * Dk * Dv, dt, 0, Dk, Dv, BV, BK)
        dzbar = _load_tile(rows + BV * BB, BV, BB)  # loaded late: registers
        dt = _dot(_op(dzk, DT, EMU), tl.trans(kt), PREC,
                  _dot(_op(dzbar, DT, EMU), tl.trans(qt), PREC, dt))
        if HAS_BIAS:
            d += tl.sum(dzbar + dzk, axis=1)
    _store_wrows(dp, dt, 0, Dk, Dv, BV, BK)
    _back_b_end(bh, acc_ptr, dtau_ptr, d, dgam, dbet, dtau_b, b, BB, BV)


def _launch_consts(L, q: torch.Tensor, arch: int) -> tuple[ResidentConfig, dict]:
    """The tiling (a float32 or diagnostic call, the interpreter's checks among them, has the
    half one) and the constexprs both resident kernels take for ops/ttt/triton.py's ``_Shape``
    ``L`` and inputs like q."""
    cfg = resident_config(arch, torch.bfloat16, max(L.Dk, L.Dv))
    emu = _upcast_tiles(q.dtype)
    consts = {n: L.consts[n] for n in ("HAS_BIAS", "HAS_LN", "HAS_LNB", "RESIDUAL", "BB", "BK",
                                       "BV")}
    consts |= {"EMU": emu, "PREC": "ieee" if emu or q.dtype == torch.float32 else "tf32",
               "Dk": L.Dk, "Dv": L.Dv}
    return cfg, consts


def launch_forward(L, store: bool, *args) -> None:
    """Runs ``_linear_fwd_res_kernel`` for ops/ttt/triton.py's ``_LinearTriton`` (``L`` its
    ``_Shape``, ``args`` ``_linear_fwd_kernel``'s pointer and size arguments, ``store``).
    The head sizes are compile-time constants here: every address of a weight tile is then a
    constant offset from one base, which keeps the checkpoint store inside the loop from
    spilling (docs/gpu_ttt_kernels.md)."""
    cfg, consts = _launch_consts(L, args[0], _arch(args[0].device))
    T, H, _, _, b, N, NF, seg = args[16:]
    _linear_fwd_res_kernel[(L.BH,)](*args[:16], T, H, b, N, NF, seg, store, STAGES=cfg.stages,
                                    **consts, num_warps=cfg.warps, num_stages=cfg.stages)


def _resident_backward(q: torch.Tensor) -> int | None:
    """The compute capability a resident backward kernel runs on for inputs like q if
    ``FASTWEIGHTS_TTT_BWD`` is "resident" (a ValueError below sm_90 on a GPU, where the
    kernels spill), None if it is not."""
    if bwd_variant() != VARIANT:
        return None
    arch = _arch(q.device)
    if arch < BWD_MIN_ARCH and not triton.knobs.runtime.interpret:
        raise ValueError(f"{BWD_ENV}={VARIANT} needs sm_{BWD_MIN_ARCH} or newer (on sm_{arch} "
                         "the kernel spills registers); unset it there")
    return arch


def launch_backward_a(L, *args) -> bool:
    """Runs ``_linear_bwd_a_res_kernel`` in place of ops/ttt/triton.py's
    ``_linear_bwd_a_kernel`` (``args`` that kernel's pointer and size arguments) if
    ``FASTWEIGHTS_TTT_BWD`` is "resident"; returns whether it did."""
    arch = _resident_backward(args[0])
    if arch is None:
        return False
    cfg, consts = _launch_consts(L, args[0], arch)
    T, H, _, _, b, N, n0, n1, w_stride, seg = args[19:]
    # the tiling that compiles without spills under Triton 3.6, 3.8 and 3.9
    # (benchmarks/results/aot_ttt_resident/): the inputs a mini-batch ahead above head size 64
    _linear_bwd_a_res_kernel[(L.BH,)](*args[:19], T, H, b, N, n0, n1, w_stride, seg,
                                      DC=min(consts["BV"], 64), AHEAD=consts["BV"] > 64,
                                      **consts, num_warps=cfg.warps, num_stages=1)
    return True


def launch_backward_b(L, tail: bool, *args) -> bool:
    """Runs ``_linear_bwd_b_res_kernel`` in place of ops/ttt/triton.py's
    ``_linear_bwd_b_kernel`` (``args`` that kernel's pointer and size arguments, ``tail`` its
    TAIL) if ``FASTWEIGHTS_TTT_BWD`` is "resident"; returns whether it did."""
    arch = _resident_backward(args[0])
    if arch is None:
        return False
    cfg, consts = _launch_consts(L, args[0], arch)
    T, H, _, _, b, n0, n1, seg = args[17:]
    _linear_bwd_b_res_kernel[(L.BH,)](*args[:17], T, H, b, n0, n1, seg, TAIL=tail, **consts,
                                      num_warps=cfg.warps, num_stages=1)
    return True
