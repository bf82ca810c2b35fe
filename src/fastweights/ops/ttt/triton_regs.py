"""TTT-Linear's forward with the inner weights held in registers (docs/gpu_ttt_kernels.md,
"The register-resident forward"): the same outputs and state as ops/ttt/triton.py's
``_linear_fwd_kernel`` (whose legend and layout this module shares), chosen by that module's
``_LinearTriton`` where it compiles without register spills (``regs_config``).

One program per (batch, head) holds W^T [BV, BK] and the bias [BV] in float32 registers across
the whole sequence. Per mini-batch: Zk^T = W^T K^T and Zq^T = W^T Q^T as one product each over
the full key dim, the keys' LayerNorm gradient and the read-out as in ``_linear_fwd_kernel``,
and W^T <- W^T - tau_b (eta G)^T K as one product with W^T as its accumulator. Nothing a
mini-batch loads depends on the previous one's results, so the loop may be software-pipelined
(``RegsConfig.stages``).

``FASTWEIGHTS_TTT_FWD`` (read at every call, ``fwd_variant``): "regs" or "stream" forces one
forward kernel (a diagnostic switch, to time both in one process); unset or empty, the
register-resident kernel wherever ``regs_config`` has a tiling, else the streamed one.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._triton_common import _arch
from .triton import (
    MAX_D,
    _blockT,
    _cols,
    _dot,
    _linear_in,
    _linear_out,
    _ln_affine,
    _loss_grad,
    _store_blockT,
    _store_vec,
    _vec,
)

__all__ = ["ENV", "RegsConfig", "fwd_variant", "regs_config"]

ENV = "FASTWEIGHTS_TTT_FWD"
VARIANTS = ("stream", "regs")


class RegsConfig(NamedTuple):
    """Warps and software-pipelining stages of ``_linear_fwd_regs_kernel``."""

    warps: int
    stages: int = 1


def regs_config(arch: int, dtype: torch.dtype, D: int) -> RegsConfig | None:
    """The launch of ``_linear_fwd_regs_kernel`` for head size D = max(Dk, Dv) <= 128 on
    compute capability ``arch`` (80, 90) with ``dtype`` inputs, or None where it does not
    compile without register spills (tests/ops/test_ttt_triton_compile.py compiles these).
    Half inputs only (float32 inputs multiply in exact float32, FMA loops, as the streamed
    kernel's, which the dispatcher leaves to PyTorch)."""
    if dtype not in (torch.float16, torch.bfloat16) or D > MAX_D or arch < 80:
        return None
    return RegsConfig(warps=8 if D > 64 else 4)


def fwd_variant(arch: int, D: int) -> str:
    """The TTT-Linear forward kernel a call runs: ``FASTWEIGHTS_TTT_FWD`` ("regs" or "stream")
    if set, else "regs" where ``regs_config`` has a tiling for half inputs (the tiling the
    host uses for every input dtype, as ops/ttt/triton.py's ``_shape``), else "stream"."""
    env = os.environ.get(ENV, "")
    if env:
        if env not in VARIANTS:
            raise ValueError(f"{ENV} must be one of {VARIANTS} or unset, got {env!r}")
        return env
    return "regs" if regs_config(arch, torch.bfloat16, D) is not None else "stream"


@triton.jit
def _wt_store(ptr, wt, Dk, Dv, BK: tl.constexpr, BV: tl.constexpr):
    """W [Dk, Dv] (row-major, float32) from its transpose wt [BV, BK]."""
    _store_blockT(ptr, wt, 0, 0, Dk, Dv, BK, BV)


@triton.jit
def _regs_minibatch(wt, bv, n, q_ptr, k_ptr, v_ptr, eta_ptr, tau_ptr, a_ptr, o_ptr, gam, bet,
                    cm, bh, h, base_k, base_v, ebase, T, H, Dk, Dv, b, N,
                    HAS_LN: tl.constexpr, RESIDUAL: tl.constexpr, PREC: tl.constexpr,
                    BB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """Mini-batch n's read-out from the weights wt = W^T [BV, BK], bias bv [BV] (o stored) and
    what its update needs: ((eta G)^T [BV, BB], K^T [BK, BB])."""
    _, t, m, eta, _, Et, At = _linear_in(eta_ptr, tau_ptr, a_ptr, bh, h, ebase, n, T, H, b, N,
                                         BB)
    kt = _cols(k_ptr, base_k, t, m, H, Dk, BK)
    qt = _cols(q_ptr, base_k, t, m, H, Dk, BK)
    tgt = _cols(v_ptr, base_v, t, m, H, Dv, BV)
    if RESIDUAL:  # Dk == Dv: K^T is also the keys' [BV, BB]
        tgt -= kt
    z0 = tl.zeros([BV, BB], dtype=tl.float32) + bv[:, None]
    zk = _dot(wt, kt, PREC, z0)
    zq = _dot(wt, qt, PREC, z0)
    G, _, _, _ = _loss_grad(zk, tgt, gam, bet, cm, Dv, HAS_LN)
    zbar = zq - _dot(G, Et * At, PREC)
    _linear_out(o_ptr, zbar, q_ptr, gam, bet, cm, base_v, t, m, H, Dv, HAS_LN, RESIDUAL, BV)
    return G * eta[None, :], kt


@triton.jit
def _linear_fwd_regs_kernel(
    q_ptr, k_ptr, v_ptr, eta_ptr, tau_ptr, a_ptr, lnw_ptr, lnb_ptr, b0_ptr,
    o_ptr, w_ptr, bias_ptr, sw_ptr, sb_ptr, ckw_ptr, ckb_ptr,
    T, H, Dk, Dv, b, N, NF, seg, store_ck,
    HAS_BIAS: tl.constexpr, HAS_LN: tl.constexpr, HAS_LNB: tl.constexpr,
    RESIDUAL: tl.constexpr, PREC: tl.constexpr,
    BB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, STAGES: tl.constexpr,
):
    """TTT-Linear forward for one (batch, head) over N mini-batches, NF of them full, the
    weights in registers; arguments and results those of ops/ttt/triton.py's
    ``_linear_fwd_kernel`` (w [B*H, Dk, Dv] the start weights, overwritten with the weights
    after the last full mini-batch; bias likewise from b0; sw, sb the sums of a last partial
    mini-batch; ckw, ckb the weights entering every ``seg``-th one if ``store_ck``).
    STAGES: the software pipelining of the loop over mini-batches."""
    bh = tl.program_id(0).to(tl.int64)
    bb = bh // H
    h = bh % H
    base_k = (bb * T * H + h) * Dk
    base_v = (bb * T * H + h) * Dv
    ebase = bb * T * H + h
    NC = tl.cdiv(NF, seg)
    cm = tl.arange(0, BV) < Dv
    wt = _blockT(w_ptr + bh * Dk * Dv, 0, 0, Dk, Dv, BK, BV)  # W^T [BV, BK]
    bv = tl.zeros([BV], dtype=tl.float32)
    if HAS_BIAS:
        bv = _vec(b0_ptr + bh * Dv, Dv, BV)
    gam, bet = _ln_affine(lnw_ptr, lnb_ptr, h, Dv, BV, HAS_LN, HAS_LNB)
    tau_b = tl.load(tau_ptr + h * b + b - 1).to(tl.float32)
    for n in tl.range(0, NF, num_stages=STAGES):
        if store_ck and n % seg == 0:
            c = bh * NC + n // seg
            _wt_store(ckw_ptr + c * Dk * Dv, wt, Dk, Dv, BK, BV)
            if HAS_BIAS:
                _store_vec(ckb_ptr + c * Dv, bv, Dv, BV)
        hm, kt = _regs_minibatch(wt, bv, n, q_ptr, k_ptr, v_ptr, eta_ptr, tau_ptr, a_ptr, o_ptr,
                                 gam, bet, cm, bh, h, base_k, base_v, ebase, T, H, Dk, Dv, b, N,
                                 HAS_LN, RESIDUAL, PREC, BB, BK, BV)
        # W^T <- W^T - tau_b (eta G)^T K, b <- b - tau_b sum eta G
        hm *= -tau_b
        wt = _dot(hm, tl.trans(kt), PREC, wt)
        if HAS_BIAS:
            bv += tl.sum(hm, axis=1)
    _wt_store(w_ptr + bh * Dk * Dv, wt, Dk, Dv, BK, BV)
    if HAS_BIAS:
        _store_vec(bias_ptr + bh * Dv, bv, Dv, BV)
    if NF < N:  # a last, partly filled mini-batch: its sums S = K^T (eta G), s, not an update
        hm, kt = _regs_minibatch(wt, bv, NF, q_ptr, k_ptr, v_ptr, eta_ptr, tau_ptr, a_ptr,
                                 o_ptr, gam, bet, cm, bh, h, base_k, base_v, ebase, T, H, Dk,
                                 Dv, b, N, HAS_LN, RESIDUAL, PREC, BB, BK, BV)
        _wt_store(sw_ptr + bh * Dk * Dv, _dot(hm, tl.trans(kt), PREC), Dk, Dv, BK, BV)
        if HAS_BIAS:
            _store_vec(sb_ptr + bh * Dv, tl.sum(hm, axis=1), Dv, BV)


def launch_forward(L, store: bool, *args) -> bool:
    """Runs the register-resident forward for ops/ttt/triton.py's ``_LinearTriton`` (``L`` its
    ``_Shape``, ``args`` ``_linear_fwd_kernel``'s pointer and size arguments and ``store``) if
    ``fwd_variant`` chooses it; returns whether it did."""
    arch = _arch(args[0].device)
    if fwd_variant(arch, max(L.Dk, L.Dv)) != "regs":
        return False
    # forced where it has no tiling (a float32 or diagnostic call): the largest one
    cfg = regs_config(arch, torch.bfloat16, max(L.Dk, L.Dv)) or RegsConfig(8)
    consts = {k: v for k, v in L.consts.items() if k != "KC"}
    _linear_fwd_regs_kernel[(L.BH,)](*args, store, STAGES=cfg.stages, **consts,
                                     num_warps=cfg.warps, num_stages=cfg.stages)
    return True
