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

``FASTWEIGHTS_TTT_FWD`` (read at every call, ``fwd_variant``): "regs", "stream" or "resident"
(ops/ttt/triton_resident.py, opt-in) forces one forward kernel (a diagnostic switch, to time
them in one process); "cuda" asks for ops/ttt/linear_cuda.py's CUDA kernel (opt-in; where it
cannot run, one log line and the automatic choice); unset or empty, the register-resident
kernel wherever ``regs_config`` has a tiling, else the streamed one.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._triton_common import _arch
from .triton_tiles import (
    _cols,
    _dot,
    _head,
    _linear_in,
    _linear_out,
    _ln_affine,
    _loss_grad,
    _mb,
    _store_vec,
    _store_wrows,
    _vec,
    _wrows,
)

__all__ = ["ENV", "RegsConfig", "fwd_variant", "regs_config"]

ENV = "FASTWEIGHTS_TTT_FWD"
# "resident": ops/ttt/triton_resident.py, "cuda": ops/ttt/linear_cuda.py (both opt-in)
VARIANTS = ("stream", "regs", "resident", "cuda")


class RegsConfig(NamedTuple):
    """Warps and software-pipelining stages of ``_linear_fwd_regs_kernel``."""

    warps: int
    stages: int = 1
    KC: int = 32  # the key features of a block of W^T (at most 4 blocks: BK <= 4 KC)


def regs_config(arch: int, dtype: torch.dtype, D: int) -> RegsConfig | None:
    """The launch of ``_linear_fwd_regs_kernel`` for head size D = max(Dk, Dv) <= 128 on
    compute capability ``arch`` (80, 90) with ``dtype`` inputs, or None where it does not
    compile without register spills (tests/ops/test_ttt_triton_compile.py compiles these):
    4 warps up to D = 64; at D = 128 every tiling tried spills (docs/gpu_ttt_kernels.md).
    Half inputs only (float32 inputs multiply in exact float32, FMA loops, as the streamed
    kernel's, which the dispatcher leaves to PyTorch)."""
    if dtype not in (torch.float16, torch.bfloat16) or D > 64 or arch < 80:
        return None
    return RegsConfig(warps=4)


def fwd_variant(arch: int, D: int) -> str:
    """The TTT-Linear forward kernel a call runs: ``FASTWEIGHTS_TTT_FWD`` (one of VARIANTS)
    if set, else "regs" where ``regs_config`` has a tiling for half inputs (the tiling the
    host uses for every input dtype, as ops/ttt/triton.py's ``_shape``), else "stream"."""
    env = os.environ.get(ENV, "")
    if env:
        if env not in VARIANTS:
            raise ValueError(f"{ENV} must be one of {VARIANTS} or unset, got {env!r}")
        return env
    return _automatic(arch, D)


def _automatic(arch: int, D: int) -> str:
    """``fwd_variant``'s choice when ``FASTWEIGHTS_TTT_FWD`` is unset."""
    return "regs" if regs_config(arch, torch.bfloat16, D) is not None else "stream"


@triton.jit
def _w_load(ptr, Dk, Dv, BV: tl.constexpr, KC: tl.constexpr, NKC: tl.constexpr):
    """W^T of the row-major float32 W [Dk, Dv] at ptr as NKC (<= 4) column blocks [BV, KC]
    (W's rows c*KC..c*KC+KC); the blocks past NKC are zeros, never used."""
    w0 = _wrows(ptr, 0, Dk, Dv, BV, KC)
    w1 = tl.zeros([BV, KC], dtype=tl.float32)
    w2 = w1
    w3 = w1
    if NKC > 1:
        w1 = _wrows(ptr, KC, Dk, Dv, BV, KC)
    if NKC > 2:
        w2 = _wrows(ptr, 2 * KC, Dk, Dv, BV, KC)
        w3 = _wrows(ptr, 3 * KC, Dk, Dv, BV, KC)
    return w0, w1, w2, w3


@triton.jit
def _w_store(ptr, w0, w1, w2, w3, Dk, Dv, BV: tl.constexpr, KC: tl.constexpr,
             NKC: tl.constexpr):
    """W [Dk, Dv] at ptr from the column blocks of W^T (``_w_load``)."""
    _store_wrows(ptr, w0, 0, Dk, Dv, BV, KC)
    if NKC > 1:
        _store_wrows(ptr, w1, KC, Dk, Dv, BV, KC)
    if NKC > 2:
        _store_wrows(ptr, w2, 2 * KC, Dk, Dv, BV, KC)
        _store_wrows(ptr, w3, 3 * KC, Dk, Dv, BV, KC)


@triton.jit
def _z_block(wc, k_ptr, q_ptr, base_k, t, m, H, Dk, c0, zk, zq, PREC: tl.constexpr,
             KC: tl.constexpr):
    """zk + W^T_c K_c^T, zq + W^T_c Q_c^T for the key features c0..c0+KC (wc = W^T's block),
    and K_c^T [KC, BB]."""
    kc = _cols(k_ptr, base_k, t, m, H, Dk, KC, c0)
    return (_dot(wc, kc, PREC, zk), _dot(wc, _cols(q_ptr, base_k, t, m, H, Dk, KC, c0), PREC, zq),
            kc)


@triton.jit
def _regs_minibatch(w0, w1, w2, w3, bv, n, q_ptr, k_ptr, v_ptr, eta_ptr, tau_ptr, a_ptr, o_ptr,
                    gam, bet, cm, bh, h, base_k, base_v, ebase, T, H, Dk, Dv, b, N,
                    HAS_LN: tl.constexpr, RESIDUAL: tl.constexpr, PREC: tl.constexpr,
                    BB: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr, NKC: tl.constexpr):
    """Mini-batch n's read-out from the weights W^T (blocks w0..w3, ``_w_load``) and bias bv
    [BV] (o stored), and what its update needs: (eta G)^T [BV, BB] and the blocks of K^T
    [KC, BB] (zeros past NKC)."""
    _, t, m, eta, _, Et, At = _linear_in(eta_ptr, tau_ptr, a_ptr, bh, h, ebase, n, T, H, b, N,
                                         BB)
    tgt = _cols(v_ptr, base_v, t, m, H, Dv, BV)
    if RESIDUAL:  # Dk == Dv
        tgt -= _cols(k_ptr, base_v, t, m, H, Dv, BV)
    zk = tl.zeros([BV, BB], dtype=tl.float32) + bv[:, None]
    zq = zk
    k1 = tl.zeros([KC, BB], dtype=tl.float32)
    k2 = k1
    k3 = k1
    zk, zq, k0 = _z_block(w0, k_ptr, q_ptr, base_k, t, m, H, Dk, 0, zk, zq, PREC, KC)
    if NKC > 1:
        zk, zq, k1 = _z_block(w1, k_ptr, q_ptr, base_k, t, m, H, Dk, KC, zk, zq, PREC, KC)
    if NKC > 2:
        zk, zq, k2 = _z_block(w2, k_ptr, q_ptr, base_k, t, m, H, Dk, 2 * KC, zk, zq, PREC, KC)
        zk, zq, k3 = _z_block(w3, k_ptr, q_ptr, base_k, t, m, H, Dk, 3 * KC, zk, zq, PREC, KC)
    G, _, _, _ = _loss_grad(zk, tgt, gam, bet, cm, Dv, HAS_LN)
    zbar = zq - _dot(G, Et * At, PREC)
    _linear_out(o_ptr, zbar, q_ptr, gam, bet, cm, base_v, t, m, H, Dv, HAS_LN, RESIDUAL, BV)
    return G * eta[None, :], k0, k1, k2, k3


@triton.jit
def _linear_fwd_regs_kernel(
    q_ptr, k_ptr, v_ptr, eta_ptr, tau_ptr, a_ptr, lnw_ptr, lnb_ptr, b0_ptr,
    o_ptr, w_ptr, bias_ptr, sw_ptr, sb_ptr, ckw_ptr, ckb_ptr,
    T, H, Dk, Dv, b, N, NF, seg, store_ck,
    HAS_BIAS: tl.constexpr, HAS_LN: tl.constexpr, HAS_LNB: tl.constexpr,
    RESIDUAL: tl.constexpr, PREC: tl.constexpr,
    BB: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr,
    STAGES: tl.constexpr,
):
    """TTT-Linear forward for one (batch, head) over N mini-batches, NF of them full, the
    weights in registers; arguments and results those of ops/ttt/triton.py's
    ``_linear_fwd_kernel`` (w [B*H, Dk, Dv] the start weights, overwritten with the weights
    after the last full mini-batch; bias likewise from b0; sw, sb the sums of a last partial
    mini-batch; ckw, ckb the weights entering every ``seg``-th one if ``store_ck``).
    W^T is held as BK / KC (<= 4) column blocks [BV, KC]: each product over the key dim is
    one tl.dot per block, whose operands (which every warp holds whole: the warps split the
    rows) stay small. STAGES: the software pipelining of the loop over mini-batches."""
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
    for n in tl.range(0, NF, num_stages=STAGES):
        if store_ck and n % seg == 0:
            c = bh * NC + n // seg
            _w_store(ckw_ptr + c * Dk * Dv, w0, w1, w2, w3, Dk, Dv, BV, KC, NKC)
            if HAS_BIAS:
                _store_vec(ckb_ptr + c * Dv, bv, Dv, BV)
        hm, _, _, _, _ = _regs_minibatch(
            w0, w1, w2, w3, bv, n, q_ptr, k_ptr, v_ptr, eta_ptr, tau_ptr, a_ptr, o_ptr, gam, bet,
            cm, bh, h, base_k, base_v, ebase, T, H, Dk, Dv, b, N, HAS_LN, RESIDUAL, PREC, BB, BV,
            KC, NKC)
        # W^T <- W^T - tau_b (eta G)^T K, b <- b - tau_b sum eta G; the keys read again (from
        # L1): held from the read-out, their operand copies (every warp holds a product's
        # right operand whole) cost registers across the LayerNorm
        hm *= -tau_b
        _, t, m = _mb(n, b, T, BB)
        w0 = _dot(hm, tl.trans(_cols(k_ptr, base_k, t, m, H, Dk, KC, 0)), PREC, w0)
        if NKC > 1:
            w1 = _dot(hm, tl.trans(_cols(k_ptr, base_k, t, m, H, Dk, KC, KC)), PREC, w1)
        if NKC > 2:
            w2 = _dot(hm, tl.trans(_cols(k_ptr, base_k, t, m, H, Dk, KC, 2 * KC)), PREC, w2)
            w3 = _dot(hm, tl.trans(_cols(k_ptr, base_k, t, m, H, Dk, KC, 3 * KC)), PREC, w3)
        if HAS_BIAS:
            bv += tl.sum(hm, axis=1)
    _w_store(w_ptr + bh * Dk * Dv, w0, w1, w2, w3, Dk, Dv, BV, KC, NKC)
    if HAS_BIAS:
        _store_vec(bias_ptr + bh * Dv, bv, Dv, BV)
    if NF < N:  # a last, partly filled mini-batch: its sums S = K^T (eta G), s, not an update
        hm, k0, k1, k2, k3 = _regs_minibatch(
            w0, w1, w2, w3, bv, NF, q_ptr, k_ptr, v_ptr, eta_ptr, tau_ptr, a_ptr, o_ptr, gam,
            bet, cm, bh, h, base_k, base_v, ebase, T, H, Dk, Dv, b, N, HAS_LN, RESIDUAL, PREC,
            BB, BV, KC, NKC)
        sw = sw_ptr + bh * Dk * Dv  # one block at a time (each [BV, KC] in registers)
        _store_wrows(sw, _dot(hm, tl.trans(k0), PREC), 0, Dk, Dv, BV, KC)
        if NKC > 1:
            _store_wrows(sw, _dot(hm, tl.trans(k1), PREC), KC, Dk, Dv, BV, KC)
        if NKC > 2:
            _store_wrows(sw, _dot(hm, tl.trans(k2), PREC), 2 * KC, Dk, Dv, BV, KC)
            _store_wrows(sw, _dot(hm, tl.trans(k3), PREC), 3 * KC, Dk, Dv, BV, KC)
        if HAS_BIAS:
            _store_vec(sb_ptr + bh * Dv, tl.sum(hm, axis=1), Dv, BV)

def launch_forward(L, store: bool, *args) -> bool:
    """Runs the register-resident forward for ops/ttt/triton.py's ``_LinearTriton`` (``L`` its
    ``_Shape``, ``args`` ``_linear_fwd_kernel``'s pointer and size arguments and ``store``) if
    ``fwd_variant`` chooses it (this module's, or ops/ttt/triton_resident.py's); returns
    whether it did."""
    arch = _arch(args[0].device)
    variant = fwd_variant(arch, max(L.Dk, L.Dv))
    if variant == "cuda":
        from . import linear_cuda

        if linear_cuda.launch_forward(L, store, *args):
            return True
        variant = _automatic(arch, max(L.Dk, L.Dv))
    if variant == "resident":
        from . import triton_resident

        triton_resident.launch_forward(L, store, *args)
        return True
    if variant != "regs":
        return False
    # forced where it has no tiling (a float32 or diagnostic call): the largest one
    cfg = regs_config(arch, torch.bfloat16, max(L.Dk, L.Dv)) or RegsConfig(8)
    consts = {**L.consts, "KC": min(L.consts["BK"], cfg.KC)}
    _linear_fwd_regs_kernel[(L.BH,)](*args, store, STAGES=cfg.stages, **consts,
                                     num_warps=cfg.warps, num_stages=cfg.stages)
    return True
