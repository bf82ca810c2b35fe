"""Chunked parallel forms of the fast-weight family (docs/maths.md 1.3 and the WY/UT form of 1.4).

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim, C chunk size,
N number of chunks. Inputs ``[B, T, H, D]`` in the compute dtype with q already scaled; states
``S [B, H, Dk, Dv]``, ``z [B, H, Dk]``. T need not be a multiple of C: the tail is zero-padded,
and zero keys/values/betas write nothing, so padding never changes the state.

``products``: None (every product in the compute dtype), or torch.bfloat16 for the CPU
bfloat16 path (ops/_autocast.py, float32 inputs only): the large products outside the state
recursion (a chunk's K^T V or U0 is added to a state, never multiplied by it) take bfloat16
operands, and their results are widened to float32 before anything is added to them. PyTorch's CPU matmul reduces bfloat16 products in float32 but rounds
its result to bfloat16 (it has no wider output for bfloat16 operands: ``out_dtype`` is
CUDA-only), so each product's result carries one bfloat16 rounding on top of its operands'.
States, their hand-off between chunks, the delta rule's K K^T and triangular solve, and the
normalisers stay float32: the error is that of one bfloat16 rounding per product, not one that
grows with the number of chunks as a bfloat16 state's would.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def _to_chunks(x: torch.Tensor, C: int) -> torch.Tensor:
    """[B, T, H, *rest] -> [B, H, N, C, *rest], zero-padding T up to N*C."""
    B, T, H = x.shape[:3]
    N = -(-T // C)
    x = x.movedim(1, 2)  # [B, H, T, ...]
    if N * C != T:
        pad = [0, 0] * (x.dim() - 3) + [0, N * C - T]
        x = F.pad(x, pad)
    return x.reshape(B, H, N, C, *x.shape[3:])


def _from_chunks(x: torch.Tensor, T: int) -> torch.Tensor:
    """[B, H, N, C, D] -> [B, T, H, D], dropping the padded tail."""
    B, H, N, C, D = x.shape
    return x.reshape(B, H, N * C, D)[:, :, :T].transpose(1, 2)


def _chunk_major(x: torch.Tensor, C: int) -> torch.Tensor:
    """[B, T, H, D] -> [N, B*H, C, D] (one copy, contiguous), zero-padding T up to N*C.
    Chunk-major so that each chunk of the sequential state hand-off is one contiguous batch of
    matrices. Contiguous also for B = 1, where the reshape alone would be a strided view: every
    matmul folding [N, B*H] into one batch dimension would then copy it again."""
    B, T, H, D = x.shape
    N = -(-T // C)
    if N * C != T:
        x = F.pad(x, (0, 0, 0, 0, 0, N * C - T))
    return x.reshape(B, N, C, H, D).permute(1, 0, 3, 2, 4).reshape(N, B * H, C, D).contiguous()


def _from_chunk_major(x: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """[N, B*H, C, D] -> [B, T, H, D] (a view), dropping the padded tail."""
    N, BH, C, D = x.shape
    H = BH // B
    return x.reshape(N, B, H, C, D).permute(1, 0, 3, 2, 4).reshape(B, N * C, H, D)[:, :T]


def _head_slices(x: torch.Tensor, C: int) -> tuple[torch.Tensor, ...]:
    """[B, T, H, D] -> H tensors [B*N, C, D]: per head, every chunk of every sequence as one
    batch of C x D matrices. Views with a single batch stride, which batched matmuls read in
    place, so no layout copy is made (zero-padding T up to N*C, where needed, is the only one).
    ``unbind`` rather than indexing: its backward is one stack, not H scatters into zeros."""
    B, T, H, D = x.shape
    N = -(-T // C)
    if N * C != T:
        x = F.pad(x, (0, 0, 0, 0, 0, N * C - T))
    return x.reshape(B * N, C, H, D).unbind(2)


def _per_head(
    H: int, shape: tuple[int, ...], like: torch.Tensor, differentiable: bool,
    fn: Callable[[int, torch.Tensor | None], torch.Tensor],
) -> torch.Tensor:
    """[H, *shape]: the stack of ``fn(h, out)`` over heads. Without autograd every head's
    result is written by ``fn`` straight into its slot ``out`` of one buffer (no stack copy);
    with it ``out`` is None and the results are stacked."""
    if differentiable:
        return torch.stack([fn(h, None) for h in range(H)])
    buf = like.new_empty(H, *shape)
    for h in range(H):
        fn(h, buf[h])
    return buf


def _merge_heads(o: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """[H, B*N, C, D] -> [B, T, H, D]: a view, dropping the padded tail. Its consumer merges
    the heads with one copy either way."""
    H, D = o.shape[0], o.shape[-1]
    return o.view(H, B, -1, D)[:, :, :T].permute(1, 2, 0, 3)


def _matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b in float32/float64, into ``out`` when given. bfloat16 operands (the CPU bfloat16
    path) give a bfloat16-rounded result, widened exactly here (see the module docstring)."""
    if a.dtype != torch.bfloat16:
        return torch.matmul(a, b, out=out)
    ab = a @ b
    return ab.float() if out is None else out.copy_(ab)


def _low(x: torch.Tensor, products: torch.dtype | None) -> torch.Tensor:
    """x as a product operand: rounded to ``products`` (None: unchanged)."""
    return x if products is None else x.to(products)


def _entering_states(
    first: torch.Tensor, per_chunk: torch.Tensor, decay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The states entering each chunk and the final one, for S_{n+1} = decay_n S_n + U_n:
    first [H, B, *s], per_chunk U [H, B, N, *s], decay None (1) or [N, H, 1, ...] broadcasting
    against [H, B, *s]. Returns (entering [H, B, N, *s], final [H, B, *s]).

    A loop of N elementwise steps: cumsum along a middle dimension is several times slower on
    CPU. Without autograd the steps write straight into the stacked result."""
    N = per_chunk.shape[2]

    def step(n: int, S: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if decay is None:
            return torch.add(per_chunk[:, :, n], S, out=out)
        return torch.addcmul(per_chunk[:, :, n], decay[n], S, out=out)

    # The in-place path below writes through non-contiguous out= views, which torch.compile
    # cannot trace: traced programs take the out-of-place path (same values).
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (first, per_chunk, decay)
    )):
        if decay is None:  # one cumsum: a short autograd graph (its backward is one more)
            entering = torch.cat([first.unsqueeze(2), per_chunk[:, :, :-1]], dim=2).cumsum(dim=2)
            return entering, entering[:, :, -1] + per_chunk[:, :, -1]
        states = [first]
        for n in range(N):
            states.append(step(n, states[-1]))
        return torch.stack(states[:-1], dim=2), states[-1]
    entering = per_chunk.new_empty(per_chunk.shape)
    entering[:, :, 0] = first
    for n in range(N - 1):
        step(n, entering[:, :, n], out=entering[:, :, n + 1])
    return entering, step(N - 1, entering[:, :, N - 1])


def linear_attn_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S0: torch.Tensor, z0: torch.Tensor,
    normalize: bool, eps: float, chunk_size: int, products: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Intra-chunk tril(Q_c K_c^T) V_c plus inter-chunk Q_c S_prev; with ``normalize`` the
    denominator is q_t . z_prev + the row sum of tril(Q_c K_c^T) (the same scores).

    Per head, each product is one batched matmul over all chunks, read in place from the
    [B, T, H, D] inputs (``_head_slices``); only the prefix sum of the chunk states is a loop.
    With ``products`` (bfloat16) the four products (K^T V, Q K^T, scores V, Q S_prev) take
    bfloat16 operands; the chunk states are summed in float32, and the denominator is
    q_t . z_t with z_t = z_prev + the running key sum, all float32 (the scores it would
    otherwise sum are bfloat16-rounded)."""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    C = chunk_size
    N = -(-T // C)
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, S0, z0))
    qs, ks, vs = (_head_slices(x, C) for x in (q, k, v))  # H x [B*N, C, D]
    # The product operands (the same slices without ``products``): converted once, here.
    ql, kl, vl = (qs, ks, vs) if products is None else (
        _head_slices(x.to(products), C) for x in (q, k, v))
    U = _per_head(H, (B * N, Dk, Dv), q, grad,  # each chunk's K^T V
                  lambda h, out: _matmul(kl[h].transpose(-1, -2), vl[h], out=out))
    S_in, S = _entering_states(S0.transpose(0, 1), U.view(H, B, N, Dk, Dv))
    S_in = S_in.view(H, B * N, Dk, Dv)
    S_inl = _low(S_in, products)
    if normalize:
        z_per = torch.stack([kh.sum(dim=1) for kh in ks]).view(H, B, N, Dk)  # chunk key sums
        z_in, z = _entering_states(z0.transpose(0, 1), z_per)
        z_in = z_in.view(H, B * N, 1, Dk)

    def head(h: int, out: torch.Tensor | None) -> torch.Tensor:
        scores = (ql[h] @ kl[h].transpose(-1, -2)).tril_()  # [B*N, C, C]
        if products is None:
            # Q S_prev + tril(Q K^T) V, accumulated in place: baddbmm into a separate output
            # would first copy its addend there.
            o = torch.matmul(qs[h], S_in[h], out=out).baddbmm_(scores, vs[h])
        else:  # both terms widened to float32 before they are added
            o = _matmul(ql[h], S_inl[h], out=out).add_(scores @ vl[h])
        if not normalize:
            return o
        if products is None:
            # q . z_prev as a product and a sum: a [C, Dk] x [Dk, 1] matmul per chunk is slower.
            den = (qs[h] * z_in[h]).sum(dim=-1, keepdim=True) + scores.sum(dim=-1, keepdim=True)
        else:
            den = (qs[h] * (z_in[h] + ks[h].cumsum(dim=1))).sum(dim=-1, keepdim=True)
        return o.div_(den.add_(eps)) if out is not None else o / (den + eps)

    o = _merge_heads(_per_head(H, (B * N, C, Dv), q, grad, head), B, T)
    S = S.transpose(0, 1)
    z = z.transpose(0, 1) if normalize else z0 + k.sum(dim=1)
    return o, S, z


def delta_rule_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, S: torch.Tensor,
    chunk_size: int, products: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """WY/UT form (docs/maths.md 1.4): per chunk, with A = stril(diag(beta) K K^T), X = (I + A)^-1
    and Tm = X diag(beta), W = Tm K and U0 = Tm V (batched over all chunks); then sequentially
    U = U0 - W S, S <- S + K^T U (two fused multiply-adds per chunk, the only Python loop);
    finally, batched again, O = Q S_entering + tril(Q K^T) U.

    The backward pass is written out (``_DeltaRuleChunk``): autograd would keep about 19
    [T, H, D]-sized tensors per call; this keeps q, k, v, beta, X and the chunk-entering states
    (about 5) and recomputes W, U0 and U with three batched products.

    With ``products`` (bfloat16) the batched products that feed no state recursively take
    bfloat16 operands: U0 = Tm V, Q K^T, tril(Q K^T) U and Q S_entering, and in the backward
    the matching ones (see ``_DeltaRuleChunk``). Float32 stay: K K^T and the solve X (the
    solve's forward error is its condition number times its input's: keep the input exact),
    W = Tm K and the sequential hand-off U = U0 - W S, S <- S + K^T U. W multiplies the state in
    every hand-off, so its rounding enters each chunk's transition (I - K^T W), whose error the
    state carries into every later chunk (measured: docs/performance.md); U0 only adds to U, so
    its rounding is a per-chunk error like the others'."""
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    qc, kc, vc = (_chunk_major(x, chunk_size) for x in (q, k, v))  # [N, B*H, C, D]
    bc = _chunk_major(beta.unsqueeze(-1), chunk_size)  # [N, B*H, C, 1]
    o, S = _DeltaRuleChunk.apply(qc, kc, vc, bc, S.reshape(B * H, Dk, Dv), products)
    return _from_chunk_major(o, B, T), S.reshape(B, H, Dk, Dv)


def _delta_wy(kc: torch.Tensor, bc: torch.Tensor) -> torch.Tensor:
    """X = (I + stril(diag(beta) K K^T))^-1 per chunk: [N, BH, C, C] (``unit_lower_inverse``)."""
    return unit_lower_inverse(bc * (kc @ kc.transpose(-1, -2)), overwrite=True)


# Diagonal blocks of this size are inverted by the triangular solve; larger ones are merged
# from two halves by products (``unit_lower_inverse``).
_SOLVE_BLOCK = 16


def unit_lower_inverse(A: torch.Tensor, overwrite: bool = False) -> torch.Tensor:
    """(I + stril(A))^-1 for a batch of square matrices A [..., n, n]: only the strictly lower
    triangle of A is read (the diagonal is taken as 1), so neither a mask nor the identity is
    built into A. No pivoting: unitriangular, the inverse is exact.

    Without autograd, for n = 16 * 2^j > 16, by blocks: the 16 x 16 diagonal blocks in one
    batched triangular solve, then halves merged upwards, [[X11, 0], [A21, X22]] inverting to
    [[X11, 0], [-X22 A21 X11, X22]], every merge one batched product over all blocks of its
    size. The solve's LAPACK calls go matrix by matrix and barely use a second thread; the blocks
    are faster at one thread and at two (docs/performance.md). With a gradient to record (double
    backward of the chunked forms), or another n, the plain solve. ``overwrite``: A is a scratch
    matrix of the caller's, which the blocked form turns into X in place (no second buffer of A's
    size to allocate and fault in)."""
    n, blk = A.shape[-1], _SOLVE_BLOCK
    m = n // blk
    if (torch.is_grad_enabled() and A.requires_grad) or m < 2 or n % blk or m & (m - 1):
        eye = torch.eye(n, dtype=A.dtype, device=A.device).expand_as(A)
        return torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True)

    def diagonal_blocks(M: torch.Tensor, s: int) -> torch.Tensor:  # [..., n/s, s, s], a view
        return torch.diagonal(M.unflatten(-2, (n // s, s)).unflatten(-1, (n // s, s)),
                              dim1=-4, dim2=-2).movedim(-1, -3)

    Ad = diagonal_blocks(A, blk)
    eye = torch.eye(blk, dtype=A.dtype, device=A.device).expand_as(Ad)
    Xd = torch.linalg.solve_triangular(Ad, eye, upper=False, unitriangular=True)
    # X starts as stril(A) (A itself when it may be overwritten): each merge below reads the
    # block A21 of its level and only then writes X21 over it; the diagonal blocks get Xd.
    X = A.tril_(-1) if overwrite else A.tril(-1)
    diagonal_blocks(X, blk).copy_(Xd)
    s = blk
    while s < n:
        Xm = diagonal_blocks(X, 2 * s)
        Xm[..., s:, :s] = -(Xm[..., s:, s:] @ (Xm[..., s:, :s] @ Xm[..., :s, :s]))
        s *= 2
    return X


class _DeltaRuleChunk(torch.autograd.Function):
    """The chunked delta rule on chunk-major tensors with a hand-written backward.

    Forward: qc, kc [N, BH, C, Dk], vc [N, BH, C, Dv], bc [N, BH, C, 1], S0 [BH, Dk, Dv] ->
    (o [N, BH, C, Dv], S_final [BH, Dk, Dv]). Backward, with g the gradient of the state leaving
    a chunk (dS_final for the last one), in reverse chunk order:
    dU = tril(Q K^T)^T dO + K g and g <- g + Q^T dO - W^T dU (the only loop); then batched:
    dQ = dO S_in^T + tril(dO U^T) K, dK = tril(dO U^T)^T Q + U g^T + Tm^T dW + (G + G^T) K,
    dW = -dU S_in^T, dV = Tm^T dU, dTm = dW K^T + dU V^T, dX = dTm diag(beta),
    dL = -X^T dX X^T, dA = stril(dL), G = diag(beta) dA,
    dbeta_i = sum_j dA_ij (K K^T)_ij + sum_r dTm_ri X_ri. The backward is made of
    differentiable operations; under create_graph it recomputes X and the chunk states from the
    inputs, so double backward is exact too.

    ``products`` (bfloat16 or None, see ``delta_rule_chunk``): in the backward every batched
    product takes operands in that dtype except those of the solve (dL = -X^T dX X^T, the
    K K^T of dbeta and the (G + G^T) K of dK, the mirror of the forward's K K^T) and the
    recomputed W; the reverse loop over chunks stays float32.
    """

    @staticmethod
    def _states(kc, vc, bc, S0, products):
        """X and the states entering every chunk, (X, S_in [N, BH, Dk, Dv], U, S_final)."""
        X = _delta_wy(kc, bc)
        Tm = X * bc.transpose(-1, -2)  # X diag(beta)
        # [N, BH, C, Dk]; U holds U0 until the loop reaches its chunk
        W, U = Tm @ kc, _matmul(_low(Tm, products), _low(vc, products))
        N = kc.shape[0]
        kT = kc.transpose(-1, -2)
        if torch.is_grad_enabled():  # double backward: a graph through every step
            S, entering, Us = S0, [], []
            for n in range(N):
                Un = torch.baddbmm(U[n], W[n], S, alpha=-1)  # U0 - W S
                entering.append(S)
                S = torch.baddbmm(S, kT[n], Un)  # S + K^T U
                Us.append(Un)
            return X, torch.stack(entering), torch.stack(Us), S
        # Without autograd every step writes in place: U0 becomes U, and each state goes
        # straight into its slot of S_in (no copies of addends, no stacking).
        S_in = S0.new_empty(N, *S0.shape)
        S_in[0] = S0
        for n in range(N):
            U[n].baddbmm_(W[n], S_in[n], alpha=-1)
            if n + 1 < N:
                torch.baddbmm(S_in[n], kT[n], U[n], out=S_in[n + 1])
        return X, S_in, U, torch.baddbmm(S_in[N - 1], kT[N - 1], U[N - 1])

    @staticmethod
    def forward(ctx, qc, kc, vc, bc, S0, products):  # type: ignore[override]
        X, S_in, U, S = _DeltaRuleChunk._states(kc, vc, bc, S0, products)
        ql = _low(qc, products)
        qk = (ql @ _low(kc, products).transpose(-1, -2)).tril_()
        if products is None:
            o = (qc @ S_in).flatten(0, 1).baddbmm_(qk.flatten(0, 1), U.flatten(0, 1))
        else:  # both terms widened to float32 before they are added
            o = _matmul(ql, _low(S_in, products)).flatten(0, 1).add_(
                qk.flatten(0, 1) @ _low(U, products).flatten(0, 1))
        ctx.save_for_backward(qc, kc, vc, bc, S0, X, S_in)
        ctx.products = products
        return o.unflatten(0, qc.shape[:2]), S

    @staticmethod
    def backward(ctx, do, dS):  # type: ignore[override]
        qc, kc, vc, bc, S0, X, S_in = ctx.saved_tensors
        products = ctx.products
        if torch.is_grad_enabled():
            # create_graph (double backward): X and S_in were made without a graph in forward;
            # recompute them from the inputs so that second derivatives flow through them too.
            X, S_in, _, _ = _DeltaRuleChunk._states(kc, vc, bc, S0, products)

        def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # a @ b, operands in products
            return _matmul(_low(a, products), _low(b, products))

        if do is None:
            do = qc.new_zeros(*qc.shape[:-1], vc.shape[-1])
        if dS is None:
            dS = S_in.new_zeros(S_in.shape[1:])
        # Intermediates are freed as soon as they are used up: the backward's transient memory
        # (one call at a time) stays near the few [T, H, D]-sized tensors the forward saved.
        bT = bc.transpose(-1, -2)
        Tm = X * bT
        W = Tm @ kc
        U = torch.baddbmm(mm(Tm, vc).flatten(0, 1), W.flatten(0, 1), S_in.flatten(0, 1),
                          alpha=-1).unflatten(0, qc.shape[:2])  # U0 - W S_in, all chunks
        kT = kc.transpose(-1, -2)
        dU_out = mm(mm(qc, kT).tril().transpose(-1, -2), do)  # [N, BH, C, Dv]
        QtdO = mm(qc.transpose(-1, -2), do)  # [N, BH, Dk, Dv]
        g, leaving, dUs = dS, [], []
        for n in range(qc.shape[0] - 1, -1, -1):
            leaving.append(g)
            dU = torch.baddbmm(dU_out[n], kc[n], g)  # dU_out + K g
            g = torch.baddbmm(g + QtdO[n], W[n].transpose(-1, -2), dU, alpha=-1)
            dUs.append(dU)
        del dU_out, QtdO, W
        G_out = torch.stack(leaving[::-1])  # [N, BH, Dk, Dv], gradient of each leaving state
        del leaving
        dU = torch.stack(dUs[::-1])  # [N, BH, C, Dv]
        del dUs
        dmask = mm(do, U.transpose(-1, -2)).tril()  # [N, BH, C, C]
        dq = mm(do, S_in.transpose(-1, -2)) + mm(dmask, kc)
        dk = mm(dmask.transpose(-1, -2), qc)
        del dmask
        dk = dk + mm(U, G_out.transpose(-1, -2))
        del U, G_out
        dW = -mm(dU, S_in.transpose(-1, -2))  # [N, BH, C, Dk]
        TmT = Tm.transpose(-1, -2)
        dk = dk + mm(TmT, dW)
        dv = mm(TmT, dU)
        del Tm, TmT
        dTm = mm(dW, kT) + mm(dU, vc.transpose(-1, -2))  # [N, BH, C, C]
        del dW, dU
        db = (dTm * X).sum(dim=-2).unsqueeze(-1)  # through Tm = X diag(beta)
        XT = X.transpose(-1, -2)
        dA = (-(XT @ (dTm * bT) @ XT)).tril(-1)  # stril(dL)
        del dTm
        db = db + (dA * (kc @ kT)).sum(dim=-1, keepdim=True)
        G = bc * dA
        del dA
        dk = dk + (G + G.transpose(-1, -2)) @ kc
        return dq, dk, dv, db, g, None
