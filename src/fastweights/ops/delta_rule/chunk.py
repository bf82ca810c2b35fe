"""The chunked WY/UT form of the delta rule (docs/maths.md 1.4) with the gates of 5b optional:
the delta rule and the gated delta rule are one form, ``delta_rule_chunk``, with one
hand-written backward (``_DeltaRuleChunk``); ops/gated_delta_rule calls it with its gates.

Dimension legend: B batch, T time, H heads, Dk key/query dim, Dv value dim, C chunk size,
N number of chunks. Inputs ``[B, T, H, D]`` in the compute dtype with q already scaled; state
``S [B, H, Dk, Dv]``. T need not be a multiple of C: the tail is zero-padded, and zero
keys/values/betas write nothing, so padding never changes the state. ``products``: as in
ops/_chunks.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._chunks import _low, _matmul


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


def delta_rule_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, S: torch.Tensor,
    chunk_size: int, g: torch.Tensor | None = None, products: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule (docs/maths.md 1.4) and, with log-decays ``g``, the gated delta rule
    (5b) in their WY/UT form: batched over all chunks but for the state hand-off
    U = U0 - W S, S <- gam_L S + (diag(last) K)^T U, the only Python loop.

    q, k [B, T, Hk, Dk], v [B, T, H, Dv] (H a multiple of Hk: value head h reads key head
    h // (H / Hk)), beta and g [B, T, H], S [B, H, Dk, Dv]; returns (o [B, T, H, Dv], S_T).
    ``g`` None is no decay (the delta rule): the decay tables and every product with them are
    skipped, not computed from a zero gate. The algebra, per chunk with entering state S, 0-based
    i, j inside the chunk and the segment sums L_ij = sum_{j < m <= i} g_m (i >= j; L_ii = 0),
    G_i = sum_{m <= i} g_m:
      Gam_ij = exp(L_ij) for i >= j, else 0 (the decay from token j to token i);
      gam_i = exp(G_i) (from the chunk's start to token i), last_j = Gam_{C-1, j}, gam_L = gam_{C-1};
      A = stril(diag(beta) (K K^T * Gam)), X = (I + A)^-1, Tm = X diag(beta),
      U0 = Tm V, W = Tm diag(gam) K, U = U0 - W S                  (U: the written values u_j)
      O = diag(gam) Q S + (Q K^T * Gam) U,   S_next = gam_L S + (diag(last) K)^T U.
    Without gates Gam is the lower triangle of ones and gam = last = 1. A padded tail token
    (k = v = beta = 0, g = 0) writes nothing and leaves the state as it was.

    Stability of the gates: every exponent is a sum of gates over a range of tokens, <= 0, so
    no factor exceeds 1 and nothing is divided by a decay. The exponents are segment sums (one
    cumsum per column of the C x C table), not differences G_i - G_j of one running sum, which
    lose the small sum's digits after a large gate and are -inf - (-inf) = NaN after a hard
    reset (g = -inf); a segment sum is -inf exactly when its range holds a -inf gate.

    The backward pass is written out (``_DeltaRuleChunk``): autograd would keep about 19
    [T, H, D]-sized tensors per call; this keeps q, k, v, beta, g, X and the chunk-entering
    states and recomputes W, U0 and U with batched products.

    With ``products`` (bfloat16) the batched products that feed no state recursively take
    bfloat16 operands: U0 = Tm V, Q K^T, (Q K^T * Gam) U and Q S_entering, and in the backward
    the matching ones (see ``_DeltaRuleChunk``). Float32 stay: K K^T and the solve X (the
    solve's forward error is its condition number times its input's: keep the input exact),
    W = Tm diag(gam) K and the sequential hand-off. W multiplies the state in every hand-off, so
    its rounding enters each chunk's transition, whose error the state carries into every later
    chunk (measured: docs/performance.md); U0 only adds to U, so its rounding is a per-chunk
    error like the others'. Only ``delta_rule`` opts into the bfloat16 products
    (ops/_autocast.py); ``gated_delta_rule`` passes None."""
    B, T, H, Dv = v.shape
    Dk = q.shape[-1]
    qc, kc = (_chunk_major_heads(x, chunk_size, H) for x in (q, k))  # [N, BH, C, Dk]
    vc = _chunk_major(v, chunk_size)  # [N, BH, C, Dv]
    bc = _chunk_major(beta.unsqueeze(-1), chunk_size)  # [N, BH, C, 1]
    gc = None if g is None else _chunk_major(g.unsqueeze(-1), chunk_size)
    o, S = _DeltaRuleChunk.apply(qc, kc, vc, bc, gc, S.reshape(B * H, Dk, Dv), products)
    return _from_chunk_major(o, B, T), S.reshape(B, H, Dk, Dv)


def _chunk_major_heads(x: torch.Tensor, C: int, H: int) -> torch.Tensor:
    """q or k [B, T, Hk, D] -> [N, B*H, C, D] for H value heads (value head h reads key head
    h // (H / Hk)), zero-padding T up to N*C: one copy, as ``_chunk_major``."""
    B, T, Hk, D = x.shape
    if Hk == H:
        return _chunk_major(x, C)
    N = -(-T // C)
    if N * C != T:
        x = F.pad(x, (0, 0, 0, 0, 0, N * C - T))
    x = x.reshape(B, N, C, Hk, 1, D).expand(B, N, C, Hk, H // Hk, D)
    return x.permute(1, 0, 3, 4, 2, 5).reshape(N, B * H, C, D)


def _decays(gc: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """gc [N, BH, C, 1] -> (Gam [N, BH, C, C], gam [N, BH, C, 1]): Gam_ij = exp(L_ij) for i >= j,
    0 above the diagonal; gam_i = exp(G_i) (see ``delta_rule_chunk``). (None, None) without gates.

    L is the cumsum down each column j of the table g_m [m > j]: the running sum never
    subtracts, so a -inf gate makes -inf (Gam = 0) and never NaN."""
    if gc is None:
        return None, None
    g = gc.squeeze(-1)  # [N, BH, C]
    C = g.shape[-1]
    L = g.unsqueeze(-1).expand(*g.shape, C).tril(-1).cumsum(dim=-2)  # [.., m, j] -> [.., i, j]
    G = g.cumsum(dim=-1).unsqueeze(-1)
    if torch.is_grad_enabled() and gc.requires_grad:  # double backward: no in-place steps
        return L.exp().tril(), G.exp()
    return L.exp_().tril_(), G.exp_()


def _wy(kc: torch.Tensor, bc: torch.Tensor, Gam: torch.Tensor | None) -> torch.Tensor:
    """X = (I + stril(diag(beta) (K K^T * Gam)))^-1 per chunk: [N, BH, C, C]
    (``unit_lower_inverse``; without gates K K^T alone)."""
    A = kc @ kc.transpose(-1, -2)
    if torch.is_grad_enabled():
        A = (A if Gam is None else A * Gam) * bc
    else:
        if Gam is not None:
            A.mul_(Gam)
        A.mul_(bc)
    return unit_lower_inverse(A, overwrite=True)


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
    """The chunked (gated) delta rule on chunk-major tensors with a hand-written backward.

    Forward: qc, kc [N, BH, C, Dk], vc [N, BH, C, Dv], bc [N, BH, C, 1], gc [N, BH, C, 1] or None
    (no decay), S0 [BH, Dk, Dv] -> (o [N, BH, C, Dv], S_final [BH, Dk, Dv]). Backward, with dS
    the gradient of the state leaving a chunk (dS_final for the last one), in reverse chunk
    order (the only loop):
      dU = P^T dO + Kl dS,  dS <- gam_L dS + (diag(gam) Q)^T dO - W^T dU
    with P = Q K^T * Gam and Kl = diag(last) K; then batched over the chunks:
      dQ = diag(gam) dO S^T + (dO U^T * Gam) K,  dK = (dO U^T * Gam)^T Q + diag(last) U dS^T
           + diag(gam) Tm^T dW + (E + E^T) K,
      dW = -dU S^T,  dV = Tm^T dU,  dTm = dW K^T diag(gam) + dU V^T,  dX = dTm diag(beta),
      dA = stril(-X^T dX X^T),  E = diag(beta) dA * Gam,
      dbeta_j = sum_i dTm_ij X_ij + sum_i dA_ji (K K^T * Gam)_ji,
    and, with gates, the gates through the tables: dGam = (dO U^T) * Q K^T
    + diag(beta) dA * K K^T (+ the gradient of the last row, last_j = Gam_{C-1, j}),
    dgam_i = q_i . (dO S^T)_i + k_i . (Tm^T dW)_i (+ <dS_leaving, S> at i = C-1 through gam_L);
    then dg_m = sum_{i >= m} gam_i dgam_i + sum_{i >= m > j} Gam_ij dGam_ij (every exponent
    that sums g_m). Without gates every factor Gam, gam, last is skipped (Gam's product is the
    lower triangle). The backward is made of differentiable operations; under create_graph it
    recomputes X and the chunk states from the inputs, so double backward is exact too.

    ``products`` (bfloat16 or None, see ``delta_rule_chunk``): in the backward every batched
    product takes operands in that dtype except those of the solve (-X^T dX X^T, the
    K K^T of dbeta and the (E + E^T) K of dK, the mirror of the forward's K K^T) and the
    recomputed W; the reverse loop over chunks stays float32.
    """

    @staticmethod
    def _states(kc, vc, bc, gc, S0, products):
        """The decay tables, X and the states entering every chunk:
        (Gam, gam, X, S_in [N, BH, Dk, Dv], U, S_final); Gam, gam None without gates."""
        Gam, gam = _decays(gc)
        X = _wy(kc, bc, Gam)
        Tm = X * bc.transpose(-1, -2)  # X diag(beta)
        # [N, BH, C, Dk]; U holds U0 until the loop reaches its chunk
        W = Tm @ (kc if gam is None else kc * gam)
        U = _matmul(_low(Tm, products), _low(vc, products))
        if gam is None:
            KlT, gL = kc.transpose(-1, -2), None
        else:
            KlT = (kc * Gam[..., -1:, :].transpose(-1, -2)).transpose(-1, -2)  # (diag(last) K)^T
            gL = gam[..., -1:, :]  # [N, BH, 1, 1]
        N = kc.shape[0]
        # Double backward, and traced programs (torch.export keeps the out= writes below, which
        # fail when the program runs with parameters that require grad): a graph through every
        # step, the same values.
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            S, entering, Us = S0, [], []
            for n in range(N):
                Un = torch.baddbmm(U[n], W[n], S, alpha=-1)  # U0 - W S
                entering.append(S)
                S = torch.baddbmm(S if gL is None else S * gL[n], KlT[n], Un)  # gam_L S + Kl^T U
                Us.append(Un)
            return Gam, gam, X, torch.stack(entering), torch.stack(Us), S
        # Without autograd every step writes in place: U0 becomes U, and each state goes
        # straight into its slot of S_in (no copies of addends, no stacking).
        S_in = S0.new_empty(N, *S0.shape)
        S_in[0] = S0
        final = S0.new_empty(S0.shape)
        for n in range(N):
            U[n].baddbmm_(W[n], S_in[n], alpha=-1)
            nxt = S_in[n + 1] if n + 1 < N else final
            if gL is None:
                torch.baddbmm(S_in[n], KlT[n], U[n], out=nxt)
            else:
                torch.mul(S_in[n], gL[n], out=nxt).baddbmm_(KlT[n], U[n])
        return Gam, gam, X, S_in, U, final

    @staticmethod
    def forward(ctx, qc, kc, vc, bc, gc, S0, products):  # type: ignore[override]
        Gam, gam, X, S_in, U, S = _DeltaRuleChunk._states(kc, vc, bc, gc, S0, products)
        ql = _low(qc, products)
        scores = ql @ _low(kc, products).transpose(-1, -2)  # P = Q K^T * Gam (lower triangular)
        scores = scores.tril_() if Gam is None else scores.mul_(Gam)
        # both terms widened to float32 before they are added on the bfloat16 path
        o = qc @ S_in if products is None else _matmul(ql, _low(S_in, products))
        if gam is not None:
            o.mul_(gam)
        o = o.flatten(0, 1)
        if products is None:
            o.baddbmm_(scores.flatten(0, 1), U.flatten(0, 1))
        else:
            o.add_(scores.flatten(0, 1) @ _low(U, products).flatten(0, 1))
        ctx.save_for_backward(qc, kc, vc, bc, gc, S0, X, S_in)
        ctx.products = products
        return o.unflatten(0, qc.shape[:2]), S

    @staticmethod
    def backward(ctx, do, dS):  # type: ignore[override]
        qc, kc, vc, bc, gc, S0, X, S_in = ctx.saved_tensors
        products = ctx.products
        if torch.is_grad_enabled():
            # create_graph (double backward): X and S_in were made without a graph in forward;
            # recompute them from the inputs so that second derivatives flow through them too.
            Gam, gam, X, S_in, _, _ = _DeltaRuleChunk._states(kc, vc, bc, gc, S0, products)
        else:
            Gam, gam = _decays(gc)

        def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # a @ b, operands in products
            return _matmul(_low(a, products), _low(b, products))

        def mm_add(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0,
                   low: bool = True) -> torch.Tensor:
            """x + alpha a @ b (alpha +-1): one fused baddbmm, or on the bfloat16 path the
            product (operands in ``products`` where ``low``) widened and then added."""
            if products is None:
                return _bmm_add(x, a, b, alpha)
            ab = mm(a, b) if low else a @ b
            return x + ab if alpha == 1 else x - ab

        if do is None:
            do = qc.new_zeros(*qc.shape[:-1], vc.shape[-1])
        if dS is None:
            dS = S_in.new_zeros(S_in.shape[1:])
        gated = Gam is not None
        if gated:
            last = Gam[..., -1:, :].transpose(-1, -2)  # [N, BH, C, 1]
            gL = gam[..., -1:, :]  # [N, BH, 1, 1]
        # Intermediates are freed as soon as they are used up: the backward's transient memory
        # (one call at a time) stays near the few [T, H, D]-sized tensors the forward saved.
        bT = bc.transpose(-1, -2)
        Tm = X * bT
        kg = kc * gam if gated else kc
        W = Tm @ kg
        U = torch.baddbmm(mm(Tm, vc).flatten(0, 1), W.flatten(0, 1), S_in.flatten(0, 1),
                          alpha=-1).unflatten(0, qc.shape[:2])  # U0 - W S_in, all chunks
        kl = kc * last if gated else kc
        kT = kc.transpose(-1, -2)
        P = mm(qc, kT)
        P = _mul_(P, Gam) if gated else _tril_(P)  # Q K^T * Gam
        dU_out = mm(P.transpose(-1, -2), do)  # [N, BH, C, Dv]
        if not gated:
            P = None  # only the gates' gradient reads it again
        QtdO = mm(qc.transpose(-1, -2), do * gam if gated else do)  # (diag(gam) Q)^T dO
        dS_n, leaving, dUs = dS, [], []
        for n in range(qc.shape[0] - 1, -1, -1):
            leaving.append(dS_n)
            dU = torch.baddbmm(dU_out[n], kl[n], dS_n)  # P^T dO + Kl dS
            carried = torch.addcmul(QtdO[n], dS_n, gL[n]) if gated else dS_n + QtdO[n]
            dS_n = torch.baddbmm(carried, W[n].transpose(-1, -2), dU, alpha=-1)
            dUs.append(dU)
        del dU_out, QtdO, W, kl
        G_out = torch.stack(leaving[::-1])  # [N, BH, Dk, Dv], gradient of each leaving state
        del leaving
        dU = torch.stack(dUs[::-1])  # [N, BH, C, Dv]
        del dUs
        # Signs: dWm = -dW, dAm = -dA (the negations ride on alpha/value arguments instead of
        # passes of their own). Output O = diag(gam) Q S_in + (Q K^T * Gam) U.
        dOU = mm(do, U.transpose(-1, -2))  # [N, BH, C, C]
        if gated:
            dP = dOU * Gam
            # dL = dGam * Gam, the gradient of the exponents L_ij: through P, dOU * Q K^T * Gam.
            dL = _mul_(dOU, P)
        else:
            dP = _tril_(dOU)
        del dOU, P
        dOS = mm(do, S_in.transpose(-1, -2))  # [N, BH, C, Dk]
        if gated:
            dgam = (qc * dOS).sum(dim=-1, keepdim=True)  # [N, BH, C, 1]
            dOS = _mul_(dOS, gam)
        dq = mm_add(dOS, dP, kc)
        del dOS
        dk = mm(dP.transpose(-1, -2), qc)
        del dP
        # State S_next = gam_L S_in + Kl^T U.
        UG = mm(U, G_out.transpose(-1, -2))  # d(Kl) = U dS^T  [N, BH, C, Dk]
        dk = torch.addcmul(dk, UG, last) if gated else dk + UG
        if gated:
            dlast = (kc * UG).sum(dim=-1, keepdim=True)  # [N, BH, C, 1]
            dgL = (G_out * S_in).sum(dim=(-2, -1), keepdim=True)  # [N, BH, 1, 1]
        del UG, G_out, U
        # U = Tm V - W S_in with W = Tm diag(gam) K.
        dWm = mm(dU, S_in.transpose(-1, -2))  # [N, BH, C, Dk]
        TmT = Tm.transpose(-1, -2)
        R = mm(TmT, dWm)  # -d(diag(gam) K)
        dk = torch.addcmul(dk, R, gam, value=-1) if gated else dk - R
        if gated:
            dgam = dgam - (kc * R).sum(dim=-1, keepdim=True)
        del R
        dv = mm(TmT, dU)
        dTm = mm_add(mm(dU, vc.transpose(-1, -2)), dWm, kg.transpose(-1, -2), alpha=-1)
        del dWm, dU, Tm, TmT, kg
        db = (dTm * X).sum(dim=-2).unsqueeze(-1)  # through Tm = X diag(beta)
        XT = X.transpose(-1, -2)
        dAm = (XT @ _mul_(dTm, bT) @ XT).tril(-1)  # -stril(dL) of the solve
        del dTm, XT
        M = kc @ kT  # K K^T * Gam
        if gated:
            M = _mul_(M, Gam)
        db = db - (dAm * M).sum(dim=-1, keepdim=True)
        bdAm = _mul_(dAm, bc)  # -d(K K^T * Gam) = -diag(beta) dA
        del dAm
        E = bdAm * Gam if gated else bdAm
        dk = mm_add(dk, E + E.transpose(-1, -2), kc, alpha=-1, low=False)
        del E
        if not gated:
            return dq, dk, dv, db, None, dS_n, None
        dL = _addcmul_(dL, bdAm, M, value=-1)  # ... and through A it is -diag(beta) dA * M
        del bdAm, M
        # The gates. L_ij = sum_{j < m <= i} g_m, so dg_m = sum_{i >= m > j} dL_ij: with dL's
        # column sums c and row sums r (upper triangle 0; the diagonal cancels in c - r),
        # sum_{i >= m, j < m} dL_ij = sum_{j < m} c_j - sum_{i < m} r_i (the block i, j < m
        # holds every row i < m whole). last_j = Gam_{C-1, j} adds dlast_j last_j to c_j.
        # G_i = sum_{m <= i} g_m: dg_m = sum_{i >= m} dG_i, with gam_L = gam_{C-1} in it.
        cr = (dL.sum(dim=-2) - dL.sum(dim=-1)).unsqueeze(-1) + dlast * last  # [N, BH, C, 1]
        del dL
        dG = dgam * gam
        dg = dG.flip(-2).cumsum(dim=-2).flip(-2) + dgL * gL  # sum_{i >= m} dG_i (+ gam_L's)
        dg = dg + F.pad(cr.cumsum(dim=-2)[..., :-1, :], (0, 0, 1, 0))  # sum_{j < m} (c - r)_j
        return dq, dk, dv, db, dg, dS_n, None


def _mul_(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a * b, written into ``a`` (a temporary of the backward) unless autograd records it
    (double backward)."""
    return a * b if torch.is_grad_enabled() else a.mul_(b)


def _tril_(a: torch.Tensor) -> torch.Tensor:
    """The lower triangle of ``a``, written into ``a`` unless autograd records it."""
    return a.tril() if torch.is_grad_enabled() else a.tril_()


def _addcmul_(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, value: float) -> torch.Tensor:
    """x + value a * b, written into ``x`` (a temporary) unless autograd records it."""
    if torch.is_grad_enabled():
        return torch.addcmul(x, a, b, value=value)
    return x.addcmul_(a, b, value=value)


def _bmm_add(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """x + alpha a @ b for [N, BH, ...] tensors: one baddbmm over N * BH, out of place."""
    return torch.baddbmm(x.flatten(0, 1), a.flatten(0, 1), b.flatten(0, 1),
                         alpha=alpha).unflatten(0, x.shape[:2])
