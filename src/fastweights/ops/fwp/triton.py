"""Triton kernels for the chunked fast-weight forms (SPEC.md 1.3 and the WY/UT form of 1.4),
forward and backward, shaped so that only the state hand-off between chunks is sequential.

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim, C chunk size
(C <= 64), N = ceil(T / C) chunks; BT = 64 the chunk tile, BK the key tile (64, or 128 for
64 < Dk <= 128, one tile), BV a block of value columns (chosen per GPU target by
``tile_config``). Rows past C or T and columns past Dk or Dv load as zeros and are never
stored, so neither T, C, Dk nor Dv has to be a power of two.

Linear attention is the delta rule with W = 0 and U0 = V (SPEC 1.3 vs 1.4 in the UT form:
S_{n+1} = S_n + K_n^T U_n, U_n = U0_n - W_n S_n, o_n = Q_n S_n + tril(Q_n K_n^T) U_n), so both
ops share the kernels below, with ``HAS_W`` off for linear attention:

forward   (a) ``_ut_fwd_kernel``       grid (N, B*H)          delta only: the per-chunk solve
              Xinv = (I + stril(diag(beta) K K^T))^-1, W = Xinv diag(beta) K, U0 = Xinv diag(beta) V
          (b) ``_state_fwd_kernel``    grid (Dv/BV, B*H)      sequential over chunks: stores the
              chunk-entering states h_n (and U_n for the delta rule), the final state
          (c) ``_output_kernel``       grid (Dv/BV, N, B*H)   o_n = Q_n h_n + tril(Q_n K_n^T) U_n
backward  (d) ``_local_du_kernel``     grid (Dv/BV, N, B*H)   dU_n = tril(Q_n K_n^T)^T dO_n
          (e) ``_state_bwd_kernel``    grid (Dv/BV, B*H)      sequential, last chunk first:
              stores dh_n (the gradient of the state leaving chunk n), completes
              dU_n += K_n dh_n, and carries dh <- dh + Q_n^T dO_n - W_n^T dU_n; returns dS0
          (f) ``_grad_kernel``         grid (N, B*H)          dQ, dK; for linear attention dV = dU
          (g) ``_ut_bwd_kernel``       grid (N, B*H)          delta only: dV, dbeta and the rest of
              dK through U = U0 - W h and the UT solve
The backward recomputes (a) and (b) from the saved inputs instead of keeping W, U0, h.
Normalised linear attention runs as the unnormalised one with a column of ones appended to V
(its state column is z, SPEC 1.3), and divides by that column plus eps in PyTorch, so the
normaliser's gradient is autograd's; it costs one more value block.

Precision: q (already multiplied by ``scale``), k, v, beta arrive in their own dtype (float16,
bfloat16 or float32) and are upcast on chip; every state, W, U, h, dh and accumulation is
float32. Products of two input tiles (Q K^T, Q^T dO) run on tensor cores with float32
accumulation. Products with a float32 operand run in exact float32 (``"ieee"``) for float32
inputs, and in TF32 (10-bit mantissa, the precision of a float16 input, finer than bfloat16's)
for half inputs, where exact float32 would leave the tensor cores idle.

Launch shape and roofline, B1 H8 Dk=Dv=64, C=64, bfloat16 inputs, H100 SXM (132 SMs, about
3.35 TB/s HBM3; BV=32 on sm_90, so Dv/BV=2). Programs per launch, and HBM bytes each kernel
moves (inputs 2 B/element, float32 intermediates 4 B; h is [B, H, N, Dk, Dv] float32):

  T      N     (a) ut (N*8)  (b) state (2*8)  (c) output (2*N*8)   bytes fwd, delta (linear)
  4k     64        512            16              1024              36 MB (17 MB)
  16k    256      2048            16              4096             143 MB (67 MB)
  64k    1024     8192            16             16384             570 MB (268 MB)

Forward delta-rule traffic per token and head: read q,k,v 384 B, beta; write W, U0 512 B; (b)
reads k, W, U0 640 B and writes U 256 B plus h (16 KiB per chunk = 256 B per token); (c) reads
q, k, U, h 1024 B and writes o 128 B: about 3.4 KB per token-head, 570 MB at 64k, 0.17 ms at
3.35 TB/s. Linear attention skips (a) and U: about 1.6 KB, 0.08 ms at 64k. The parallel kernels
(a), (c) fill the GPU (>= 512 programs on 132 SMs); the state pass (b) runs 16 programs, and its
time is latency: N steps of two 64x64x32 products each, about 1 us a step on one SM, so 1 ms at
64k, 0.25 ms at 16k, and this step, not HBM, bounds the forward. Expectations (forward; the
backward is about 2-3x): PyTorch chunk path, one launch per op per chunk for the delta rule's
hand-off (N Python-side steps, ~20 us each: 80 ms at 64k, measured 79 ms), linear attention's
cumsum form ~3 ms at 64k; FlashAttention (SDPA) causal softmax O(T^2 D): 2 T^2 H D FLOPs at
~400 TFLOP/s effective: 0.07 / 0.7 / 9 ms at 4k / 16k / 64k (measured 0.07 / 0.64 / 9.4 ms).
Measured figures: benchmarks/results/gpu_h100/README.md.

Variable-length batches (cu_seqlens) do not reach these kernels: the public ops run each
document through them in turn (ops/_varlen.py), a loop on the host.
This module imports ``triton`` at import time; ``ops/fwp/__init__.py`` imports it lazily.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

__all__ = ["MAX_CHUNK", "MAX_DK", "TileConfig", "delta_rule_triton", "linear_attn_triton",
           "tile_config"]

BT = 64  # the chunk tile: chunk sizes 1..64 run in it (fla's chunk size is 64 too)
MAX_CHUNK = BT
MAX_DK = 128  # the key tile is one BK = next power of two of Dk; above 128 the tiles spill


class TileConfig(NamedTuple):
    """Per-target tile choice: BV value columns per program, warps and pipeline stages of the
    looping (state-pass) kernels and of the parallel kernels."""

    BV: int
    num_warps: int
    loop_stages: int
    ut_bwd_warps: int  # the UT backward holds about ten [BT, BT] float32 tiles at once


def tile_config(arch: int, BK: int, dtype: torch.dtype) -> TileConfig | None:
    """The tiles for a compute capability ``arch`` (80 = sm_80 A100, 90 = sm_90 H100; others use
    the closest lower one), key tile BK and input dtype, or None where no tiling compiles
    without register spills (the dispatcher then takes the PyTorch path).
    tests/ops/test_fwp_triton_compile.py compiles every kernel for every configuration this
    returns and checks shared memory and spills."""
    if BK not in (16, 32, 64, 128):
        raise ValueError(f"BK must be 16, 32, 64 or 128, got {BK}")
    # Smaller value blocks give the state pass more programs (it is latency bound, B*H*Dv/BV
    # programs) at the price of reloading k, W per block. Exact float32 products ("ieee") are
    # FMA loops that hold both operands in registers: float32 inputs take half the block.
    BV = 16 if dtype == torch.float32 else 32
    return TileConfig(BV=BV, num_warps=8, loop_stages=2 if arch >= 90 else 1, ut_bwd_warps=8)


def key_tile(Dk: int) -> int:
    """The key tile for Dk (<= MAX_DK): 64 up to Dk = 64 (one tiling to compile and check per
    target and dtype; smaller heads are padded with masked zeros), else 128. The dispatcher
    (ops/backend.py) sends Dk <= 64 only: at BK = 128 the state passes and the backward spill
    registers (measured with tests/ops/triton_aot.py); calling the kernels directly still works."""
    return 64 if Dk <= 64 else 128


def _upcast_tiles(dtype: torch.dtype) -> bool:
    """Whether the kernels upcast their bfloat16 input tiles to float32 before tl.dot.

    Only under the CPU interpreter (TRITON_INTERPRET=1), whose bfloat16 tl.dot returns garbage
    (Triton 3.9; float16 and float32 are right). The upcast computes the same thing: a product
    of two bfloat16 numbers is exact in float32, so the float32 dot differs from the tensor-core
    bfloat16 dot with float32 accumulation only in summation order."""
    return dtype == torch.bfloat16 and bool(triton.knobs.runtime.interpret)


def precisions(dtype: torch.dtype) -> tuple[str, str]:
    """(IN_PREC, F32_PREC): tl.dot precision for products of two input tiles and for products
    with a float32 operand (see the module docstring)."""
    if dtype == torch.float32 or _upcast_tiles(dtype):
        return "ieee", "ieee" if dtype == torch.float32 else "tf32"
    return "tf32", "tf32"


# ---------------------------------------------------------------------------------------------
# Shared index helpers. Row t of a [B, T, H, D] tensor for (b, h) is at ((b*T + t)*H + h)*D.


@triton.jit
def _rows(i_n, T, C, BT: tl.constexpr):
    """Time indices of chunk i_n in a BT tile and the mask of its real rows."""
    rc = tl.arange(0, BT)
    rt = i_n * C + rc
    return rc, rt, (rc < C) & (rt < T)


@triton.jit
def _load_rows(ptr, b, h, rt, mt, T, H, D, BD: tl.constexpr, col0):
    """Tile [BT, BD] of a [B, T, H, D] tensor: rows rt, columns col0 + arange(BD)."""
    rd = col0 + tl.arange(0, BD)
    offs = ((b * T + rt[:, None]) * H + h) * D + rd[None, :]
    return tl.load(ptr + offs, mask=mt[:, None] & (rd < D)[None, :], other=0.0)


@triton.jit
def _store_rows(ptr, x, b, h, rt, mt, T, H, D, BD: tl.constexpr, col0):
    rd = col0 + tl.arange(0, BD)
    offs = ((b * T + rt[:, None]) * H + h) * D + rd[None, :]
    tl.store(ptr + offs, x.to(ptr.dtype.element_ty), mask=mt[:, None] & (rd < D)[None, :])


@triton.jit
def _state_ptrs(ptr, bh, i_n, N, Dk, Dv, BK: tl.constexpr, BV: tl.constexpr, v0):
    """Pointers and mask of block [:, v0:v0+BV] of state n of a [B*H, N, Dk, Dv] tensor."""
    rk = tl.arange(0, BK)
    rv = v0 + tl.arange(0, BV)
    offs = (bh * N + i_n) * Dk * Dv + rk[:, None] * Dv + rv[None, :]
    return ptr + offs, (rk < Dk)[:, None] & (rv < Dv)[None, :]


@triton.jit
def _chunk_scores(q_ptr, k_ptr, b, h, i_n, T, H, Dk, C, UPCAST: tl.constexpr,
                  IN_PREC: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """Q_n (input dtype, or float32 if UPCAST) and the causal scores tril(Q_n K_n^T) (float32)."""
    rc, rt, mt = _rows(i_n, T, C, BT)
    qb = _load_rows(q_ptr, b, h, rt, mt, T, H, Dk, BK, 0)
    kb = _load_rows(k_ptr, b, h, rt, mt, T, H, Dk, BK, 0)
    if UPCAST:
        qb, kb = qb.to(tl.float32), kb.to(tl.float32)
    scores = tl.dot(qb, tl.trans(kb), input_precision=IN_PREC)
    return qb, tl.where(rc[:, None] >= rc[None, :], scores, 0.0)


# ---------------------------------------------------------------------------------------------
# Forward


@triton.jit
def _ut_fwd_kernel(
    k_ptr, v_ptr, beta_ptr, w_ptr, u_ptr, x_ptr,
    T, H, Dk, Dv, C,
    STORE_X: tl.constexpr, UPCAST: tl.constexpr, IN_PREC: tl.constexpr,
    F32_PREC: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    """(a) Per chunk: Xinv = (I + A)^-1, A = stril(diag(beta) K K^T); W = Xinv diag(beta) K,
    U0 = Xinv diag(beta) V (float32, [B, T, H, Dk] / [B, T, H, Dv]); Xinv [B, T, H, BT] if
    STORE_X (the backward needs it)."""
    i_n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    rc, rt, mt = _rows(i_n, T, C, BT)
    kb = _load_rows(k_ptr, b, h, rt, mt, T, H, Dk, BK, 0)
    if UPCAST:
        kb = kb.to(tl.float32)
    beta = tl.load(beta_ptr + (b * T + rt) * H + h, mask=mt, other=0.0).to(tl.float32)
    kk = tl.dot(kb, tl.trans(kb), input_precision=IN_PREC)  # [BT, BT]
    A = tl.where(rc[:, None] > rc[None, :], beta[:, None] * kk, 0.0)
    # Forward substitution, one row at a time: row i of Xinv is e_i - A[i, :i] Xinv[:i, :]
    # (rows below i are still identity rows, and A[i, j] = 0 for j >= i).
    Xi = (rc[:, None] == rc[None, :]).to(tl.float32)
    for i in range(1, BT):
        a_i = tl.sum(tl.where(rc[:, None] == i, A, 0.0), axis=0)  # row i of A, [BT]
        row = tl.where(rc == i, 1.0, 0.0) - tl.sum(a_i[:, None] * Xi, axis=0)
        Xi = tl.where(rc[:, None] == i, row[None, :], Xi)
    Tm = Xi * beta[None, :]
    _store_rows(w_ptr, tl.dot(Tm, kb.to(tl.float32), input_precision=F32_PREC), b, h, rt, mt,
                T, H, Dk, BK, 0)
    for v0 in range(0, Dv, BV):
        vb = _load_rows(v_ptr, b, h, rt, mt, T, H, Dv, BV, v0).to(tl.float32)
        _store_rows(u_ptr, tl.dot(Tm, vb, input_precision=F32_PREC), b, h, rt, mt, T, H, Dv, BV,
                    v0)
    if STORE_X:
        _store_rows(x_ptr, Xi, b, h, rt, mt, T, H, BT, BT, 0)


@triton.jit
def _state_fwd_kernel(
    k_ptr, w_ptr, u_ptr, s0_ptr, h_ptr, unew_ptr, sT_ptr,
    T, H, N, Dk, Dv, C,
    HAS_W: tl.constexpr, UPCAST: tl.constexpr, IN_PREC: tl.constexpr,
    F32_PREC: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    STAGES: tl.constexpr,
):
    """(b) Sequential over chunks for one (b*h, value block): h[n] = S entering chunk n;
    U_n = U0_n - W_n S (HAS_W; stored to unew) or V_n; S += K_n^T U_n; final S to sT.
    u is U0 (float32) with HAS_W, else v in the input dtype."""
    i_v = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    v0 = i_v * BV
    s0_ptrs, ms = _state_ptrs(s0_ptr, bh, 0, 1, Dk, Dv, BK, BV, v0)
    S = tl.load(s0_ptrs, mask=ms, other=0.0)
    for i_n in tl.range(0, N, num_stages=STAGES):
        h_ptrs, _ = _state_ptrs(h_ptr, bh, i_n, N, Dk, Dv, BK, BV, v0)
        tl.store(h_ptrs, S, mask=ms)
        _, rt, mt = _rows(i_n, T, C, BT)
        kb = _load_rows(k_ptr, b, h, rt, mt, T, H, Dk, BK, 0)
        ub = _load_rows(u_ptr, b, h, rt, mt, T, H, Dv, BV, v0)
        if HAS_W:
            wb = _load_rows(w_ptr, b, h, rt, mt, T, H, Dk, BK, 0)
            # The only state-dependent step of the UT form: where the chunk reads the memory.
            ub -= tl.dot(wb, S, input_precision=F32_PREC)
            _store_rows(unew_ptr, ub, b, h, rt, mt, T, H, Dv, BV, v0)
            S += tl.dot(tl.trans(kb.to(tl.float32)), ub, input_precision=F32_PREC)
        else:
            if UPCAST:
                kb, ub = kb.to(tl.float32), ub.to(tl.float32)
            S += tl.dot(tl.trans(kb), ub, input_precision=IN_PREC)
    sT_ptrs, _ = _state_ptrs(sT_ptr, bh, 0, 1, Dk, Dv, BK, BV, v0)
    tl.store(sT_ptrs, S, mask=ms)


@triton.jit
def _output_kernel(
    q_ptr, k_ptr, u_ptr, h_ptr, o_ptr,
    T, H, N, Dk, Dv, C,
    UPCAST: tl.constexpr, IN_PREC: tl.constexpr, F32_PREC: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
):
    """(c) o_n = Q_n h_n + tril(Q_n K_n^T) U_n for one (value block, chunk, b*h)."""
    i_v = tl.program_id(0)
    i_n = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    b = bh // H
    h = bh % H
    v0 = i_v * BV
    _, rt, mt = _rows(i_n, T, C, BT)
    qb, scores = _chunk_scores(q_ptr, k_ptr, b, h, i_n, T, H, Dk, C, UPCAST, IN_PREC, BT, BK)
    h_ptrs, ms = _state_ptrs(h_ptr, bh, i_n, N, Dk, Dv, BK, BV, v0)
    S = tl.load(h_ptrs, mask=ms, other=0.0)
    ub = _load_rows(u_ptr, b, h, rt, mt, T, H, Dv, BV, v0).to(tl.float32)
    ob = tl.dot(qb.to(tl.float32), S, input_precision=F32_PREC)
    ob += tl.dot(scores, ub, input_precision=F32_PREC)
    _store_rows(o_ptr, ob, b, h, rt, mt, T, H, Dv, BV, v0)


# ---------------------------------------------------------------------------------------------
# Backward


@triton.jit
def _local_du_kernel(
    q_ptr, k_ptr, do_ptr, du_ptr,
    T, H, Dk, Dv, C,
    UPCAST: tl.constexpr, IN_PREC: tl.constexpr, F32_PREC: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
):
    """(d) dU_n = tril(Q_n K_n^T)^T dO_n (float32), the state-independent part of dU."""
    i_v = tl.program_id(0)
    i_n = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    b = bh // H
    h = bh % H
    _, rt, mt = _rows(i_n, T, C, BT)
    _, scores = _chunk_scores(q_ptr, k_ptr, b, h, i_n, T, H, Dk, C, UPCAST, IN_PREC, BT, BK)
    dob = _load_rows(do_ptr, b, h, rt, mt, T, H, Dv, BV, i_v * BV).to(tl.float32)
    _store_rows(du_ptr, tl.dot(tl.trans(scores), dob, input_precision=F32_PREC), b, h, rt, mt, T,
                H, Dv, BV, i_v * BV)


@triton.jit
def _state_bwd_kernel(
    q_ptr, k_ptr, w_ptr, do_ptr, du_ptr, dsT_ptr, dh_ptr, ds0_ptr,
    T, H, N, Dk, Dv, C,
    HAS_W: tl.constexpr, UPCAST: tl.constexpr, IN_PREC: tl.constexpr,
    F32_PREC: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    STAGES: tl.constexpr,
):
    """(e) Last chunk first, for one (b*h, value block): dh[n] = gradient of the state leaving
    chunk n; dU_n += K_n dh (in place); dh += Q_n^T dO_n - W_n^T dU_n (W with HAS_W only).
    dsT is the final state's gradient, ds0 receives the initial state's."""
    i_v = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    v0 = i_v * BV
    dsT_ptrs, ms = _state_ptrs(dsT_ptr, bh, 0, 1, Dk, Dv, BK, BV, v0)
    dS = tl.load(dsT_ptrs, mask=ms, other=0.0)
    for j in tl.range(0, N, num_stages=STAGES):
        i_n = N - 1 - j
        dh_ptrs, _ = _state_ptrs(dh_ptr, bh, i_n, N, Dk, Dv, BK, BV, v0)
        tl.store(dh_ptrs, dS, mask=ms)
        _, rt, mt = _rows(i_n, T, C, BT)
        qb = _load_rows(q_ptr, b, h, rt, mt, T, H, Dk, BK, 0)
        kb = _load_rows(k_ptr, b, h, rt, mt, T, H, Dk, BK, 0)
        dob = _load_rows(do_ptr, b, h, rt, mt, T, H, Dv, BV, v0)
        if UPCAST:
            qb, dob = qb.to(tl.float32), dob.to(tl.float32)
        du = _load_rows(du_ptr, b, h, rt, mt, T, H, Dv, BV, v0)
        du += tl.dot(kb.to(tl.float32), dS, input_precision=F32_PREC)
        _store_rows(du_ptr, du, b, h, rt, mt, T, H, Dv, BV, v0)
        if do_ptr.dtype.element_ty == tl.float32:  # normalised linear attention's dO
            dS += tl.dot(tl.trans(qb.to(tl.float32)), dob, input_precision=F32_PREC)
        else:
            dS += tl.dot(tl.trans(qb), dob, input_precision=IN_PREC)
        if HAS_W:
            wb = _load_rows(w_ptr, b, h, rt, mt, T, H, Dk, BK, 0)
            dS -= tl.dot(tl.trans(wb), du, input_precision=F32_PREC)
    ds0_ptrs, _ = _state_ptrs(ds0_ptr, bh, 0, 1, Dk, Dv, BK, BV, v0)
    tl.store(ds0_ptrs, dS, mask=ms)


@triton.jit
def _grad_kernel(
    q_ptr, k_ptr, u_ptr, h_ptr, dh_ptr, do_ptr, dq_ptr, dk_ptr,
    T, H, N, Dk, Dv, C,
    F32_PREC: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    """(f) Per chunk (all Dk, value blocks in a loop), with h = h_n, dh = dh_n (leaving):
      dQ = dO h^T + tril(dO U^T) K,  dK = U dh^T + tril(dO U^T)^T Q  (float32)
    u is U (float32) for the delta rule, v for linear attention. q, k load after the loop:
    fewer tiles live across it (registers)."""
    i_n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    rc, rt, mt = _rows(i_n, T, C, BT)
    dq = tl.zeros([BT, BK], dtype=tl.float32)
    dk = tl.zeros([BT, BK], dtype=tl.float32)
    dP = tl.zeros([BT, BT], dtype=tl.float32)
    for v0 in range(0, Dv, BV):
        h_ptrs, ms = _state_ptrs(h_ptr, bh, i_n, N, Dk, Dv, BK, BV, v0)
        S = tl.load(h_ptrs, mask=ms, other=0.0)
        dh_ptrs, _ = _state_ptrs(dh_ptr, bh, i_n, N, Dk, Dv, BK, BV, v0)
        dS = tl.load(dh_ptrs, mask=ms, other=0.0)
        dob = _load_rows(do_ptr, b, h, rt, mt, T, H, Dv, BV, v0).to(tl.float32)
        ub = _load_rows(u_ptr, b, h, rt, mt, T, H, Dv, BV, v0).to(tl.float32)
        dq += tl.dot(dob, tl.trans(S), input_precision=F32_PREC)
        dP += tl.dot(dob, tl.trans(ub), input_precision=F32_PREC)
        dk += tl.dot(ub, tl.trans(dS), input_precision=F32_PREC)
    dP = tl.where(rc[:, None] >= rc[None, :], dP, 0.0)
    kf = _load_rows(k_ptr, b, h, rt, mt, T, H, Dk, BK, 0).to(tl.float32)
    dq += tl.dot(dP, kf, input_precision=F32_PREC)
    _store_rows(dq_ptr, dq, b, h, rt, mt, T, H, Dk, BK, 0)
    qf = _load_rows(q_ptr, b, h, rt, mt, T, H, Dk, BK, 0).to(tl.float32)
    dk += tl.dot(tl.trans(dP), qf, input_precision=F32_PREC)
    _store_rows(dk_ptr, dk, b, h, rt, mt, T, H, Dk, BK, 0)


@triton.jit
def _ut_bwd_kernel(
    k_ptr, v_ptr, beta_ptr, x_ptr, h_ptr, du_ptr, dk_ptr, dv_ptr, dbeta_ptr,
    T, H, N, Dk, Dv, C,
    F32_PREC: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    """(g) Delta rule, per chunk: the gradient through U = U0 - W h and the UT solve
    (Tm = Xinv diag(beta), W = Tm K, U0 = Tm V), added to dK from (f):
      dW = -dU h^T, dV = Tm^T dU, dK += Tm^T dW, dTm = dU V^T + dW K^T,
      dXinv = dTm diag(beta), dbeta_j = sum_i Xinv_ij dTm_ij, dA = stril(-Xinv^T dXinv Xinv^T),
      dbeta_i += sum_j dA_ij (K K^T)_ij, dK += G K + G^T K with G = diag(beta) dA."""
    i_n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    rc, rt, mt = _rows(i_n, T, C, BT)
    dw = tl.zeros([BT, BK], dtype=tl.float32)
    dT = tl.zeros([BT, BT], dtype=tl.float32)
    for v0 in range(0, Dv, BV):
        h_ptrs, ms = _state_ptrs(h_ptr, bh, i_n, N, Dk, Dv, BK, BV, v0)
        S = tl.load(h_ptrs, mask=ms, other=0.0)
        du = _load_rows(du_ptr, b, h, rt, mt, T, H, Dv, BV, v0)
        vb = _load_rows(v_ptr, b, h, rt, mt, T, H, Dv, BV, v0).to(tl.float32)
        dw -= tl.dot(du, tl.trans(S), input_precision=F32_PREC)
        dT += tl.dot(du, tl.trans(vb), input_precision=F32_PREC)
    Xi = _load_rows(x_ptr, b, h, rt, mt, T, H, BT, BT, 0)
    beta = tl.load(beta_ptr + (b * T + rt) * H + h, mask=mt, other=0.0).to(tl.float32)
    Tm = Xi * beta[None, :]
    for v0 in range(0, Dv, BV):
        du = _load_rows(du_ptr, b, h, rt, mt, T, H, Dv, BV, v0)
        _store_rows(dv_ptr, tl.dot(tl.trans(Tm), du, input_precision=F32_PREC), b, h, rt, mt,
                    T, H, Dv, BV, v0)
    kf = _load_rows(k_ptr, b, h, rt, mt, T, H, Dk, BK, 0).to(tl.float32)
    dk = tl.dot(tl.trans(Tm), dw, input_precision=F32_PREC)
    dT += tl.dot(dw, tl.trans(kf), input_precision=F32_PREC)
    dbeta = tl.sum(Xi * dT, axis=0)
    dX = -tl.dot(tl.trans(Xi), tl.dot(dT * beta[None, :], tl.trans(Xi), input_precision=F32_PREC),
                 input_precision=F32_PREC)
    dA = tl.where(rc[:, None] > rc[None, :], dX, 0.0)
    kk = tl.dot(kf, tl.trans(kf), input_precision=F32_PREC)
    dbeta += tl.sum(dA * kk, axis=1)
    G = dA * beta[:, None]
    dk += tl.dot(G, kf, input_precision=F32_PREC)
    dk += tl.dot(tl.trans(G), kf, input_precision=F32_PREC)
    dk += _load_rows(dk_ptr, b, h, rt, mt, T, H, Dk, BK, 0)
    _store_rows(dk_ptr, dk, b, h, rt, mt, T, H, Dk, BK, 0)
    tl.store(dbeta_ptr + (b * T + rt) * H + h, dbeta, mask=mt)


# ---------------------------------------------------------------------------------------------
# Host side


class _Launch(NamedTuple):
    """What every launch of one call shares."""

    T: int
    H: int
    N: int
    Dk: int
    Dv: int
    C: int
    BH: int
    consts: dict
    cfg: TileConfig


def _launch(q: torch.Tensor, v: torch.Tensor, chunk_size: int) -> _Launch:
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    if not 1 <= chunk_size <= MAX_CHUNK:
        raise ValueError(f"chunk_size must be in 1..{MAX_CHUNK} for the Triton kernels, "
                         f"got {chunk_size}")
    if Dk > MAX_DK:
        raise ValueError(f"the Triton kernels take Dk <= {MAX_DK}, got {Dk}")
    arch = 80
    if q.is_cuda:
        major, minor = torch.cuda.get_device_capability(q.device)
        arch = 10 * major + minor
    BK = key_tile(Dk)
    cfg = tile_config(arch, BK, q.dtype)
    if cfg is None:
        raise ValueError(f"no Triton tiling for {q.dtype} at Dk={Dk} on sm_{arch}")
    in_prec, f32_prec = precisions(q.dtype)
    consts = {"UPCAST": _upcast_tiles(q.dtype), "IN_PREC": in_prec, "F32_PREC": f32_prec,
              "BT": BT, "BK": BK}
    return _Launch(T, H, triton.cdiv(T, chunk_size), Dk, Dv, chunk_size, B * H, consts, cfg)


def _ut_forward(L: _Launch, k, v, beta, store_x: bool):
    W = torch.empty(k.shape, dtype=torch.float32, device=k.device)
    U0 = torch.empty(v.shape, dtype=torch.float32, device=k.device)
    X = torch.empty(*k.shape[:3], BT, dtype=torch.float32, device=k.device) if store_x else W
    _ut_fwd_kernel[(L.N, L.BH)](k, v, beta, W, U0, X, L.T, L.H, L.Dk, L.Dv, L.C,
                                STORE_X=store_x, BV=L.cfg.BV, num_warps=L.cfg.num_warps,
                                **L.consts)
    return W, U0, X


def _state_forward(L: _Launch, k, W, U0, S0):
    """h [B*H, N, Dk, Dv], U (float32, delta only; else None) and the final state."""
    has_w = W is not None
    h = torch.empty(L.BH, L.N, L.Dk, L.Dv, dtype=torch.float32, device=k.device)
    U = torch.empty(U0.shape, dtype=torch.float32, device=k.device) if has_w else None
    S = torch.empty_like(S0)
    grid = (triton.cdiv(L.Dv, L.cfg.BV), L.BH)
    _state_fwd_kernel[grid](k, W if has_w else k, U0, S0, h, U if has_w else h, S,
                            L.T, L.H, L.N, L.Dk, L.Dv, L.C, HAS_W=has_w, BV=L.cfg.BV,
                            STAGES=L.cfg.loop_stages, num_warps=L.cfg.num_warps, **L.consts)
    return h, U, S


def _forward(L: _Launch, q, k, U, h, out_dtype):
    o = torch.empty(*q.shape[:3], L.Dv, dtype=out_dtype, device=q.device)
    grid = (triton.cdiv(L.Dv, L.cfg.BV), L.N, L.BH)
    _output_kernel[grid](q, k, U, h, o, L.T, L.H, L.N, L.Dk, L.Dv, L.C, BV=L.cfg.BV,
                         num_warps=L.cfg.num_warps, **L.consts)
    return o


def _backward(L: _Launch, q, k, v, beta, X, W, U, h, do, dS):
    """(d), (e), (f): gradients of q, k, v, beta (None for linear attention) and S0, float32."""
    has_w = W is not None
    do = do.contiguous()
    dS = (torch.zeros(L.BH, L.Dk, L.Dv, dtype=torch.float32, device=q.device) if dS is None
          else dS.to(torch.float32).contiguous())
    du = torch.empty(*q.shape[:3], L.Dv, dtype=torch.float32, device=q.device)
    grid_v = (triton.cdiv(L.Dv, L.cfg.BV), L.N, L.BH)
    _local_du_kernel[grid_v](q, k, do, du, L.T, L.H, L.Dk, L.Dv, L.C, BV=L.cfg.BV,
                             num_warps=L.cfg.num_warps, **L.consts)
    dh = torch.empty_like(h)
    dS0 = torch.empty(L.BH, L.Dk, L.Dv, dtype=torch.float32, device=q.device)
    _state_bwd_kernel[(triton.cdiv(L.Dv, L.cfg.BV), L.BH)](
        q, k, W if has_w else k, do, du, dS, dh, dS0, L.T, L.H, L.N, L.Dk, L.Dv, L.C,
        HAS_W=has_w, BV=L.cfg.BV, STAGES=L.cfg.loop_stages, num_warps=L.cfg.num_warps, **L.consts)
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.empty_like(dq)
    consts = {"F32_PREC": L.consts["F32_PREC"], "BT": BT, "BK": L.consts["BK"], "BV": L.cfg.BV,
              "num_warps": L.cfg.num_warps}
    _grad_kernel[(L.N, L.BH)](q, k, U if has_w else v, h, dh, do, dq, dk, L.T, L.H, L.N, L.Dk,
                              L.Dv, L.C, **consts)
    if not has_w:  # linear attention: dV is dU
        return dq, dk, du, None, dS0
    dv = torch.empty_like(du)
    dbeta = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    consts["num_warps"] = L.cfg.ut_bwd_warps
    _ut_bwd_kernel[(L.N, L.BH)](k, v, beta, X, h, du, dk, dv, dbeta, L.T, L.H, L.N, L.Dk, L.Dv,
                                L.C, **consts)
    return dq, dk, dv, dbeta, dS0


class _FastWeightsTriton(torch.autograd.Function):
    """(o, S) = chunked delta rule (beta given) or linear attention (beta None), forward and
    backward in the kernels above. S0 [B*H, Dk, Dv] float32."""

    @staticmethod
    def forward(ctx, q, k, v, beta, S0, chunk_size, out_dtype):  # type: ignore[override]
        L = _launch(q, v, chunk_size)
        S0 = S0.to(torch.float32).contiguous()
        if beta is None:
            W, U0 = None, v
        else:
            W, U0, _ = _ut_forward(L, k, v, beta, store_x=False)
        h, U, S = _state_forward(L, k, W, U0, S0)
        o = _forward(L, q, k, U if U is not None else v, h, out_dtype)
        ctx.save_for_backward(q, k, v, beta, S0)
        ctx.L = L
        return o, S

    @staticmethod
    def backward(ctx, do, dS):  # type: ignore[override]
        q, k, v, beta, S0 = ctx.saved_tensors
        L = ctx.L
        if do is None:
            do = torch.zeros(*q.shape[:3], L.Dv, dtype=q.dtype, device=q.device)
        # Recompute (a) and (b): cheaper in memory than keeping W, U0, U and h from the forward.
        if beta is None:
            W, U0, X = None, v, None
        else:
            W, U0, X = _ut_forward(L, k, v, beta, store_x=True)
        h, U, _ = _state_forward(L, k, W, U0, S0)
        dq, dk, dv, dbeta, dS0 = _backward(L, q, k, v, beta, X, W, U, h, do, dS)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                None if beta is None else dbeta.to(beta.dtype), dS0, None, None)


def _prepare(*xs: torch.Tensor) -> list[torch.Tensor]:
    return [x.contiguous() for x in xs]


def linear_attn_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S0: torch.Tensor, z0: torch.Tensor,
    normalize: bool, eps: float, chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunked linear attention (SPEC 1.3) in the kernels above; see ``chunk.linear_attn_chunk``.

    q (scaled), k [B, T, H, Dk], v [B, T, H, Dv] in float16/bfloat16/float32; S0 [B, H, Dk, Dv]
    and z0 [B, H, Dk] float32; chunk_size <= 64, Dk <= 128. Returns (o [B, T, H, Dv] in q's
    dtype, S, z in float32). With ``normalize`` V gains a column of ones whose state is z."""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    q, k = _prepare(q, k)
    S0, z0 = S0.to(torch.float32), z0.to(torch.float32)
    if normalize:
        v = torch.cat([v, v.new_ones(B, T, H, 1)], dim=-1)
        S0 = torch.cat([S0, z0.unsqueeze(-1)], dim=-1)
    v = v.contiguous()
    o, S = _FastWeightsTriton.apply(q, k, v, None, S0.reshape(B * H, Dk, -1), chunk_size,
                                    torch.float32 if normalize else q.dtype)
    S = S.reshape(B, H, Dk, -1)
    if normalize:
        o = (o[..., :Dv] / (o[..., Dv:] + eps)).to(q.dtype)
        return o, S[..., :Dv], S[..., Dv]
    return o, S, z0 + k.to(torch.float32).sum(dim=1)


def delta_rule_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, S0: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked delta rule, WY/UT form (SPEC 1.4), in the kernels above; see
    ``chunk.delta_rule_chunk``.

    q (scaled), k [B, T, H, Dk], v [B, T, H, Dv], beta [B, T, H] in float16/bfloat16/float32;
    S0 [B, H, Dk, Dv] float32; chunk_size <= 64, Dk <= 128. Returns (o [B, T, H, Dv] in q's
    dtype, S float32)."""
    B, _, H, Dk = q.shape
    q, k, v = _prepare(q, k, v)
    beta = beta.to(torch.float32).contiguous()  # [B, T, H]: small; one kernel signature
    o, S = _FastWeightsTriton.apply(q, k, v, beta, S0.to(torch.float32).reshape(B * H, Dk, -1),
                                    chunk_size, q.dtype)
    return o, S.reshape(B, H, Dk, -1)
