"""Triton kernels of the fused ops (ops/fused, docs/kernels.md "The gated-delta layer's fused
elementwise kernels"): the causal depthwise short convolution with SiLU and the L2 norm of its
leading heads, and the gated RMSNorm, forward and backward, on the layer's bfloat16/float16
tensors read in place (strided views of the input projections' product).

Dimension legend: B batch, T tokens, C channels, W taps (``conv_size``), G the channels of a
group (a head of ``head_dim`` channels; each program holds whole groups), n the L2-normalised
leading groups; for the norm N rows of D, the rows numbered (outer, inner) so that a
[B, T, H, D] view of a wider tensor is read where it lies.

forward   ``_conv_fwd_kernel``   per (row block, group, batch row): a = bias + sum_j w_j
                                 full[t + j] (full = the W - 1 carried inputs, then x),
                                 s = silu(a), y = s / sqrt(sum_G s^2 + eps) in the first n
                                 groups, s elsewhere
backward  ``_conv_bwd_kernel``   per (block of full rows, group, batch row): dfull[f] =
                                 sum_j da[f - j] w_j, da recomputed at the W shifted row
                                 blocks (no halo exchange, no atomics); stores dx, the carried
                                 inputs' gradient, and per program the partial sums of dw and
                                 dbias (the host adds them)
forward   ``_norm_fwd_kernel``   per block of rows: y = x r w act(g), r = (mean x^2 + eps)^-1/2
backward  ``_norm_bwd_kernel``   dx = r dn - x r^3 sum(dn x) / D with dn = dy act(g) w,
                                 dg = dy x r w act'(g), partial sums of dw per program

Precision: inputs in their own dtype, everything computed in float32 (in float64 for float64
inputs, which only the tests run, under the interpreter), outputs rounded once. This module
imports ``triton`` at import time; ops/fused imports it lazily.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._triton_common import _arch

__all__ = ["MAX_GROUP", "OPS", "Tiles", "rms_norm_gated_triton", "short_conv_silu_triton",
           "supports", "tile_config"]

OPS = ("short_conv_silu", "rms_norm_gated")
MAX_GROUP = 256  # the largest group (head) a program of the convolution holds whole
NORM_BD = 128  # the norm's column block: rows longer than it run in steps of it
ACTS = {"silu": 1, "swish": 1, "sigmoid": 2}  # ACT: 0 no gate


class Tiles(NamedTuple):
    """A kernel pair's tiles: BR rows (BRB in the backward), BD channels, warps."""

    BR: int
    BD: int
    warps: int
    BRB: int


def tile_config(arch: int, dtype: torch.dtype, op: str, group: int = 64) -> Tiles | None:
    """The tiles of ``op`` for a target (sm_80, sm_90; the same on both) and input dtype, or
    None where the dispatcher keeps the call in PyTorch (float32: the layers' reference path).
    The convolution holds a group of ``group`` channels whole (BD the next power of two, at
    least 16) and 2048 elements per tile in the forward (BR rows, at most 64), 512 in the
    backward (BRB), which recomputes the forward at W shifted row blocks, with 4 warps; at
    BD = 256, 1024 in the backward and 8 warps. The norm steps through a row in blocks of 128
    columns, 16 rows at a time (8 in the backward), 4 warps. Every launch compiles without
    spills on sm_80 and sm_90 under Triton 3.6, 3.8 and 3.9 (docs/kernels.md)."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    if op == "rms_norm_gated":
        return Tiles(16, NORM_BD, 4, 8)
    BD = max(16, triton.next_power_of_2(group))
    if BD >= 256:  # 8 warps: 4 warps spilled in the backward under Triton 3.6 / 3.8
        return Tiles(2048 // BD, BD, 8, 1024 // BD)
    return Tiles(min(64, 2048 // BD), BD, 4, min(64, 512 // BD))


def supports(op: str, dtype: torch.dtype) -> bool:
    """Whether ``op`` has a tiling for ``dtype`` on every target."""
    return all(tile_config(arch, dtype, op) is not None for arch in (80, 90))


# ---------------------------------------------------------------------------------------------
# The short convolution


@triton.jit
def _full_rows(x_ptr, p_ptr, b, f0, cols, cmask, T, sxb, sxt, spb, spc, W,
               BR: tl.constexpr):
    """Rows f0 .. f0 + BR - 1 of full = [the W - 1 carried inputs p [B, C, W - 1], x [B, T, C]]
    (row f is p[:, :, f] for f < W - 1, x[:, f - W + 1] up to W - 1 + T), channels ``cols``,
    in the compute dtype (p's); zero elsewhere."""
    f = f0 + tl.arange(0, BR)
    src = f - (W - 1)
    ok = (src >= 0) & (src < T)
    v = tl.load(x_ptr + tl.cast(b, tl.int64) * sxb + src[:, None] * sxt + cols[None, :],
                mask=ok[:, None] & cmask[None, :], other=0.0).to(p_ptr.dtype.element_ty)
    pm = (f >= 0) & (f < W - 1)
    v += tl.load(p_ptr + tl.cast(b, tl.int64) * spb + cols[None, :] * spc + f[:, None],
                 mask=pm[:, None] & cmask[None, :], other=0.0)
    return v


@triton.jit
def _conv_rows(x_ptr, p_ptr, w_ptr, bias_ptr, b, t0, cols, cmask, T, sxb, sxt, spb, spc,
               W, BR: tl.constexpr, BD: tl.constexpr):
    """a[t] = bias + sum_j w_j full[t + j] at rows t0 .. t0 + BR - 1, channels ``cols`` (the
    compute dtype)."""
    a = tl.zeros([BR, BD], dtype=p_ptr.dtype.element_ty)
    for j in range(W):  # a loop, not unrolled: the taps' loads are not all held at once
        wj = tl.load(w_ptr + cols * W + j, mask=cmask, other=0.0)
        a += wj[None, :] * _full_rows(x_ptr, p_ptr, b, t0 + j, cols, cmask, T, sxb, sxt, spb,
                                      spc, W, BR)
    return a + tl.load(bias_ptr + cols, mask=cmask, other=0.0)[None, :]


@triton.jit
def _conv_fwd_kernel(x_ptr, p_ptr, w_ptr, bias_ptr, y_ptr, T, C, G, n_norm, eps,
                     sxb, sxt, spb, spc, W: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    i_t, i_g, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t = i_t * BR + tl.arange(0, BR)
    d = tl.arange(0, BD)
    cols = i_g * G + d
    cmask = (d < G) & (cols < C)
    a = _conv_rows(x_ptr, p_ptr, w_ptr, bias_ptr, b, i_t * BR, cols, cmask, T, sxb, sxt, spb,
                   spc, W, BR, BD)
    s = a * tl.sigmoid(a)
    r = tl.rsqrt(tl.sum(s * s, axis=1) + eps)
    y = s * tl.where(i_g < n_norm, r, 1.0)[:, None]
    rows = tl.cast(b, tl.int64) * T + t
    tl.store(y_ptr + rows[:, None] * C + cols[None, :], y.to(y_ptr.dtype.element_ty),
             mask=(t < T)[:, None] & cmask[None, :])


@triton.jit
def _conv_da(x_ptr, p_ptr, w_ptr, bias_ptr, dy_ptr, b, t0, cols, cmask, T, C, eps, norm,
             sxb, sxt, spb, spc, W, BR: tl.constexpr, BD: tl.constexpr):
    """The gradient of the convolution's output a at rows t0 .. t0 + BR - 1 (zero outside
    0 <= t < T): the forward recomputed, then back through the L2 norm (``norm``) and the
    SiLU."""
    a = _conv_rows(x_ptr, p_ptr, w_ptr, bias_ptr, b, t0, cols, cmask, T, sxb, sxt, spb, spc,
                   W, BR, BD)
    t = t0 + tl.arange(0, BR)
    ok = (t >= 0) & (t < T)
    rows = tl.cast(b, tl.int64) * T + t
    dy = tl.load(dy_ptr + rows[:, None] * C + cols[None, :], mask=ok[:, None] & cmask[None, :],
                 other=0.0).to(a.dtype)
    sg = tl.sigmoid(a)
    s = a * sg
    r = tl.rsqrt(tl.sum(s * s, axis=1) + eps)[:, None]
    y = s * r
    ds = tl.where(norm, (dy - y * tl.sum(dy * y, axis=1)[:, None]) * r, dy)
    da = ds * (sg * (1.0 + a * (1.0 - sg)))
    return tl.where(ok[:, None], da, 0.0)


@triton.jit
def _conv_bwd_kernel(x_ptr, p_ptr, w_ptr, bias_ptr, dy_ptr, dx_ptr, dp_ptr, dw_ptr, db_ptr,
                     T, C, G, n_norm, eps, sxb, sxt, spb, spc, steps, W,
                     BR: tl.constexpr, BD: tl.constexpr):
    """Program (i_s, i_g, b) runs ``steps`` blocks of BR rows of full (W - 1 + T rows) from
    block i_s * steps; dw_ptr [B * cdiv(n_blocks, steps), W, C] and db_ptr [.., C] (zeros)
    accumulate its partial sums (float32, or float64 under the tests)."""
    i_s, i_g, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    d = tl.arange(0, BD)
    cols = i_g * G + d
    cmask = (d < G) & (cols < C)
    norm = i_g < n_norm
    part = tl.cast(b, tl.int64) * tl.num_programs(0) + i_s
    dw_row = dw_ptr + part * W * C + cols
    for i in range(steps):
        f0 = (i_s * steps + i) * BR
        f = f0 + tl.arange(0, BR)
        # tap 0: the outputs t = f (each output row once over the programs): dw, dbias
        da = _conv_da(x_ptr, p_ptr, w_ptr, bias_ptr, dy_ptr, b, f0, cols, cmask, T, C, eps,
                      norm, sxb, sxt, spb, spc, W, BR, BD)
        db = tl.load(db_ptr + part * C + cols, mask=cmask, other=0.0)
        tl.store(db_ptr + part * C + cols, db + tl.sum(da, axis=0), mask=cmask)
        for k in range(W):  # this program's own rows of dw: read, add, write
            xk = _full_rows(x_ptr, p_ptr, b, f0 + k, cols, cmask, T, sxb, sxt, spb, spc, W, BR)
            dwk = tl.load(dw_row + k * C, mask=cmask, other=0.0)
            tl.store(dw_row + k * C, dwk + tl.sum(da * xk, axis=0), mask=cmask)
        dfull = da * tl.load(w_ptr + cols * W, mask=cmask, other=0.0)[None, :]
        for j in range(1, W):  # full row f feeds the outputs t = f - j through tap j
            da = _conv_da(x_ptr, p_ptr, w_ptr, bias_ptr, dy_ptr, b, f0 - j, cols, cmask, T, C,
                          eps, norm, sxb, sxt, spb, spc, W, BR, BD)
            dfull += da * tl.load(w_ptr + cols * W + j, mask=cmask, other=0.0)[None, :]
        src = f - (W - 1)
        tl.store(dx_ptr + (tl.cast(b, tl.int64) * T + src)[:, None] * C + cols[None, :],
                 dfull.to(dx_ptr.dtype.element_ty),
                 mask=((src >= 0) & (src < T))[:, None] & cmask[None, :])
        tl.store(dp_ptr + tl.cast(b, tl.int64) * C * (W - 1) + cols[None, :] * (W - 1)
                 + f[:, None], dfull, mask=((f >= 0) & (f < W - 1))[:, None] & cmask[None, :])


class _ConvLaunch(NamedTuple):
    tiles: Tiles
    W: int
    G: int
    n_norm: int
    eps: float


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """x with a unit last stride at a 16-byte aligned address (a copy where it has neither):
    what the compiled specialisations assume (tests/ops/triton_aot_fused.py)."""
    if x.stride(-1) != 1 or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)
    return x


def _backward_steps(blocks: int, programs: int) -> int:
    """Row blocks per backward program: enough programs to fill the GPU (about 2048) with as
    few partial sums as that allows."""
    return max(1, min(16, blocks * programs // 2048))


class _ShortConvTriton(torch.autograd.Function):
    """The kernels always read a carried past and a bias (zeros where the call has none: a
    [B, C, W - 1] and a [C] tensor), so one specialisation serves every call."""

    @staticmethod
    def forward(ctx, x, past, weight, bias, L: _ConvLaunch):  # type: ignore[override]
        B, T, C = x.shape
        ct = torch.float64 if x.dtype == torch.float64 else torch.float32
        x = _aligned(x)
        w = weight.reshape(C, L.W).to(ct).contiguous()
        bb = x.new_zeros(C, dtype=ct) if bias is None else bias.to(ct).contiguous()
        p = (x.new_zeros(B, C, L.W - 1, dtype=ct) if past is None
             else past.to(ct).contiguous())
        y = torch.empty(B, T, C, dtype=x.dtype, device=x.device)
        BR, BD, warps, _ = L.tiles
        _conv_fwd_kernel[(triton.cdiv(T, BR), triton.cdiv(C, L.G), B)](
            x, p, w, bb, y, T, C, L.G, L.n_norm, L.eps, x.stride(0), x.stride(1), p.stride(0),
            L.W - 1, W=L.W, BR=BR, BD=BD, num_warps=warps)
        ctx.save_for_backward(x, p, w, bb)
        ctx.L = L
        ctx.dtypes = (None if past is None else past.dtype, weight.dtype, weight.shape,
                      None if bias is None else bias.dtype)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):  # type: ignore[override]
        x, p, w, bb = ctx.saved_tensors
        L = ctx.L
        B, T, C = x.shape
        dy = dy.contiguous()
        _, BD, warps, BR = L.tiles
        groups = triton.cdiv(C, L.G)
        blocks = triton.cdiv(T + L.W - 1, BR)
        steps = _backward_steps(blocks, groups * B)
        n_prog = triton.cdiv(blocks, steps)
        dx = torch.empty(B, T, C, dtype=x.dtype, device=x.device)
        dp = torch.empty_like(p)
        dw = torch.zeros(B * n_prog, L.W, C, dtype=w.dtype, device=x.device)
        db = torch.zeros(B * n_prog, C, dtype=w.dtype, device=x.device)
        _conv_bwd_kernel[(n_prog, groups, B)](
            x, p, w, bb, dy, dx, dp, dw, db, T, C, L.G, L.n_norm, L.eps, x.stride(0),
            x.stride(1), p.stride(0), L.W - 1, steps, L.W, BR=BR, BD=BD, num_warps=warps)
        past_dtype, w_dtype, w_shape, b_dtype = ctx.dtypes
        return (dx, None if past_dtype is None else dp.to(past_dtype),
                dw.sum(0).t().reshape(w_shape).to(w_dtype),
                None if b_dtype is None else db.sum(0).to(b_dtype), None)


def short_conv_silu_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           past: torch.Tensor | None, n: int, head_dim: int, eps: float
                           ) -> torch.Tensor:
    """``short_conv_silu`` on the kernels (arguments checked by the op): x [B, T, C] (any
    strides with a unit channel stride), weight [C, 1, W] or [C, W], bias [C] or None, past
    [B, C, W - 1] or None; the first n channels L2-normalised in heads of ``head_dim``
    -> y [B, T, C] in x's dtype. Groups of ``head_dim`` channels (64 without a norm)."""
    G = head_dim if n else 64
    tiles = (tile_config(_arch(x.device), x.dtype, "short_conv_silu", G)
             or tile_config(80, torch.bfloat16, "short_conv_silu", G))
    L = _ConvLaunch(tiles, weight.shape[-1], G, n // G if n else 0, eps)
    return _ShortConvTriton.apply(x, past, weight, bias, L)


# ---------------------------------------------------------------------------------------------
# The gated RMSNorm


@triton.jit
def _act(g, ACT: tl.constexpr):
    """act(g) and act'(g): SiLU (ACT 1) or the sigmoid (ACT 2)."""
    sg = tl.sigmoid(g)
    if ACT == 1:
        return g * sg, sg * (1.0 + g * (1.0 - sg))
    return sg, sg * (1.0 - sg)


@triton.jit
def _row_ptrs(ptr, n, inner_n, s_outer, s_inner):
    """The first element of each row n = outer * inner_n + inner of a strided tensor."""
    outer = n // inner_n
    return ptr + tl.cast(outer, tl.int64) * s_outer + (n - outer * inner_n) * s_inner


@triton.jit
def _norm_fwd_kernel(x_ptr, g_ptr, w_ptr, y_ptr, N, D, inner_n, sxo, sxi, sgo, sgi, eps,
                     ACT: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    n = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = n < N
    xr = _row_ptrs(x_ptr, n, inner_n, sxo, sxi)
    ct = w_ptr.dtype.element_ty
    ssq = tl.zeros([BR], dtype=ct)
    for c0 in range(0, D, BD):
        cols = c0 + tl.arange(0, BD)
        m = rmask[:, None] & (cols < D)[None, :]
        x = tl.load(xr[:, None] + cols[None, :], mask=m, other=0.0).to(ct)
        ssq += tl.sum(x * x, axis=1)
    r = tl.rsqrt(ssq / D + eps)
    gr = _row_ptrs(g_ptr, n, inner_n, sgo, sgi)
    for c0 in range(0, D, BD):
        cols = c0 + tl.arange(0, BD)
        m = rmask[:, None] & (cols < D)[None, :]
        x = tl.load(xr[:, None] + cols[None, :], mask=m, other=0.0).to(ct)
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0)
        y = x * r[:, None] * w[None, :]
        if ACT != 0:
            g = tl.load(gr[:, None] + cols[None, :], mask=m, other=0.0).to(ct)
            y = y * _act(g, ACT)[0]
        tl.store(y_ptr + tl.cast(n, tl.int64)[:, None] * D + cols[None, :],
                 y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _norm_bwd_kernel(x_ptr, g_ptr, w_ptr, dy_ptr, dx_ptr, dg_ptr, dw_ptr, N, D, inner_n,
                     sxo, sxi, sgo, sgi, eps, ACT: tl.constexpr, BR: tl.constexpr,
                     BD: tl.constexpr):
    """dw_ptr [programs, D] takes each program's partial sums of dw."""
    n = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = n < N
    xr = _row_ptrs(x_ptr, n, inner_n, sxo, sxi)
    gr = _row_ptrs(g_ptr, n, inner_n, sgo, sgi)
    rows = tl.cast(n, tl.int64)[:, None] * D
    ct = w_ptr.dtype.element_ty
    ssq = tl.zeros([BR], dtype=ct)
    sdn = tl.zeros([BR], dtype=ct)
    for c0 in range(0, D, BD):
        cols = c0 + tl.arange(0, BD)
        m = rmask[:, None] & (cols < D)[None, :]
        x = tl.load(xr[:, None] + cols[None, :], mask=m, other=0.0).to(ct)
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0)
        dz = tl.load(dy_ptr + rows + cols[None, :], mask=m, other=0.0).to(ct)
        if ACT != 0:
            g = tl.load(gr[:, None] + cols[None, :], mask=m, other=0.0).to(ct)
            dz = dz * _act(g, ACT)[0]
        ssq += tl.sum(x * x, axis=1)
        sdn += tl.sum(dz * w[None, :] * x, axis=1)
    r = tl.rsqrt(ssq / D + eps)
    c = r * r * r * sdn / D
    for c0 in range(0, D, BD):
        cols = c0 + tl.arange(0, BD)
        m = rmask[:, None] & (cols < D)[None, :]
        x = tl.load(xr[:, None] + cols[None, :], mask=m, other=0.0).to(ct)
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0)
        dy = tl.load(dy_ptr + rows + cols[None, :], mask=m, other=0.0).to(ct)
        xn = x * r[:, None]
        dz = dy
        if ACT != 0:
            g = tl.load(gr[:, None] + cols[None, :], mask=m, other=0.0).to(ct)
            act, dact = _act(g, ACT)
            dz = dy * act
            tl.store(dg_ptr + rows + cols[None, :],
                     (dy * xn * w[None, :] * dact).to(dg_ptr.dtype.element_ty), mask=m)
        tl.store(dx_ptr + rows + cols[None, :],
                 (dz * w[None, :] * r[:, None] - x * c[:, None]).to(dx_ptr.dtype.element_ty),
                 mask=m)
        tl.store(dw_ptr + tl.program_id(0).to(tl.int64) * D + cols, tl.sum(dz * xn, axis=0),
                 mask=cols < D)


def _rows(u: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """u [..., D] as rows (outer, inner): (u with a unit last stride, inner count, outer
    stride, inner stride); inner rows are the next-to-last dim (heads), outer the ones before,
    which must flatten to one stride (a [B, T, H, D] slice of a wider [B, T, .] tensor does;
    otherwise u is copied)."""
    u = _aligned(u)
    for _ in range(2):
        v = u.reshape(1, 1, -1) if u.dim() == 1 else u.unsqueeze(0) if u.dim() == 2 else u
        try:
            flat = v.view(-1, v.shape[-2], v.shape[-1])
        except RuntimeError:
            u = u.contiguous()
            continue
        return u, flat.shape[1], flat.stride(0), flat.stride(1)
    raise AssertionError("a contiguous tensor flattens")


class _RMSNormGatedTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate, weight, eps, act, out_dtype):  # type: ignore[override]
        D = x.shape[-1]
        ct = torch.float64 if x.dtype == torch.float64 else torch.float32
        w = (torch.ones(D, dtype=ct, device=x.device) if weight is None
             else weight.to(ct).contiguous())
        x, inner, sxo, sxi = _rows(x)
        g, _, sgo, sgi = (x, inner, sxo, sxi) if gate is None else _rows(gate)
        N = x.numel() // D
        y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        tiles = (tile_config(_arch(x.device), x.dtype, "rms_norm_gated")
                 or tile_config(80, torch.bfloat16, "rms_norm_gated"))
        ACT = 0 if gate is None else ACTS[act]
        _norm_fwd_kernel[(triton.cdiv(N, tiles.BR),)](
            x, g, w, y, N, D, inner, sxo, sxi, sgo, sgi, eps, ACT=ACT, BR=tiles.BR,
            BD=tiles.BD, num_warps=tiles.warps)
        ctx.save_for_backward(x, g, w)
        ctx.meta = (tiles, ACT, eps, inner, sxo, sxi, sgo, sgi, gate is not None,
                    None if weight is None else weight.dtype)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):  # type: ignore[override]
        x, g, w = ctx.saved_tensors
        tiles, ACT, eps, inner, sxo, sxi, sgo, sgi, has_gate, w_dtype = ctx.meta
        D = x.shape[-1]
        N = x.numel() // D
        dy = dy.contiguous()
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        dg = torch.empty(g.shape, dtype=g.dtype, device=x.device) if has_gate else None
        programs = triton.cdiv(N, tiles.BRB)
        dw = torch.empty(programs, D, dtype=w.dtype, device=x.device)
        _norm_bwd_kernel[(programs,)](
            x, g, w, dy, dx, dx if dg is None else dg, dw, N, D, inner, sxo, sxi, sgo, sgi,
            eps, ACT=ACT, BR=tiles.BRB, BD=tiles.BD, num_warps=tiles.warps)
        return dx, dg, None if w_dtype is None else dw.sum(0).to(w_dtype), None, None, None


def rms_norm_gated_triton(x: torch.Tensor, weight: torch.Tensor | None,
                          gate: torch.Tensor | None, eps: float, activation: str,
                          out_dtype: torch.dtype) -> torch.Tensor:
    """``rms_norm_gated`` on the kernels (arguments checked by the op): x [..., D] and gate
    [..., D] or None read where they lie (the dims before the next-to-last must flatten to one
    stride, else they are copied), weight [D] or None -> [..., D] in ``out_dtype``."""
    return _RMSNormGatedTriton.apply(x, gate, weight, eps, activation, out_dtype)
