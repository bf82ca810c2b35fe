"""Triton forward kernels for the chunked fast-weight forms (SPEC.md 1.3 and the WY/UT form of 1.4).

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim, C chunk size,
N = ceil(T / C) chunks; BC, BK, BV the on-chip tile sizes (powers of two >= 16 covering C, Dk and
a block of Dv; the excess rows/columns are masked to zero, so neither T, C, Dk nor Dv has to be a
power of two or a multiple of anything).

Same signatures and returns as ``chunk.py``, with one difference in what the arguments are: q
(already multiplied by ``scale``), k, v (and beta) arrive in their original dtype (float16,
bfloat16 or float32) and are only upcast on chip, so the kernels read half the bytes for half
inputs; the states S0, z0 are float32 and every state, product and accumulation stays in float32.
Products of two input-dtype tiles (Q K^T, K^T V) run on tensor cores with float32 accumulation;
products with a float32 operand (the state, the scores, U) use ``input_precision="ieee"``, so
float32 inputs get exact float32 arithmetic (no TF32, like PyTorch's default).

One program per (batch * head, block of Dv columns) walks the chunks in order with its
``S[:, block]`` held on chip: the columns of S never mix (in the delta rule U = U0 - W S and
S += K^T U act column by column too), so the value blocks are independent programs.

The backward is NOT a fused kernel: each op is a ``torch.autograd.Function`` whose backward
recomputes the forward with the PyTorch chunk path (``chunk.py``) in float32 under
``enable_grad`` and returns autograd's gradients, which are exact for that form.
This module imports ``triton`` at import time; ``ops/fwp/__init__.py`` imports it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunk import _chunk_major, delta_rule_chunk, linear_attn_chunk

__all__ = ["delta_rule_triton", "linear_attn_triton"]


def _tile(n: int, cap: int | None = None) -> int:
    """Smallest power of two >= max(n, 16) (tl.dot needs >= 16), optionally capped."""
    size = max(16, triton.next_power_of_2(n))
    return size if cap is None else min(size, cap)


def _upcast_tiles(dtype: torch.dtype) -> bool:
    """Whether the kernels upcast their bfloat16 input tiles to float32 before tl.dot.

    Only under the CPU interpreter (TRITON_INTERPRET=1), whose bfloat16 tl.dot returns garbage
    (Triton 3.9; float16 and float32 are right). The upcast computes the same thing: a product
    of two bfloat16 numbers is exact in float32, so the float32 dot differs from the tensor-core
    bfloat16 dot with float32 accumulation only in summation order."""
    return dtype == torch.bfloat16 and bool(triton.knobs.runtime.interpret)


def _input_precision(dtype: torch.dtype) -> str:
    """tl.dot precision for products of two input-dtype tiles: "ieee" (exact float32) for float32
    or upcast tiles; for half tiles the tensor-core default ("tf32", which names the float32
    mode and leaves float16/bfloat16 products as they are: exact, float32 accumulation)."""
    return "ieee" if dtype == torch.float32 or _upcast_tiles(dtype) else "tf32"


@triton.jit
def _linear_attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, s_ptr, z_ptr, o_ptr,
    T, H, Dk, Dv, C, eps,
    NORMALIZE: tl.constexpr, UPCAST: tl.constexpr, IN_PREC: tl.constexpr, BC: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
):
    """o_c = Q_c S + tril(Q_c K_c^T) V_c, then S += K_c^T V_c, chunk after chunk.

    q, k [B, T, H, Dk], v, o [B, T, H, Dv] contiguous; s [B, H, Dk, Dv] float32 holds S0 on entry
    and the final S on exit (each program owns its columns); z [B, H, Dk] float32 is read only."""
    pid_bh = tl.program_id(0)
    pid_v = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)  # int64: B*T*H*D may exceed 2^31
    h = pid_bh % H
    rc = tl.arange(0, BC)
    rk = tl.arange(0, BK)
    rv = pid_v * BV + tl.arange(0, BV)
    mk = rk < Dk
    mv = rv < Dv
    q_base = q_ptr + b * T * H * Dk + h * Dk
    k_base = k_ptr + b * T * H * Dk + h * Dk
    v_base = v_ptr + b * T * H * Dv + h * Dv
    o_base = o_ptr + b * T * H * Dv + h * Dv
    s_ptrs = s_ptr + pid_bh.to(tl.int64) * Dk * Dv + rk[:, None] * Dv + rv[None, :]
    ms = mk[:, None] & mv[None, :]
    S = tl.load(s_ptrs, mask=ms, other=0.0)  # [BK, BV] float32
    z = tl.load(z_ptr + pid_bh.to(tl.int64) * Dk + rk, mask=mk, other=0.0)  # [BK]
    causal = rc[:, None] >= rc[None, :]
    for c0 in range(0, T, C):
        rt = c0 + rc
        mt = (rc < C) & (rt < T)  # rows past the chunk or past T load as zeros: they add nothing
        qb = tl.load(q_base + rt[:, None] * H * Dk + rk[None, :], mask=mt[:, None] & mk[None, :],
                     other=0.0)
        kb = tl.load(k_base + rt[:, None] * H * Dk + rk[None, :], mask=mt[:, None] & mk[None, :],
                     other=0.0)
        vb = tl.load(v_base + rt[:, None] * H * Dv + rv[None, :], mask=mt[:, None] & mv[None, :],
                     other=0.0)
        if UPCAST:  # see _upcast_tiles
            qb, kb, vb = qb.to(tl.float32), kb.to(tl.float32), vb.to(tl.float32)
        scores = tl.dot(qb, tl.trans(kb), input_precision=IN_PREC)  # [BC, BC] float32
        scores = tl.where(causal, scores, 0.0)
        qf = qb.to(tl.float32)
        ob = tl.dot(qf, S, input_precision="ieee")
        ob += tl.dot(scores, vb.to(tl.float32), input_precision="ieee")
        if NORMALIZE:
            # The denominator reads z and the scores of the same (read-after-write) prefix as the
            # numerator: q . z_prev + sum_{s <= t in chunk} q_t . k_s.
            den = tl.sum(qf * z[None, :], axis=1) + tl.sum(scores, axis=1)
            ob = ob / (den + eps)[:, None]
            z += tl.sum(kb.to(tl.float32), axis=0)
        S += tl.dot(tl.trans(kb), vb, input_precision=IN_PREC)
        tl.store(o_base + rt[:, None] * H * Dv + rv[None, :], ob.to(o_ptr.dtype.element_ty),
                 mask=mt[:, None] & mv[None, :])
    tl.store(s_ptrs, S, mask=ms)


@triton.jit
def _delta_rule_fwd_kernel(
    q_ptr, k_ptr, w_ptr, u_ptr, s_ptr, o_ptr,
    T, H, BH, Dk, Dv, C,
    UPCAST: tl.constexpr, IN_PREC: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr,
):
    """Per chunk n: U = U0_n - W_n S; o_n = Q_n S + tril(Q_n K_n^T) U; S += K_n^T U.

    q, k [B, T, H, Dk], o [B, T, H, Dv] contiguous; w [N, B*H, C, Dk] and u [N, B*H, C, Dv]
    float32 (W and U0 of the UT transform); s [B, H, Dk, Dv] float32, S0 in and final S out."""
    pid_bh = tl.program_id(0)
    pid_v = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    bh = pid_bh.to(tl.int64)
    rc = tl.arange(0, BC)
    rk = tl.arange(0, BK)
    rv = pid_v * BV + tl.arange(0, BV)
    mk = rk < Dk
    mv = rv < Dv
    mcc = rc < C
    q_base = q_ptr + b * T * H * Dk + h * Dk
    k_base = k_ptr + b * T * H * Dk + h * Dk
    o_base = o_ptr + b * T * H * Dv + h * Dv
    s_ptrs = s_ptr + bh * Dk * Dv + rk[:, None] * Dv + rv[None, :]
    ms = mk[:, None] & mv[None, :]
    S = tl.load(s_ptrs, mask=ms, other=0.0)  # [BK, BV] float32
    causal = rc[:, None] >= rc[None, :]
    for c0 in range(0, T, C):
        rt = c0 + rc
        mt = mcc & (rt < T)
        qb = tl.load(q_base + rt[:, None] * H * Dk + rk[None, :], mask=mt[:, None] & mk[None, :],
                     other=0.0)
        kb = tl.load(k_base + rt[:, None] * H * Dk + rk[None, :], mask=mt[:, None] & mk[None, :],
                     other=0.0)
        if UPCAST:  # see _upcast_tiles
            qb, kb = qb.to(tl.float32), kb.to(tl.float32)
        chunk = (c0 // C) * BH + bh  # int64 through bh
        wb = tl.load(w_ptr + chunk * C * Dk + rc[:, None] * Dk + rk[None, :],
                     mask=mcc[:, None] & mk[None, :], other=0.0)
        ub = tl.load(u_ptr + chunk * C * Dv + rc[:, None] * Dv + rv[None, :],
                     mask=mcc[:, None] & mv[None, :], other=0.0)
        # The only state-dependent step of the UT form; W S is where the chunk reads the memory.
        U = ub - tl.dot(wb, S, input_precision="ieee")  # [BC, BV]
        scores = tl.where(causal, tl.dot(qb, tl.trans(kb), input_precision=IN_PREC), 0.0)
        ob = tl.dot(qb.to(tl.float32), S, input_precision="ieee")
        ob += tl.dot(scores, U, input_precision="ieee")
        S += tl.dot(tl.trans(kb.to(tl.float32)), U, input_precision="ieee")
        tl.store(o_base + rt[:, None] * H * Dv + rv[None, :], ob.to(o_ptr.dtype.element_ty),
                 mask=mt[:, None] & mv[None, :])
    tl.store(s_ptrs, S, mask=ms)


def _linear_attn_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S0: torch.Tensor, z0: torch.Tensor,
    normalize: bool, eps: float, chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    S = S0.to(torch.float32, copy=True).contiguous()  # the kernel overwrites it with the final S
    z0 = z0.to(torch.float32).contiguous()
    o = torch.empty(B, T, H, Dv, dtype=q.dtype, device=q.device)
    BV = _tile(Dv, 64)
    grid = (B * H, triton.cdiv(Dv, BV))
    _linear_attn_fwd_kernel[grid](
        q, k, v, S, z0, o, T, H, Dk, Dv, chunk_size, float(eps),
        NORMALIZE=normalize, UPCAST=_upcast_tiles(q.dtype), IN_PREC=_input_precision(q.dtype),
        BC=_tile(chunk_size), BK=_tile(Dk), BV=BV,
    )
    z = z0 + k.to(torch.float32).sum(dim=1)
    return o, S, z


def _delta_rule_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, S0: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    C = chunk_size
    q, k = q.contiguous(), k.contiguous()
    # The state-independent UT transform, batched over all chunks in float32 PyTorch (the same
    # arithmetic as chunk.py): Tm = (I + stril(diag(beta) K K^T))^-1 diag(beta), W = Tm K,
    # U0 = Tm V. Padded rows have beta = 0, so their rows of W and U0 are zero.
    kc = _chunk_major(k.to(torch.float32), C)  # [N, B*H, C, Dk]
    vc = _chunk_major(v.to(torch.float32), C)  # [N, B*H, C, Dv]
    bc = _chunk_major(beta.to(torch.float32).unsqueeze(-1), C)  # [N, B*H, C, 1]
    A = bc * (kc @ kc.transpose(-1, -2))
    Tm = torch.linalg.solve_triangular(A, torch.diag_embed(bc.squeeze(-1)), upper=False,
                                       unitriangular=True)
    W, U0 = (Tm @ kc).contiguous(), (Tm @ vc).contiguous()
    S = S0.to(torch.float32, copy=True).contiguous()
    o = torch.empty(B, T, H, Dv, dtype=q.dtype, device=q.device)
    BV = _tile(Dv, 64)
    grid = (B * H, triton.cdiv(Dv, BV))
    _delta_rule_fwd_kernel[grid](
        q, k, W, U0, S, o, T, H, B * H, Dk, Dv, C,
        UPCAST=_upcast_tiles(q.dtype), IN_PREC=_input_precision(q.dtype), BC=_tile(C),
        BK=_tile(Dk), BV=BV,
    )
    return o, S


def _grads(outputs: tuple[torch.Tensor, ...], grad_outputs: tuple[torch.Tensor | None, ...],
           inputs: tuple[torch.Tensor, ...], originals: tuple[torch.Tensor, ...],
           needs: tuple[bool, ...]) -> list[torch.Tensor | None]:
    """autograd.grad of the recomputed outputs, cast back to each original input's dtype."""
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if g is not None]
    wanted = [x for x, need in zip(inputs, needs) if need]
    if not pairs or not wanted:
        return [None] * len(inputs)
    got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs],
                                   allow_unused=True))
    out: list[torch.Tensor | None] = []
    for _x, orig, need in zip(inputs, originals, needs):
        g = next(got) if need else None
        out.append(None if g is None else g.to(orig.dtype))
    return out


class _LinearAttnTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, S0, z0, normalize, eps, chunk_size):  # type: ignore[override]
        ctx.save_for_backward(q, k, v, S0, z0)
        ctx.args = (normalize, eps, chunk_size)
        return _linear_attn_forward(q, k, v, S0, z0, normalize, eps, chunk_size)

    @staticmethod
    def backward(ctx, do, dS, dz):  # type: ignore[override]
        originals = ctx.saved_tensors
        with torch.enable_grad():
            inputs = tuple(x.detach().to(torch.float32).requires_grad_() for x in originals)
            outs = linear_attn_chunk(*inputs, *ctx.args)
        return (*_grads(outs, (do, dS, dz), inputs, originals, ctx.needs_input_grad[:5]),
                None, None, None)


class _DeltaRuleTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, beta, S0, chunk_size):  # type: ignore[override]
        ctx.save_for_backward(q, k, v, beta, S0)
        ctx.chunk_size = chunk_size
        return _delta_rule_forward(q, k, v, beta, S0, chunk_size)

    @staticmethod
    def backward(ctx, do, dS):  # type: ignore[override]
        originals = ctx.saved_tensors
        with torch.enable_grad():
            inputs = tuple(x.detach().to(torch.float32).requires_grad_() for x in originals)
            outs = delta_rule_chunk(*inputs, ctx.chunk_size)
        return (*_grads(outs, (do, dS), inputs, originals, ctx.needs_input_grad[:5]), None)


def linear_attn_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S0: torch.Tensor, z0: torch.Tensor,
    normalize: bool, eps: float, chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chunked linear attention (SPEC 1.3) as a Triton kernel; see ``chunk.linear_attn_chunk``.

    q (scaled), k [B, T, H, Dk], v [B, T, H, Dv] in float16/bfloat16/float32; S0 [B, H, Dk, Dv]
    and z0 [B, H, Dk] float32. Returns (o [B, T, H, Dv] in q's dtype, S, z in float32).
    With ``normalize`` the running z is a separate float32 vector on chip (the chunk.py trick of
    an extra value column would cost a whole extra BV block for one column)."""
    return _LinearAttnTriton.apply(q, k, v, S0, z0, normalize, eps, chunk_size)


def delta_rule_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, S0: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked delta rule, WY/UT form (SPEC 1.4); see ``chunk.delta_rule_chunk``.

    q (scaled), k [B, T, H, Dk], v [B, T, H, Dv], beta [B, T, H] in float16/bfloat16/float32;
    S0 [B, H, Dk, Dv] float32. The batched, state-independent part (Tm, W = Tm K, U0 = Tm V) is
    float32 PyTorch (a triangular solve per chunk, already parallel over all chunks); the
    sequential chunk recurrence, the part that is a Python loop of small launches in chunk.py, is
    the kernel. Returns (o [B, T, H, Dv] in q's dtype, S float32)."""
    return _DeltaRuleTriton.apply(q, k, v, beta, S0, chunk_size)
