"""Triton kernels for the chunked fast-weight forms (docs/maths.md 1.3, the WY/UT form of 1.4,
and 5b), forward and backward, shaped so that only the state hand-off between chunks is
sequential. The kernel plan, the tiling and the roofline estimates: docs/kernels.md.

Dimension legend: B batch, T time, H heads, Dk key/query dim (<= 128), Dv value dim, C chunk
size (C <= 64), N = ceil(T / C) chunks; BT = 64 the chunk tile, BK = 64 the key block (Dk runs
in one or two of them, NK = ceil(Dk / 64)), BV a block of value columns; per-kernel BV, warps,
pipeline stages and key steps are chosen per GPU target and dtype by ``tile_config``. Rows past
C or T and columns past Dk or Dv load as zeros and are never stored, so neither T, C, Dk nor Dv
has to be a power of two.

Linear attention is the delta rule with W = 0 and U0 = V (the UT form of docs/maths.md 1.4), so
the kernels below serve three ops: the delta rule (``delta_rule_triton``), linear attention
with ``HAS_W`` off (ops/linear_attn/triton.py) and the gated delta rule with ``HAS_G`` on, in
the algebra of ops/delta_rule/chunk.py's ``delta_rule_chunk`` with gates and its backward
(ops/gated_delta_rule/triton.py). The kernels, each documented where it is defined:

forward   (a) ``_ut_fwd_kernel``     delta only: the per-chunk solve, W and U0
          (b) ``_state_fwd_kernel``  sequential over chunks: the chunk-entering states
          (c) ``_output_kernel``     the outputs
backward  (d) ``_local_du_kernel``   (e) ``_state_bwd_kernel`` (sequential, last chunk first)
          (f) ``_ut_bwd_kernel``     (g) ``_grad_kernel``
The backward recomputes (a) and (b) from the saved inputs instead of keeping W, U0 and the states.

Precision: q (already multiplied by ``scale``), k, v, beta arrive in their own dtype (float16,
bfloat16 or float32) and are upcast on chip; every state, W, U, h, dh and accumulation is
float32. Products of two input tiles (Q K^T, Q^T dO) run on tensor cores with float32
accumulation; products with a float32 operand run in exact float32 (``"ieee"``) for float32
inputs and in TF32 for half inputs (``precisions``). The float32 delta rule has no tiling that
compiles without register spills, so the dispatcher sends it elsewhere (``tile_config``).

Variable-length batches (cu_seqlens) do not reach these kernels: the public ops run each
document through them in turn (ops/_varlen.py). This module imports ``triton`` at import time;
ops/backend.py imports it lazily.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .._triton_common import _arch, _upcast_tiles, precisions

__all__ = ["MAX_CHUNK", "MAX_DK", "OPS", "TileConfig", "Tiles", "delta_rule_triton", "supports",
           "tile_config"]

BT = 64  # the chunk tile: chunk sizes 1..64 run in it (fla's chunk size is 64 too)
MAX_CHUNK = BT
BK = 64  # the key tile: Dk runs in blocks of 64 (masked past Dk)
MAX_DK = 2 * BK  # the delta rule's state passes hold at most two key blocks per program
# Column width of the products whose right operand is a float32 [64, *] tile: on sm_80 (mma, warps
# stacked along the 64 rows of a chain of products) such an operand costs 64 registers per thread
# at 32 columns, 128 at 64, whence most of the spills of a 64-wide tiling.
BN = 32
_BN = tl.constexpr(BN)  # BN as the kernels read it


class Tiles(NamedTuple):
    """One kernel's launch choice: BV value columns per step (the grid's value blocks in (b) to
    (e), the step of an inner loop over values in (a), (f), (g)), warps, the software pipeline
    stages of the state passes' loop over chunks (1: none), and BK the key columns per step of
    (c), (d) and per program of (g) (the state passes and the UT kernels run blocks of 64)."""

    BV: int
    warps: int
    stages: int = 1
    BK: int = BK


class TileConfig(NamedTuple):
    """The tiles of every kernel for one target, input dtype and op; the state passes of the
    delta rule at two key blocks (64 < Dk <= 128) have their own. The delta rule's own kernels
    (UT solve, two key blocks) are None for linear attention."""

    state_fwd: Tiles
    output: Tiles
    local_du: Tiles
    state_bwd: Tiles
    grad: Tiles
    ut_fwd: Tiles | None = None
    state_fwd2: Tiles | None = None
    state_bwd2: Tiles | None = None
    ut_bwd: Tiles | None = None


OPS = ("linear_attn", "delta_rule", "gated_delta_rule")


def tile_config(arch: int, dtype: torch.dtype, op: str) -> TileConfig | None:
    """The launch choice for ``op`` (one of OPS) on compute capability ``arch`` (80 = sm_80 A100,
    90 = sm_90 H100; others use the closest lower one) with ``dtype`` inputs, or None where no
    tiling compiles without register spills (the dispatcher then takes another backend).
    tests/ops/test_fwp_triton_compile.py compiles every kernel the host launches with these, at
    Dk = 64 and 128, for sm_80 and sm_90, and asserts no spills and shared memory in bounds.

    Half inputs: value blocks of 32 and 8 warps; 16 columns where a program holds more float32
    tiles (the state passes at two key blocks, the UT backward, dQ/dK, whose programs take 32 key
    columns each). Float32 inputs multiply in exact float32: FMA loops whose operands a thread
    holds whole (its rows or columns times the contraction length), so the contractions are kept
    short: key steps of 32 with 16 warps in (c), of 16 in (d) and per (g) program. Only linear
    attention fits: the delta rule's state passes contract the register-held state over 64 rows
    and spill at every tiling tried (8 or 16 warps, 16 or 32 columns, exact or 3xTF32 products),
    so float32 delta rule inputs take fla or PyTorch. The gated delta rule runs the delta rule's
    kernels with its gates (same tiles, float32 likewise refused) but value blocks of 16 in its
    state passes and output kernel, whose decay tables and per-token decays hold more float32
    registers, and on sm_80 16 key columns per (g) program. Linear attention's output kernel
    takes 4 warps on sm_80 (docs/kernels.md, "Tiles")."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    gated = op == "gated_delta_rule"  # the delta rule's kernels with the gates switched on
    stages = 2 if arch >= 90 else 1  # sm_90 pipelines the state passes' loads (cp.async)
    if dtype == torch.float32:
        if op != "linear_attn":
            return None
        return TileConfig(state_fwd=Tiles(16, 8, stages), output=Tiles(16, 16, BK=32),
                          local_du=Tiles(16, 8, BK=16), state_bwd=Tiles(16, 8, stages),
                          grad=Tiles(16, 8, BK=16))
    wide, narrow = Tiles(32, 8), Tiles(16, 8)
    cfg = TileConfig(state_fwd=Tiles(32, 8, stages), output=wide, local_du=wide,
                     state_bwd=Tiles(32, 8, stages), grad=Tiles(16, 8, BK=BN))
    if op == "linear_attn":  # (sm_80, Triton 3.6's ptxas: 8 warps at 128 registers spill)
        return cfg._replace(output=Tiles(32, 4)) if arch < 90 else cfg
    cfg = cfg._replace(ut_fwd=wide, state_fwd2=Tiles(16, 8, stages), ut_bwd=narrow,
                       state_bwd2=Tiles(16, 8, stages))
    if gated:  # the gates' tables and per-token decays: narrower value blocks
        cfg = cfg._replace(state_fwd=Tiles(16, 8, stages), output=narrow,
                           state_bwd=Tiles(16, 8, stages))
        if arch < 90:  # the gates' part of (g) holds four more [64, 64] float32 tables
            cfg = cfg._replace(grad=Tiles(16, 8, BK=16))
    return cfg


def supports(op: str, dtype: torch.dtype) -> bool:
    """Whether ``op`` with ``dtype`` inputs has a tiling on every target (sm_80 and up)."""
    return all(tile_config(arch, dtype, op) is not None for arch in (80, 90))


# ---------------------------------------------------------------------------------------------
# Shared index helpers. Row t of a [B, T, H, D] tensor for (b, h) is at ((b*T + t)*H + h)*D:
# the chunk's first row is a scalar int64 base, offsets inside a tile are int32 (fewer registers
# than a tile of 64-bit offsets; a chunk tile spans BT*H*D < 2^31 elements).


@triton.jit
def _rows(i_n, T, C, BT: tl.constexpr):
    """Row indices 0..BT-1 of chunk i_n and the mask of its real rows (< C and < T)."""
    rc = tl.arange(0, BT)
    return rc, (rc < C) & (i_n * C + rc < T)


@triton.jit
def _tile(ptr, b, h, i_n, mt, T, H, D, C, BT: tl.constexpr, BD: tl.constexpr, col0):
    """Pointers and mask of the [BT, BD] tile of chunk i_n, columns col0.., of [B, T, H, D]."""
    base = ptr + ((b * T + i_n * C) * H + h) * D + col0
    rd = tl.arange(0, BD)
    offs = tl.arange(0, BT)[:, None] * (H * D) + rd[None, :]
    return base + offs, mt[:, None] & (col0 + rd < D)[None, :]


@triton.jit
def _load(ptr, b, h, i_n, mt, T, H, D, C, BT: tl.constexpr, BD: tl.constexpr, col0):
    ptrs, mask = _tile(ptr, b, h, i_n, mt, T, H, D, C, BT, BD, col0)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _load_rows(ptr, b, h, i_n, r0, T, H, D, C, BR: tl.constexpr, BD: tl.constexpr, col0):
    """Rows r0..r0+BR of chunk i_n, columns col0.., of a [B, T, H, D] tensor."""
    rr = r0 + tl.arange(0, BR)
    mr = (rr < C) & (i_n * C + rr < T)
    ptrs, mask = _tile(ptr, b, h, i_n, mr, T, H, D, C, BR, BD, col0)
    return tl.load(ptrs + r0 * (H * D), mask=mask, other=0.0)


@triton.jit
def _store(ptr, x, b, h, i_n, mt, T, H, D, C, BT: tl.constexpr, BD: tl.constexpr, col0):
    ptrs, mask = _tile(ptr, b, h, i_n, mt, T, H, D, C, BT, BD, col0)
    tl.store(ptrs, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _state(ptr, bh, i_n, N, Dk, Dv, BK: tl.constexpr, BV: tl.constexpr, k0, v0):
    """Pointers and mask of block [k0:k0+BK, v0:v0+BV] of state n of [B*H, N, Dk, Dv]."""
    base = ptr + (bh * N + i_n) * Dk * Dv + k0 * Dv + v0
    rk = tl.arange(0, BK)
    rv = tl.arange(0, BV)
    return base + rk[:, None] * Dv + rv[None, :], (k0 + rk < Dk)[:, None] & (v0 + rv < Dv)[None, :]


@triton.jit
def _load_state(ptr, bh, i_n, N, Dk, Dv, BK: tl.constexpr, BV: tl.constexpr, k0, v0):
    ptrs, mask = _state(ptr, bh, i_n, N, Dk, Dv, BK, BV, k0, v0)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _store_state(ptr, x, bh, i_n, N, Dk, Dv, BK: tl.constexpr, BV: tl.constexpr, k0, v0):
    ptrs, mask = _state(ptr, bh, i_n, N, Dk, Dv, BK, BV, k0, v0)
    tl.store(ptrs, x, mask=mask)


@triton.jit
def _load_beta(beta_ptr, b, h, i_n, mt, T, H, C, BT: tl.constexpr):
    rt = i_n * C + tl.arange(0, BT)
    return tl.load(beta_ptr + (b * T + rt) * H + h, mask=mt, other=0.0).to(tl.float32)


@triton.jit
def _key_head(h, H, HK, GROUPED: tl.constexpr):
    """(head, heads) at which q and k are read for value head h of H: (h // (H / HK), HK) with
    grouped heads, else v's own (h, H), so that one row address serves q, k, v and o (a
    second address computation costs the output kernel its last free registers on sm_80)."""
    hk = h
    HQ = H
    if GROUPED:
        hk = h // (H // HK)
        HQ = HK
    return hk, HQ


@triton.jit
def _gates(g_ptr, b, h, i_n, mt, T, H, C, BT: tl.constexpr):
    """The gated delta rule's decays of chunk i_n from its log-gates g [B, T, H] (rows past C or
    T load g = 0: no decay), every exponent a sum of gates over a range of tokens, <= 0:
      Gam [BT, BT]  Gam_ij = exp(sum_{j < m <= i} g_m) for i >= j, else 0 (token j to token i);
      gam [BT]      exp(sum_{m <= i} g_m) (the chunk's start to token i).
    Segment sums, one cumsum down each column of the table g_m [m > j], never differences of
    running sums: those lose the small one's digits after a large gate and make
    -inf - (-inf) = NaN after a hard reset (g = -inf), where a segment sum is -inf, Gam = 0."""
    rc = tl.arange(0, BT)
    g = tl.load(g_ptr + (b * T + i_n * C + rc) * H + h, mask=mt, other=0.0).to(tl.float32)
    L = tl.cumsum(tl.where(rc[:, None] > rc[None, :], g[:, None], 0.0), axis=0)
    Gam = tl.where(rc[:, None] >= rc[None, :], tl.exp(L), 0.0)
    return Gam, tl.exp(tl.cumsum(g, axis=0)), g


@triton.jit
def _scores_and_state(q_ptr, k_ptr, s_ptr, b, h, bh, i_n, mt, T, H, N, Dk, Dv, C, v0, with_state,
                      BY_K: tl.constexpr, UPCAST: tl.constexpr, IN_PREC: tl.constexpr,
                      F32_PREC: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr):
    """Over the key blocks of chunk i_n: tril(Q_n K_n^T) [BT, BT] and, if ``with_state``,
    X_n s[n][:, v0:v0+BV] [BT, BV] with X = K (BY_K) or Q, s a [B*H, N, Dk, Dv] state (float32)."""
    acc = tl.zeros([BT, BV], dtype=tl.float32)
    scores = tl.zeros([BT, BT], dtype=tl.float32)
    for k0 in range(0, Dk, BK):
        qb = _load(q_ptr, b, h, i_n, mt, T, H, Dk, C, BT, BK, k0)
        kb = _load(k_ptr, b, h, i_n, mt, T, H, Dk, C, BT, BK, k0)
        if UPCAST:
            qb, kb = qb.to(tl.float32), kb.to(tl.float32)
        scores += tl.dot(qb, tl.trans(kb), input_precision=IN_PREC)
        if with_state:
            S = _load_state(s_ptr, bh, i_n, N, Dk, Dv, BK, BV, k0, v0)
            x = kb if BY_K else qb
            acc += tl.dot(x.to(tl.float32), S, input_precision=F32_PREC)
    rc = tl.arange(0, BT)
    return tl.where(rc[:, None] >= rc[None, :], scores, 0.0), acc


# ---------------------------------------------------------------------------------------------
# Forward


@triton.jit
def _ut_fwd_kernel(
    k_ptr, v_ptr, beta_ptr, g_ptr, w_ptr, u_ptr, x_ptr, last_ptr,
    T, H, HK, Dk, Dv, C, store_x,
    HAS_G: tl.constexpr, GROUPED: tl.constexpr, UPCAST: tl.constexpr, IN_PREC: tl.constexpr,
    F32_PREC: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    """(a) Per chunk: Xinv = (I + A)^-1, A = stril(diag(beta) K K^T); W = Xinv diag(beta) K,
    U0 = Xinv diag(beta) V (float32, [B, T, H, Dk] / [B, T, H, Dv]); Xinv [B, T, H, BT] if
    ``store_x`` (the backward needs it; a runtime flag: one compiled kernel for both).
    Gated delta rule (HAS_G, log-gates g [B, T, H]; ops/delta_rule/chunk.py's algebra):
    A = stril(diag(beta) (K K^T * Gam)), W = Xinv diag(beta) diag(gam) K, and the decay from
    each token to the chunk's end, last_j = Gam_{C-1, j}, stored to last [B, T, H] for (b).
    K has HK heads (HK divides H; value head h reads key head h // (H / HK))."""
    i_n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    hk, HQ = _key_head(h, H, HK, GROUPED)
    rc, mt = _rows(i_n, T, C, BT)
    beta = _load_beta(beta_ptr, b, h, i_n, mt, T, H, C, BT)
    kk = tl.zeros([BT, BT], dtype=tl.float32)
    for k0 in range(0, Dk, BK):
        kb = _load(k_ptr, b, hk, i_n, mt, T, HQ, Dk, C, BT, BK, k0)
        if UPCAST:
            kb = kb.to(tl.float32)
        kk += tl.dot(kb, tl.trans(kb), input_precision=IN_PREC)
    if HAS_G:
        Gam, gam, g = _gates(g_ptr, b, h, i_n, mt, T, H, C, BT)
        kk = kk * Gam
        # last_j = exp(sum_{m > j} g_m): rows past the chunk hold g = 0, so this is row C-1.
        last = tl.exp(tl.sum(tl.where(rc[:, None] > rc[None, :], g[:, None], 0.0), axis=0))
        tl.store(last_ptr + (b * T + i_n * C + rc) * H + h, last, mask=mt)
    A = tl.where(rc[:, None] > rc[None, :], beta[:, None] * kk, 0.0)
    # Forward substitution, one row at a time: row i of Xinv is e_i - A[i, :i] Xinv[:i, :]
    # (rows below i are still identity rows, and A[i, j] = 0 for j >= i).
    Xi = (rc[:, None] == rc[None, :]).to(tl.float32)
    for i in range(1, BT):
        a_i = tl.sum(tl.where(rc[:, None] == i, A, 0.0), axis=0)  # row i of A, [BT]
        row = tl.where(rc == i, 1.0, 0.0) - tl.sum(a_i[:, None] * Xi, axis=0)
        Xi = tl.where(rc[:, None] == i, row[None, :], Xi)
    if store_x:
        _store(x_ptr, Xi, b, h, i_n, mt, T, H, BT, C, BT, BT, 0)
    Tm = Xi * beta[None, :]
    for k0 in range(0, Dk, _BN):
        kb = _load(k_ptr, b, hk, i_n, mt, T, HQ, Dk, C, BT, _BN, k0).to(tl.float32)
        if HAS_G:
            kb = kb * gam[:, None]
        _store(w_ptr, tl.dot(Tm, kb, input_precision=F32_PREC), b, h, i_n, mt, T, H, Dk, C, BT,
               _BN, k0)
    for v0 in range(0, Dv, BV):
        vb = _load(v_ptr, b, h, i_n, mt, T, H, Dv, C, BT, BV, v0).to(tl.float32)
        _store(u_ptr, tl.dot(Tm, vb, input_precision=F32_PREC), b, h, i_n, mt, T, H, Dv, C, BT,
               BV, v0)


@triton.jit
def _state_fwd_kernel(
    k_ptr, w_ptr, u_ptr, s0_ptr, h_ptr, unew_ptr, sT_ptr, g_ptr, last_ptr,
    T, H, N, Dk, Dv, C, HK,
    HAS_W: tl.constexpr, NK: tl.constexpr, UPCAST: tl.constexpr, IN_PREC: tl.constexpr,
    F32_PREC: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    STAGES: tl.constexpr, HAS_G: tl.constexpr, GROUPED: tl.constexpr,
):
    """(b) Sequential over chunks for one (value block, key block(s), b*h): h[n] = S entering
    chunk n; S += K_n^T U_n; the final S to sT. Linear attention (no W): U_n = V_n (u, input
    dtype), and the key blocks are independent (grid axis 1, NK = 1). Delta rule (HAS_W): U_n =
    U0_n - W_n S (u is U0, float32; U_n stored to unew) reads every key block of S: one program
    holds the NK (1 or 2) blocks of BK rows. Gated (HAS_G, with HAS_W): S <- gam_L S +
    (diag(last) K_n)^T U_n, gam_L = exp(sum of the chunk's gates), last from (a); K has HK
    heads as in (a)."""
    tl.static_assert(NK == 1 or (HAS_W and NK == 2))
    tl.static_assert(HAS_W or not HAS_G)
    i_v = tl.program_id(0)
    bh = tl.program_id(2).to(tl.int64)
    b = bh // H
    h = bh % H
    hk, HQ = _key_head(h, H, HK, GROUPED)
    v0 = i_v * BV
    k0 = tl.program_id(1) * BK
    S1 = _load_state(s0_ptr, bh, 0, 1, Dk, Dv, BK, BV, k0, v0)
    if NK == 2:
        S2 = _load_state(s0_ptr, bh, 0, 1, Dk, Dv, BK, BV, BK, v0)
    for i_n in tl.range(0, N, num_stages=STAGES):
        _store_state(h_ptr, S1, bh, i_n, N, Dk, Dv, BK, BV, k0, v0)
        if NK == 2:
            _store_state(h_ptr, S2, bh, i_n, N, Dk, Dv, BK, BV, BK, v0)
        rc, mt = _rows(i_n, T, C, BT)
        ub = _load(u_ptr, b, h, i_n, mt, T, H, Dv, C, BT, BV, v0)
        k1 = _load(k_ptr, b, hk, i_n, mt, T, HQ, Dk, C, BT, BK, k0)
        if HAS_G:  # the state decays through the chunk; token j's write by last_j
            offs = (b * T + i_n * C + rc) * H + h
            gL = tl.exp(tl.sum(tl.load(g_ptr + offs, mask=mt, other=0.0).to(tl.float32)))
            last = tl.load(last_ptr + offs, mask=mt, other=0.0)
        if HAS_W:
            # The only state-dependent step of the UT form: where the chunk reads the memory.
            w1 = _load(w_ptr, b, h, i_n, mt, T, H, Dk, C, BT, BK, k0)
            ub -= tl.dot(w1, S1, input_precision=F32_PREC)
            if NK == 2:
                w2 = _load(w_ptr, b, h, i_n, mt, T, H, Dk, C, BT, BK, BK)
                ub -= tl.dot(w2, S2, input_precision=F32_PREC)
            _store(unew_ptr, ub, b, h, i_n, mt, T, H, Dv, C, BT, BV, v0)
            if HAS_G:  # (diag(last) K)^T U = K^T (diag(last) U): the smaller tile scaled
                ub = ub * last[:, None]
                S1 = S1 * gL
            S1 += tl.dot(tl.trans(k1.to(tl.float32)), ub, input_precision=F32_PREC)
            if NK == 2:
                k2 = _load(k_ptr, b, hk, i_n, mt, T, HQ, Dk, C, BT, BK, BK).to(tl.float32)
                if HAS_G:
                    S2 = S2 * gL
                S2 += tl.dot(tl.trans(k2), ub, input_precision=F32_PREC)
        else:
            if UPCAST:
                k1, ub = k1.to(tl.float32), ub.to(tl.float32)
            S1 += tl.dot(tl.trans(k1), ub, input_precision=IN_PREC)
    _store_state(sT_ptr, S1, bh, 0, 1, Dk, Dv, BK, BV, k0, v0)
    if NK == 2:
        _store_state(sT_ptr, S2, bh, 0, 1, Dk, Dv, BK, BV, BK, v0)


@triton.jit
def _output_kernel(
    q_ptr, k_ptr, u_ptr, h_ptr, o_ptr, g_ptr,
    T, H, N, Dk, Dv, C, HK,
    UPCAST: tl.constexpr, IN_PREC: tl.constexpr, F32_PREC: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, HAS_G: tl.constexpr, GROUPED: tl.constexpr,
):
    """(c) o_n = Q_n h_n + tril(Q_n K_n^T) U_n for one (value block, chunk, b*h); gated (HAS_G):
    o_n = diag(gam) Q_n h_n + (Q_n K_n^T * Gam) U_n. Q and K have HK heads as in (a)."""
    i_v = tl.program_id(0)
    i_n = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    b = bh // H
    h = bh % H
    v0 = i_v * BV
    _, mt = _rows(i_n, T, C, BT)
    hk, HQ = _key_head(h, H, HK, GROUPED)
    scores, ob = _scores_and_state(q_ptr, k_ptr, h_ptr, b, hk, bh, i_n, mt, T, HQ, N, Dk, Dv, C,
                                   v0, True, False, UPCAST, IN_PREC, F32_PREC, BT, BK, BV)
    if HAS_G:
        Gam, gam, _ = _gates(g_ptr, b, h, i_n, mt, T, H, C, BT)
        scores = scores * Gam
        ob = ob * gam[:, None]
    ub = _load(u_ptr, b, h, i_n, mt, T, H, Dv, C, BT, BV, v0).to(tl.float32)
    ob += tl.dot(scores, ub, input_precision=F32_PREC)
    _store(o_ptr, ob, b, h, i_n, mt, T, H, Dv, C, BT, BV, v0)


# ---------------------------------------------------------------------------------------------
# Backward


@triton.jit
def _local_du_kernel(
    q_ptr, k_ptr, do_ptr, dh_ptr, du_ptr, g_ptr,
    T, H, N, Dk, Dv, C, HK, add_dh,
    UPCAST: tl.constexpr, IN_PREC: tl.constexpr,
    F32_PREC: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_G: tl.constexpr, GROUPED: tl.constexpr,
):
    """(d) dU_n = tril(Q_n K_n^T)^T dO_n (float32), plus K_n dh_n if ``add_dh`` (linear
    attention, after the reverse state pass: then dU_n is dV_n; a runtime flag, one compiled
    kernel for both). Gated (HAS_G): dU_n = (Q_n K_n^T * Gam)^T dO_n. Q, K have HK heads as
    in (a)."""
    i_v = tl.program_id(0)
    i_n = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    b = bh // H
    h = bh % H
    v0 = i_v * BV
    _, mt = _rows(i_n, T, C, BT)
    hk, HQ = _key_head(h, H, HK, GROUPED)
    scores, du = _scores_and_state(q_ptr, k_ptr, dh_ptr, b, hk, bh, i_n, mt, T, HQ, N, Dk, Dv, C,
                                   v0, add_dh, True, UPCAST, IN_PREC, F32_PREC, BT, BK, BV)
    if HAS_G:
        Gam, _, _ = _gates(g_ptr, b, h, i_n, mt, T, H, C, BT)
        scores = scores * Gam
    dob = _load(do_ptr, b, h, i_n, mt, T, H, Dv, C, BT, BV, v0).to(tl.float32)
    du += tl.dot(tl.trans(scores), dob, input_precision=F32_PREC)
    _store(du_ptr, du, b, h, i_n, mt, T, H, Dv, C, BT, BV, v0)


@triton.jit
def _qt_do(qb, dob, UPCAST: tl.constexpr, IN_PREC: tl.constexpr, F32_PREC: tl.constexpr):
    """Q^T dO [BK, BV] float32: on tensor cores in the input dtype, in float32 when dO is float32
    (normalised linear attention's o is float32) or under UPCAST."""
    if UPCAST or dob.dtype == tl.float32:
        out = tl.dot(tl.trans(qb.to(tl.float32)), dob.to(tl.float32), input_precision=F32_PREC)
    else:
        out = tl.dot(tl.trans(qb), dob, input_precision=IN_PREC)
    return out


@triton.jit
def _state_bwd_kernel(
    q_ptr, k_ptr, w_ptr, do_ptr, du_ptr, dsT_ptr, dh_ptr, ds0_ptr, g_ptr, last_ptr,
    T, H, N, Dk, Dv, C, HK,
    HAS_W: tl.constexpr, NK: tl.constexpr, UPCAST: tl.constexpr, IN_PREC: tl.constexpr,
    F32_PREC: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    STAGES: tl.constexpr, HAS_G: tl.constexpr, GROUPED: tl.constexpr,
):
    """(e) Last chunk first, for one (value block, key block(s), b*h): dh[n] = gradient of the
    state leaving chunk n; dS += Q_n^T dO_n, and for the delta rule (HAS_W) first dU_n += K_n dS
    (in place; dU_n holds the local part from (d)), then dS -= W_n^T dU_n. dsT is the final
    state's gradient, ds0 receives the initial state's. Key blocks as in (b). Gated (HAS_G, the
    transpose of (b)'s hand-off): dU_n += diag(last) K_n dS, dS <- gam_L dS + Q_n^T diag(gam)
    dO_n - W_n^T dU_n, with last from (a); Q, K have HK heads."""
    tl.static_assert(NK == 1 or (HAS_W and NK == 2))
    tl.static_assert(HAS_W or not HAS_G)
    i_v = tl.program_id(0)
    bh = tl.program_id(2).to(tl.int64)
    b = bh // H
    h = bh % H
    hk, HQ = _key_head(h, H, HK, GROUPED)
    v0 = i_v * BV
    k0 = tl.program_id(1) * BK
    dS1 = _load_state(dsT_ptr, bh, 0, 1, Dk, Dv, BK, BV, k0, v0)
    if NK == 2:
        dS2 = _load_state(dsT_ptr, bh, 0, 1, Dk, Dv, BK, BV, BK, v0)
    for j in tl.range(0, N, num_stages=STAGES):
        i_n = N - 1 - j
        _store_state(dh_ptr, dS1, bh, i_n, N, Dk, Dv, BK, BV, k0, v0)
        if NK == 2:
            _store_state(dh_ptr, dS2, bh, i_n, N, Dk, Dv, BK, BV, BK, v0)
        rc, mt = _rows(i_n, T, C, BT)
        dob = _load(do_ptr, b, h, i_n, mt, T, H, Dv, C, BT, BV, v0)
        offs = (b * T + i_n * C + rc) * H + h  # the chunk's per-token scalars (HAS_G)
        if HAS_W:
            k1 = _load(k_ptr, b, hk, i_n, mt, T, HQ, Dk, C, BT, BK, k0).to(tl.float32)
            kd = tl.dot(k1, dS1, input_precision=F32_PREC)
            if NK == 2:
                k2 = _load(k_ptr, b, hk, i_n, mt, T, HQ, Dk, C, BT, BK, BK).to(tl.float32)
                kd += tl.dot(k2, dS2, input_precision=F32_PREC)
            if HAS_G:  # (diag(last) K) dS: the smaller tile scaled, as in (b)
                kd = kd * tl.load(last_ptr + offs, mask=mt, other=0.0)[:, None]
            du = _load(du_ptr, b, h, i_n, mt, T, H, Dv, C, BT, BV, v0) + kd
            _store(du_ptr, du, b, h, i_n, mt, T, H, Dv, C, BT, BV, v0)
        if HAS_G:  # dO's rows decayed from the chunk's start, rounded to dO's dtype (for the
            # tensor cores: a float32 operand does not fit the registers on sm_90; docs/kernels.md,
            # "Precision"); the carried gradient by gam_L
            gv = tl.load(g_ptr + offs, mask=mt, other=0.0)
            dob = (dob.to(tl.float32) * tl.exp(tl.cumsum(gv, axis=0))[:, None]).to(dob.dtype)
            gL = tl.exp(tl.sum(gv))
            dS1 = dS1 * gL
            if NK == 2:
                dS2 = dS2 * gL
        q1 = _load(q_ptr, b, hk, i_n, mt, T, HQ, Dk, C, BT, BK, k0)
        dS1 += _qt_do(q1, dob, UPCAST, IN_PREC, F32_PREC)
        if HAS_W:
            w1 = _load(w_ptr, b, h, i_n, mt, T, H, Dk, C, BT, BK, k0)
            dS1 -= tl.dot(tl.trans(w1), du, input_precision=F32_PREC)
            if NK == 2:
                q2 = _load(q_ptr, b, hk, i_n, mt, T, HQ, Dk, C, BT, BK, BK)
                dS2 += _qt_do(q2, dob, UPCAST, IN_PREC, F32_PREC)
                w2 = _load(w_ptr, b, h, i_n, mt, T, H, Dk, C, BT, BK, BK)
                dS2 -= tl.dot(tl.trans(w2), du, input_precision=F32_PREC)
    _store_state(ds0_ptr, dS1, bh, 0, 1, Dk, Dv, BK, BV, k0, v0)
    if NK == 2:
        _store_state(ds0_ptr, dS2, bh, 0, 1, Dk, Dv, BK, BV, BK, v0)


@triton.jit
def _before(x, BT: tl.constexpr):
    """[BT] -> [BT]: sum_{j < m} x_j at m (a masked sum: no running sum differenced)."""
    rc = tl.arange(0, BT)
    return tl.sum(tl.where(rc[:, None] > rc[None, :], x[None, :], 0.0), axis=1)


@triton.jit
def _ut_bwd_kernel(
    k_ptr, v_ptr, beta_ptr, x_ptr, h_ptr, du_ptr, dv_ptr, dbeta_ptr, e_ptr, g_ptr, dg_ptr,
    T, H, N, Dk, Dv, C, HK,
    UPCAST: tl.constexpr, IN_PREC: tl.constexpr, F32_PREC: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, HAS_G: tl.constexpr, GROUPED: tl.constexpr,
):
    """(f) Delta rule, per chunk: the gradient through U = U0 - W h and the UT solve (Tm = Xinv
    diag(beta), W = Tm K, U0 = Tm V), with h = h_n and dU complete from (e). With dW = -dU h^T:
      dV = Tm^T dU,  dTm = dU V^T + dW K^T = dU (V - K h)^T,
      dXinv = dTm diag(beta), dbeta_j = sum_i Xinv_ij dTm_ij, dA = stril(-Xinv^T dXinv Xinv^T),
      dbeta_i += sum_j dA_ij (K K^T)_ij, E = diag(beta) dA, stored to e [B, T, H, BT].
    The rest of dK, Tm^T dW + E K + E^T K = -dV h^T + (E + E^T) K, is added by (g), which reads
    h and the key blocks anyway.
    Gated (HAS_G; W = Tm diag(gam) K, A = stril(diag(beta) M), M = K K^T * Gam):
    dTm = dU (V - diag(gam) K h)^T, dbeta_i += sum_j dA_ij M_ij, E = diag(beta) dA * Gam, and
    the solve's part of the gates' gradient: with dL = diag(beta) dA * M (the gradient of the
    exponents L_ij of Gam through A), cr = colsum(dL) - rowsum(dL), the chunk's tokens get
    dg_m = sum_{j < m} cr_j (ops/delta_rule/chunk.py, ``_DeltaRuleChunk``), stored to dg
    [B, T, H] (the first of the partial sums (g) adds to). K has HK heads as in (a)."""
    i_n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // H
    h = bh % H
    hk, HQ = _key_head(h, H, HK, GROUPED)
    rc, mt = _rows(i_n, T, C, BT)
    beta = _load_beta(beta_ptr, b, h, i_n, mt, T, H, C, BT)
    if HAS_G:
        gv = tl.load(g_ptr + (b * T + i_n * C + rc) * H + h, mask=mt, other=0.0)
        gam = tl.exp(tl.cumsum(gv, axis=0))
    dT = tl.zeros([BT, BT], dtype=tl.float32)
    for v0 in range(0, Dv, BV):
        kh = tl.zeros([BT, BV], dtype=tl.float32)
        for k0 in range(0, Dk, BK):  # K h, this value block
            kf = _load(k_ptr, b, hk, i_n, mt, T, HQ, Dk, C, BT, BK, k0).to(tl.float32)
            S = _load_state(h_ptr, bh, i_n, N, Dk, Dv, BK, BV, k0, v0)
            kh += tl.dot(kf, S, input_precision=F32_PREC)
        if HAS_G:
            kh = kh * gam[:, None]
        r = _load(v_ptr, b, h, i_n, mt, T, H, Dv, C, BT, BV, v0).to(tl.float32) - kh
        du = _load(du_ptr, b, h, i_n, mt, T, H, Dv, C, BT, BV, v0)
        dT += tl.dot(du, tl.trans(r), input_precision=F32_PREC)
    # dA = stril(-Xinv^T dXinv Xinv^T), BN columns at a time: column block j of Xinv^T is row
    # block j of Xinv, and K K^T's column block is K (K's rows of block j)^T.
    Xi = _load(x_ptr, b, h, i_n, mt, T, H, BT, C, BT, BT, 0)
    dbeta = tl.sum(Xi * dT, axis=0)
    dXb = dT * beta[None, :]
    Xt = tl.trans(Xi)
    dbeta2 = tl.zeros([BT], dtype=tl.float32)
    cr = tl.zeros([BT], dtype=tl.float32)  # gated: colsum(dL) - rowsum(dL)
    for j0 in range(0, BT, _BN):
        cj = j0 + tl.arange(0, _BN)
        Xj = _load_rows(x_ptr, b, h, i_n, j0, T, H, BT, C, _BN, BT, 0)
        Mj = tl.dot(dXb, tl.trans(Xj), input_precision=F32_PREC)  # [BT, BN]
        dA = tl.where(rc[:, None] > cj[None, :], -tl.dot(Xt, Mj, input_precision=F32_PREC), 0.0)
        kk = tl.zeros([BT, _BN], dtype=tl.float32)
        for k0 in range(0, Dk, BK):
            kb = _load(k_ptr, b, hk, i_n, mt, T, HQ, Dk, C, BT, BK, k0)
            kj = _load_rows(k_ptr, b, hk, i_n, j0, T, HQ, Dk, C, _BN, BK, k0)
            if UPCAST:
                kb, kj = kb.to(tl.float32), kj.to(tl.float32)
            kk += tl.dot(kb, tl.trans(kj), input_precision=IN_PREC)
        E = dA * beta[:, None]
        if HAS_G:  # Gam's column block: cumsums of the gates below each column (as ``_gates``)
            Lj = tl.cumsum(tl.where(rc[:, None] > cj[None, :], gv[:, None], 0.0), axis=0)
            Gj = tl.where(rc[:, None] >= cj[None, :], tl.exp(Lj), 0.0)
            kk = kk * Gj
            E = E * Gj
            dL = dA * beta[:, None] * kk
            col = tl.sum(dL, axis=0)  # [BN], placed at the block's columns
            cr += tl.sum(tl.where(rc[:, None] == cj[None, :], col[None, :], 0.0), axis=1)
            cr -= tl.sum(dL, axis=1)
        dbeta2 += tl.sum(dA * kk, axis=1)
        _store(e_ptr, E, b, h, i_n, mt, T, H, BT, C, BT, _BN, j0)
    tl.store(dbeta_ptr + (b * T + i_n * C + rc) * H + h, dbeta + dbeta2, mask=mt)
    if HAS_G:
        tl.store(dg_ptr + (b * T + i_n * C + rc) * H + h, _before(cr, BT), mask=mt)
    Tt = tl.trans(Xi * beta[None, :])
    for v0 in range(0, Dv, BV):
        du = _load(du_ptr, b, h, i_n, mt, T, H, Dv, C, BT, BV, v0)
        _store(dv_ptr, tl.dot(Tt, du, input_precision=F32_PREC), b, h, i_n, mt, T, H, Dv, C, BT,
               BV, v0)


@triton.jit
def _grad_kernel(
    q_ptr, k_ptr, u_ptr, h_ptr, dh_ptr, do_ptr, dv_ptr, e_ptr, dq_ptr, dk_ptr, g_ptr, last_ptr,
    dg_ptr, T, H, N, Dk, Dv, C, HK,
    HAS_W: tl.constexpr, F32_PREC: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, HAS_G: tl.constexpr, GROUPED: tl.constexpr,
):
    """(g) For one (key block, chunk, b*h), with h = h_n, dh = dh_n (leaving) and dP =
    tril(dO U^T) over all value blocks:
      dQ = dO h^T + dP K,  dK = U dh^T + dP^T Q  (float32)
    u is U (float32) for the delta rule, v for linear attention. For the delta rule (HAS_W) dK
    also gets the UT solve's part from (f): -dV h^T + (E + E^T) K.
    Gated (HAS_G; E from (f) holds Gam): dP = dO U^T * Gam,
      dQ = diag(gam) dO h^T + dP K,  dK = diag(last) U dh^T - diag(gam) dV h^T + dP^T Q
           + (E + E^T) K,
    and this key block's part of the gates' gradient (the chunked form's backward): dgam_i =
    q_i . (dO h^T)_i - k_i . (dV h^T)_i, dlast_j = k_j . (U dh^T)_j, dgam_L = <dh, h>, dL =
    dO U^T * Q K^T * Gam (Q K^T over this block's columns), cr = colsum(dL) - rowsum(dL) +
    dlast * last; token m of the chunk gets sum_{i >= m} gam_i dgam_i + gam_L dgam_L +
    sum_{j < m} cr_j, stored to dg [1 + key block, B, T, H] (the host adds the partial sums).
    Q, K have HK heads as in (a); dQ, dK are stored per value head (the host adds a group's)."""
    i_n = tl.program_id(1)
    bh = tl.program_id(2).to(tl.int64)
    b = bh // H
    h = bh % H
    hk, HQ = _key_head(h, H, HK, GROUPED)
    k0 = tl.program_id(0) * BK
    rc, mt = _rows(i_n, T, C, BT)
    dq = tl.zeros([BT, BK], dtype=tl.float32)
    dk = tl.zeros([BT, BK], dtype=tl.float32)
    dvs = tl.zeros([BT, BK], dtype=tl.float32)  # gated: dV h^T
    dP = tl.zeros([BT, BT], dtype=tl.float32)
    dgL = 0.0  # gated: <dh, h> over this key block
    for v0 in range(0, Dv, BV):
        dob = _load(do_ptr, b, h, i_n, mt, T, H, Dv, C, BT, BV, v0).to(tl.float32)
        ub = _load(u_ptr, b, h, i_n, mt, T, H, Dv, C, BT, BV, v0).to(tl.float32)
        S = _load_state(h_ptr, bh, i_n, N, Dk, Dv, BK, BV, k0, v0)
        dS = _load_state(dh_ptr, bh, i_n, N, Dk, Dv, BK, BV, k0, v0)
        dq += tl.dot(dob, tl.trans(S), input_precision=F32_PREC)
        dP += tl.dot(dob, tl.trans(ub), input_precision=F32_PREC)
        dk += tl.dot(ub, tl.trans(dS), input_precision=F32_PREC)
        if HAS_W:
            dvb = _load(dv_ptr, b, h, i_n, mt, T, H, Dv, C, BT, BV, v0)
            if HAS_G:
                dvs += tl.dot(dvb, tl.trans(S), input_precision=F32_PREC)
                dgL += tl.sum(dS * S)
            else:
                dk -= tl.dot(dvb, tl.trans(S), input_precision=F32_PREC)
    kf = _load(k_ptr, b, hk, i_n, mt, T, HQ, Dk, C, BT, BK, k0).to(tl.float32)
    qf = _load(q_ptr, b, hk, i_n, mt, T, HQ, Dk, C, BT, BK, k0).to(tl.float32)
    if HAS_G:
        Gam, gam, gv = _gates(g_ptr, b, h, i_n, mt, T, H, C, BT)
        last = tl.load(last_ptr + (b * T + i_n * C + rc) * H + h, mask=mt, other=0.0)
        dgam = tl.sum(qf * dq, axis=1) - tl.sum(kf * dvs, axis=1)
        dlast = tl.sum(kf * dk, axis=1)
        dq = dq * gam[:, None]
        dk = dk * last[:, None] - dvs * gam[:, None]
        dL = dP * tl.dot(qf, tl.trans(kf), input_precision=F32_PREC) * Gam
        dP = dP * Gam
        cr = tl.sum(dL, axis=0) - tl.sum(dL, axis=1) + dlast * last
        gg = gam * dgam  # sum_{i >= m} of it at m
        after = tl.sum(tl.where(rc[:, None] >= rc[None, :], gg[:, None], 0.0), axis=0)
        dgp = after + dgL * tl.exp(tl.sum(gv)) + _before(cr, BT)
        slot = (tl.program_id(0) + 1) * tl.num_programs(2).to(tl.int64) * T  # 1 + key block
        tl.store(dg_ptr + (slot + (b * T + i_n * C + rc) * H + h), dgp, mask=mt)
    else:
        dP = tl.where(rc[:, None] >= rc[None, :], dP, 0.0)
    dq += tl.dot(dP, kf, input_precision=F32_PREC)
    _store(dq_ptr, dq, b, h, i_n, mt, T, H, Dk, C, BT, BK, k0)
    dk += tl.dot(tl.trans(dP), qf, input_precision=F32_PREC)
    if HAS_W:
        e = _load(e_ptr, b, h, i_n, mt, T, H, BT, C, BT, BT, 0)
        dk += tl.dot(e + tl.trans(e), kf, input_precision=F32_PREC)
    _store(dk_ptr, dk, b, h, i_n, mt, T, H, Dk, C, BT, BK, k0)


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
    NK: int  # key blocks of BK
    consts: dict
    cfg: TileConfig
    HK: int  # query/key heads (H, the value heads, is a multiple; HK = H but for grouped heads)

    @property
    def dims(self) -> tuple[int, ...]:
        return self.T, self.H, self.N, self.Dk, self.Dv, self.C

    def nv(self, tiles: Tiles) -> int:
        return triton.cdiv(self.Dv, tiles.BV)

    def state(self, has_w: bool, backward: bool) -> tuple[tuple[int, int, int], dict]:
        """Grid and launch arguments of a state pass: the delta rule holds all key blocks of a
        value block in one program (NK of them), linear attention runs one per key block."""
        if has_w and self.NK == 2:
            tiles = self.cfg.state_bwd2 if backward else self.cfg.state_fwd2
        else:
            tiles = self.cfg.state_bwd if backward else self.cfg.state_fwd
        grid = (self.nv(tiles), 1 if has_w else self.NK, self.BH)
        return grid, {"HAS_W": has_w, "NK": self.NK if has_w else 1, "BV": tiles.BV,
                      "STAGES": tiles.stages, "num_warps": tiles.warps, **self.consts}

    def tiles(self, tiles: Tiles) -> dict:
        """Launch arguments of a kernel without a loop over chunks."""
        return {**self.consts, "BV": tiles.BV, "BK": tiles.BK, "num_warps": tiles.warps}


def _launch(q: torch.Tensor, v: torch.Tensor, chunk_size: int, op: str) -> _Launch:
    B, T, HK, Dk = q.shape
    H, Dv = v.shape[2:]
    if not 1 <= chunk_size <= MAX_CHUNK:
        raise ValueError(f"chunk_size must be in 1..{MAX_CHUNK} for the Triton kernels, "
                         f"got {chunk_size}")
    if Dk > MAX_DK:
        raise ValueError(f"the Triton kernels take Dk <= {MAX_DK}, got {Dk}")
    arch = _arch(q.device)
    # A direct call where no tiling is spill-free (float32 delta rule) runs the half tiling: the
    # same arithmetic, correct, with spilled registers; the dispatcher does not send it here.
    cfg = tile_config(arch, q.dtype, op) or tile_config(arch, torch.bfloat16, op)
    in_prec, f32_prec = precisions(q.dtype)
    consts = {"UPCAST": _upcast_tiles(q.dtype), "IN_PREC": in_prec, "F32_PREC": f32_prec,
              "BT": BT, "BK": BK}
    return _Launch(T, H, triton.cdiv(T, chunk_size), Dk, Dv, chunk_size, B * H,
                   triton.cdiv(Dk, BK), consts, cfg, HK)


def _ut_forward(L: _Launch, k, v, beta, store_x: bool, g=None):
    """(a): W, U0 and (``store_x``) Xinv; with the log-gates ``g`` [B, T, H] (float32) also
    last [B, T, H] for (b), else None. W, U0, Xinv have the H value heads."""
    W = torch.empty(*v.shape[:3], L.Dk, dtype=torch.float32, device=k.device)
    U0 = torch.empty(v.shape, dtype=torch.float32, device=k.device)
    X = torch.empty(*v.shape[:3], BT, dtype=torch.float32, device=k.device) if store_x else W
    last = None if g is None else torch.empty(g.shape, dtype=torch.float32, device=k.device)
    _ut_fwd_kernel[(L.N, L.BH)](k, v, beta, beta if g is None else g, W, U0, X,
                                beta if last is None else last, L.T, L.H, L.HK, L.Dk, L.Dv, L.C,
                                store_x, HAS_G=g is not None, GROUPED=L.HK != L.H,
                                **L.tiles(L.cfg.ut_fwd))
    return W, U0, X, last


def _state_forward(L: _Launch, k, W, U0, S0, g=None, last=None):
    """h [B*H, N, Dk, Dv], U (float32, delta only; else None) and the final state; gated with
    ``g`` and ``last`` from (a)."""
    has_w = W is not None
    h = torch.empty(L.BH, L.N, L.Dk, L.Dv, dtype=torch.float32, device=k.device)
    U = torch.empty(U0.shape, dtype=torch.float32, device=k.device) if has_w else None
    S = torch.empty_like(S0)
    grid, args = L.state(has_w, backward=False)
    gates = (g, last) if g is not None else (S, S)  # (unread without HAS_G)
    _state_fwd_kernel[grid](k, W if has_w else k, U0, S0, h, U if has_w else h, S, *gates,
                            *L.dims, L.HK, HAS_G=g is not None, GROUPED=L.HK != L.H, **args)
    return h, U, S


def _forward(L: _Launch, q, k, U, h, out_dtype, g=None):
    o = torch.empty(*U.shape[:3], L.Dv, dtype=out_dtype, device=q.device)
    _output_kernel[(L.nv(L.cfg.output), L.N, L.BH)](q, k, U, h, o, h if g is None else g,
                                                     *L.dims, L.HK, HAS_G=g is not None,
                                                     GROUPED=L.HK != L.H, **L.tiles(L.cfg.output))
    return o


def _backward(L: _Launch, q, k, v, beta, X, W, U, h, do, dS, g=None, last=None):
    """(d) to (g): gradients of q, k, v, beta (None for linear attention), S0 and, gated (the
    log-gates ``g`` and ``last`` from (a)), g (else None), float32. dq and dk have q's HK heads
    (a group's value heads added)."""
    has_w, gated = W is not None, g is not None
    B, T, H, _ = do.shape
    do = do.contiguous()
    dS = (torch.zeros(L.BH, L.Dk, L.Dv, dtype=torch.float32, device=q.device) if dS is None
          else dS.to(torch.float32).contiguous())
    du = torch.empty(B, T, H, L.Dv, dtype=torch.float32, device=q.device)
    dh = torch.empty_like(h)
    dS0 = torch.empty(L.BH, L.Dk, L.Dv, dtype=torch.float32, device=q.device)
    flags = {"HAS_G": gated, "GROUPED": L.HK != L.H}
    gates = (g, last) if gated else (du, du)  # (unread without HAS_G)
    local_grid = (L.nv(L.cfg.local_du), L.N, L.BH)
    local = {**L.tiles(L.cfg.local_du), **flags}
    grid, args = L.state(has_w, backward=True)
    if has_w:  # the local part of dU first: the reverse state pass completes it
        _local_du_kernel[local_grid](q, k, do, dh, du, gates[0], *L.dims, L.HK, False, **local)
        _state_bwd_kernel[grid](q, k, W, do, du, dS, dh, dS0, *gates, *L.dims, L.HK, **args,
                                **flags)
    else:  # dh first (no dU in the recurrence); then dU = dV in one parallel pass
        _state_bwd_kernel[grid](q, k, k, do, dh, dS, dh, dS0, *gates, *L.dims, L.HK, **args,
                                **flags)
        _local_du_kernel[local_grid](q, k, do, dh, du, gates[0], *L.dims, L.HK, True, **local)
    dq = torch.empty(B, T, H, L.Dk, dtype=torch.float32, device=q.device)
    dk = torch.empty_like(dq)
    n_grad = triton.cdiv(L.Dk, L.cfg.grad.BK)  # (g)'s key blocks
    dg = torch.empty(1 + n_grad, B, T, H, dtype=torch.float32, device=q.device) if gated else None
    dv, dbeta, E = du, None, dq  # linear attention: dV is dU; no UT solve
    if has_w:
        dv = torch.empty_like(du)
        dbeta = torch.empty(B, T, H, dtype=torch.float32, device=q.device)
        E = torch.empty(B, T, H, BT, dtype=torch.float32, device=q.device)
        _ut_bwd_kernel[(L.N, L.BH)](k, v, beta, X, h, du, dv, dbeta, E, gates[0],
                                    du if dg is None else dg, *L.dims, L.HK,
                                    **L.tiles(L.cfg.ut_bwd), **flags)
    grad = L.tiles(L.cfg.grad)
    _grad_kernel[(n_grad, L.N, L.BH)](
        q, k, U if has_w else v, h, dh, do, dv, E, dq, dk, *gates, du if dg is None else dg,
        *L.dims, L.HK, HAS_W=has_w, **flags,
        **{n: grad[n] for n in ("F32_PREC", "BT", "BK", "BV", "num_warps")})
    if L.HK != L.H:  # grouped heads: each key head's gradient sums its value heads'
        dq, dk = (x.view(B, T, L.HK, L.H // L.HK, L.Dk).sum(3) for x in (dq, dk))
    return dq, dk, dv, dbeta, dS0, None if dg is None else dg.sum(0)


class _FastWeightsTriton(torch.autograd.Function):
    """(o, S) = chunked delta rule (beta given) or linear attention (beta None), forward and
    backward in the kernels above. S0 [B*H, Dk, Dv] float32."""

    @staticmethod
    def forward(ctx, q, k, v, beta, S0, chunk_size, out_dtype):  # type: ignore[override]
        L = _launch(q, v, chunk_size, "linear_attn" if beta is None else "delta_rule")
        S0 = S0.to(torch.float32).contiguous()
        if beta is None:
            W, U0 = None, v
        else:
            W, U0, _, _ = _ut_forward(L, k, v, beta, store_x=False)
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
            W, U0, X, _ = _ut_forward(L, k, v, beta, store_x=True)
        h, U, _ = _state_forward(L, k, W, U0, S0)
        dq, dk, dv, dbeta, dS0, _ = _backward(L, q, k, v, beta, X, W, U, h, do, dS)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                None if beta is None else dbeta.to(beta.dtype), dS0, None, None)


ALIGN = 16  # elements: every head size the kernels see is a multiple (docs/kernels.md, "Alignment")


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous at a 16-byte aligned address (a copy only where it is not)."""
    x = x.contiguous()
    if not torch.compiler.is_compiling() and x.data_ptr() % 16:
        x = x.clone()
    return x


def _pad_to(x: torch.Tensor, *sizes: int) -> torch.Tensor:
    """``x`` with its last len(sizes) dims zero-padded up to ``sizes``, contiguous and 16-byte
    aligned (``_aligned``); no copy where nothing is padded and x already is."""
    pad = [n for size, have in zip(reversed(sizes), reversed(x.shape)) for n in (0, size - have)]
    return _aligned(F.pad(x, pad) if any(pad) else x)


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S0: torch.Tensor,
             *gates: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor, tuple[int, int]]:
    """The kernels' inputs: q, k [B, T, HK, Dk], v [B, T, H, Dv] and S0 [B, H, Dk, Dv] with Dk,
    Dv zero-padded up to multiples of ``ALIGN``, every tensor contiguous and 16-byte aligned;
    per-token ``gates`` [B, T, H] (beta, g) as float32. Returns ([q, k, v, *gates], S0 as
    [B*H, Dk', Dv'] float32, (Dk, Dv)): slice the outputs back with ``_unpad``.

    Zero key columns add nothing to any product over Dk, and zero value columns stay zero in
    every state, U and output, so the padded call computes the same numbers. The kernels then
    only ever see rows that start at 16-byte boundaries, which they load in vectors: the
    launches tests/ops/test_fwp_triton_compile.py compiles (sizes T, N, C free, the rest
    aligned) are all the host makes."""
    B, _, _, Dk = q.shape
    H, Dv = v.shape[2:]
    dk, dv = -(-Dk // ALIGN) * ALIGN, -(-Dv // ALIGN) * ALIGN
    xs = [_pad_to(q, dk), _pad_to(k, dk), _pad_to(v, dv)]
    xs += [_aligned(x.to(torch.float32)) for x in gates]
    S0 = _pad_to(S0.to(torch.float32).reshape(B * H, Dk, Dv), dk, dv)
    return xs, S0, (Dk, Dv)


def _unpad(o: torch.Tensor, S: torch.Tensor, dims: tuple[int, int]
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """o [B, T, H, Dv'] and S [B*H, Dk', Dv'] of a padded call -> o [B, T, H, Dv], S [B, H,
    Dk, Dv] (views; no copy)."""
    Dk, Dv = dims
    B, _, H, _ = o.shape
    return o[..., :Dv], S.reshape(B, H, *S.shape[1:])[..., :Dk, :Dv]


def delta_rule_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, S0: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked delta rule, WY/UT form (docs/maths.md 1.4), in the kernels above; see
    ``chunk.delta_rule_chunk``.

    q (scaled), k [B, T, H, Dk], v [B, T, H, Dv], beta [B, T, H] in float16/bfloat16/float32;
    S0 [B, H, Dk, Dv] float32; chunk_size <= 64, Dk <= 128. Returns (o [B, T, H, Dv] in q's
    dtype, S float32)."""
    (q, k, v, beta), S0, dims = _prepare(q, k, v, S0, beta)  # beta float32: one signature
    o, S = _FastWeightsTriton.apply(q, k, v, beta, S0, chunk_size, q.dtype)
    return _unpad(o, S, dims)
