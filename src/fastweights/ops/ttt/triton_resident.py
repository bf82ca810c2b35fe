"""TTT-Linear's forward with the inner weights resident on chip for the whole sequence and
half-precision products (docs/gpu_ttt_kernels.md, "Weights resident, half-precision
products"; the precision rule is docs/design.md's): the outputs and state of
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

Opt-in: ``FASTWEIGHTS_TTT_FWD=resident`` (ops/ttt/triton_regs.py ``fwd_variant``) until a GPU
record shows it exact (docs/gpu_ttt_kernels.md says why).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._triton_common import _arch, _upcast_tiles
from .triton_regs import _w_load, _w_store
from .triton_tiles import (
    _cols,
    _dot,
    _head,
    _linear_in,
    _linear_out,
    _ln_affine,
    _loss_grad,
    _store_vec,
    _vec,
)

__all__ = ["VARIANT", "ResidentConfig", "launch_forward", "resident_config"]

VARIANT = "resident"  # FASTWEIGHTS_TTT_FWD's value that selects this forward


class ResidentConfig(NamedTuple):
    """Warps and software-pipelining stages of ``_linear_fwd_res_kernel``."""

    warps: int
    stages: int = 1
    KC: int = 32  # the key features of a column block of W^T (at most 4 blocks)


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
def _res_block(wc, zk, zq, k_ptr, q_ptr, base_k, t, m, H, Dk, c0, EMU: tl.constexpr,
               PREC: tl.constexpr, KC: tl.constexpr):
    """zk + W^T_c K_c^T, zq + W^T_c Q_c^T for the key features c0..c0+KC (wc = W^T's column
    block [BV, KC], cast here), and K_c^T [KC, BB], the operand."""
    DT: tl.constexpr = k_ptr.dtype.element_ty
    wd = _op(wc, DT, EMU)
    kc = _cols_op(k_ptr, base_k + c0, t, m, H, Dk, KC, EMU, c0)
    zk = _dot(wd, kc, PREC, zk)
    zq = _dot(wd, _cols_op(q_ptr, base_k + c0, t, m, H, Dk, KC, EMU, c0), PREC, zq)
    return zk, zq, kc


@triton.jit
def _res_readout(w0, w1, w2, w3, bv, n, q_ptr, k_ptr, v_ptr, eta_ptr, tau_ptr, a_ptr, o_ptr,
                 gam, bet, cm, bh, h, base_k, base_v, ebase, T, H, Dk, Dv, b, N,
                 HAS_LN: tl.constexpr, RESIDUAL: tl.constexpr, EMU: tl.constexpr,
                 PREC: tl.constexpr, BB: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr,
                 NKC: tl.constexpr):
    """Mini-batch n's read-out from W^T (column blocks w0..w3 [BV, KC], ``_w_load``) and the
    bias bv [BV] (float32; o stored), and what its update needs: (eta G)^T [BV, BB] in
    float32 and the blocks of K^T [KC, BB], the operands (zeros past NKC)."""
    DT: tl.constexpr = k_ptr.dtype.element_ty
    _, t, m, eta, _, Et, At = _linear_in(eta_ptr, tau_ptr, a_ptr, bh, h, ebase, n, T, H, b, N,
                                         BB)
    zk = tl.zeros([BV, BB], dtype=tl.float32) + bv[:, None]
    zq = zk
    k1 = tl.zeros([KC, BB], dtype=DT if not EMU else tl.float32)
    k2 = k1
    k3 = k1
    zk, zq, k0 = _res_block(w0, zk, zq, k_ptr, q_ptr, base_k, t, m, H, Dk, 0, EMU, PREC, KC)
    if NKC > 1:
        zk, zq, k1 = _res_block(w1, zk, zq, k_ptr, q_ptr, base_k, t, m, H, Dk, KC, EMU, PREC,
                                KC)
    if NKC > 2:
        zk, zq, k2 = _res_block(w2, zk, zq, k_ptr, q_ptr, base_k, t, m, H, Dk, 2 * KC, EMU,
                                PREC, KC)
        zk, zq, k3 = _res_block(w3, zk, zq, k_ptr, q_ptr, base_k, t, m, H, Dk, 3 * KC, EMU,
                                PREC, KC)
    tgt = _cols(v_ptr, base_v, t, m, H, Dv, BV)
    if RESIDUAL:  # Dk == Dv
        tgt -= _cols(k_ptr, base_v, t, m, H, Dv, BV)
    G, _, _, _ = _loss_grad(zk, tgt, gam, bet, cm, Dv, HAS_LN)
    zbar = zq - _dot(_op(G, DT, EMU), _op(Et * At, DT, EMU), PREC)
    _linear_out(o_ptr, zbar, q_ptr, gam, bet, cm, base_v, t, m, H, Dv, HAS_LN, RESIDUAL, BV)
    return G * eta[None, :], k0, k1, k2, k3


@triton.jit
def _res_update(w0, w1, w2, w3, hm, k0, k1, k2, k3, EMU: tl.constexpr, PREC: tl.constexpr,
                NKC: tl.constexpr):
    """W^T's blocks + hm K_c (hm [BV, BB] float32, cast here; k_c the blocks of K^T)."""
    DT: tl.constexpr = w0.dtype if EMU else k0.dtype
    hd = _op(hm, DT, EMU)
    w0 = _dot(hd, tl.trans(k0), PREC, w0)
    if NKC > 1:
        w1 = _dot(hd, tl.trans(k1), PREC, w1)
    if NKC > 2:
        w2 = _dot(hd, tl.trans(k2), PREC, w2)
        w3 = _dot(hd, tl.trans(k3), PREC, w3)
    return w0, w1, w2, w3


@triton.jit
def _linear_fwd_res_kernel(
    q_ptr, k_ptr, v_ptr, eta_ptr, tau_ptr, a_ptr, lnw_ptr, lnb_ptr, b0_ptr,
    o_ptr, w_ptr, bias_ptr, sw_ptr, sb_ptr, ckw_ptr, ckb_ptr,
    T, H, b, N, NF, seg, store_ck,
    HAS_BIAS: tl.constexpr, HAS_LN: tl.constexpr, HAS_LNB: tl.constexpr,
    RESIDUAL: tl.constexpr, EMU: tl.constexpr, PREC: tl.constexpr,
    Dk: tl.constexpr, Dv: tl.constexpr,
    BB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr,
    STAGES: tl.constexpr,
):
    """TTT-Linear forward for one (batch, head) over N mini-batches, NF of them full, W^T and
    the bias resident in registers; arguments and results those of ops/ttt/triton.py's
    ``_linear_fwd_kernel`` (w [B*H, Dk, Dv] the start weights, overwritten with the weights
    after the last full mini-batch; bias likewise from b0; sw, sb the sums of a last partial
    mini-batch; ckw, ckb the weights entering every ``seg``-th one if ``store_ck``).
    W^T is held as BK / KC (<= 4) column blocks [BV, KC]: a checkpoint is stored a block at a
    time (one [BV, BK] tile's addresses and layout copy spill at D = 128). EMU: bfloat16
    operands emulated in float32 (the interpreter); STAGES: the software pipelining of the
    loop over mini-batches."""
    NKC: tl.constexpr = BK // KC
    tl.static_assert(NKC == 1 or NKC == 2 or NKC == 4)
    bh = tl.program_id(0).to(tl.int64)
    h, base_k, base_v, ebase = _head(bh, H, T, Dk, Dv)
    NC = tl.cdiv(NF, seg)
    cm = tl.arange(0, BV) < Dv
    w0, w1, w2, w3 = _w_load(w_ptr + bh * Dk * Dv, Dk, Dv, BV, KC, NKC)
    bv = tl.zeros([BV], dtype=tl.float32)
    if HAS_BIAS:
        bv = _vec(b0_ptr + bh * Dv, Dv, BV)
    gam, bet = _ln_affine(lnw_ptr, lnb_ptr, h, Dv, BV, HAS_LN, HAS_LNB)
    tau_b = tl.load(tau_ptr + h * b + b - 1).to(tl.float32)
    for n in tl.range(0, NF, num_stages=STAGES, disable_licm=True):
        if store_ck and n % seg == 0:
            c = bh * NC + n // seg
            _w_store(ckw_ptr + c * Dk * Dv, w0, w1, w2, w3, Dk, Dv, BV, KC, NKC)
            if HAS_BIAS:
                _store_vec(ckb_ptr + c * Dv, bv, Dv, BV)
        hm, k0, k1, k2, k3 = _res_readout(
            w0, w1, w2, w3, bv, n, q_ptr, k_ptr, v_ptr, eta_ptr, tau_ptr, a_ptr, o_ptr, gam,
            bet, cm, bh, h, base_k, base_v, ebase, T, H, Dk, Dv, b, N, HAS_LN, RESIDUAL, EMU,
            PREC, BB, BV, KC, NKC)
        # W^T <- W^T - tau_b (eta G)^T K, b <- b - tau_b sum eta G
        hm *= -tau_b
        w0, w1, w2, w3 = _res_update(w0, w1, w2, w3, hm, k0, k1, k2, k3, EMU, PREC, NKC)
        if HAS_BIAS:
            bv += tl.sum(hm, axis=1)
    _w_store(w_ptr + bh * Dk * Dv, w0, w1, w2, w3, Dk, Dv, BV, KC, NKC)
    if HAS_BIAS:
        _store_vec(bias_ptr + bh * Dv, bv, Dv, BV)
    if NF < N:  # a last, partly filled mini-batch: its sums S = K^T (eta G), s, not an update
        hm, k0, k1, k2, k3 = _res_readout(
            w0, w1, w2, w3, bv, NF, q_ptr, k_ptr, v_ptr, eta_ptr, tau_ptr, a_ptr, o_ptr, gam,
            bet, cm, bh, h, base_k, base_v, ebase, T, H, Dk, Dv, b, N, HAS_LN, RESIDUAL, EMU,
            PREC, BB, BV, KC, NKC)
        z = tl.zeros_like(w0)
        s0, s1, s2, s3 = _res_update(z, z, z, z, hm, k0, k1, k2, k3, EMU, PREC, NKC)
        _w_store(sw_ptr + bh * Dk * Dv, s0, s1, s2, s3, Dk, Dv, BV, KC, NKC)
        if HAS_BIAS:
            _store_vec(sb_ptr + bh * Dv, tl.sum(hm, axis=1), Dv, BV)


def launch_forward(L, store: bool, *args) -> None:
    """Runs ``_linear_fwd_res_kernel`` for ops/ttt/triton.py's ``_LinearTriton`` (``L`` its
    ``_Shape``, ``args`` ``_linear_fwd_kernel``'s pointer and size arguments, ``store``).
    The head sizes are compile-time constants here: with them every address of a weight
    block is a constant offset from one base, which keeps the checkpoint stores inside the
    loop from spilling (docs/gpu_ttt_kernels.md)."""
    q = args[0]
    # a float32 or diagnostic call (the interpreter's checks) has the half tiling
    cfg = resident_config(_arch(q.device), torch.bfloat16, max(L.Dk, L.Dv))
    emu = _upcast_tiles(q.dtype)
    T, H, Dk, Dv, b, N, NF, seg = args[16:]
    consts = {n: L.consts[n] for n in ("HAS_BIAS", "HAS_LN", "HAS_LNB", "RESIDUAL", "BB", "BK",
                                       "BV")}
    prec = "ieee" if emu or q.dtype == torch.float32 else "tf32"
    _linear_fwd_res_kernel[(L.BH,)](
        *args[:16], T, H, b, N, NF, seg, store, EMU=emu, PREC=prec, Dk=Dk, Dv=Dv,
        KC=min(L.consts["BK"], cfg.KC), STAGES=cfg.stages, **consts, num_warps=cfg.warps,
        num_stages=cfg.stages)
