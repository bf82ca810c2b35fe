"""Chunked parallel form of the gated delta rule (docs/maths.md 5b): the WY/UT form of the delta
rule (docs/maths.md 1.4, ``chunk.delta_rule_chunk``) with the decay folded in, and its hand-written
backward.

(A file of its own beside chunk.py while the package layout is being restructured.)

Dimension legend: B batch, T time, Hk query/key heads, H value heads (a multiple of Hk), Dk
key/query dim, Dv value dim, C chunk size, N number of chunks, BH = B * H. Inputs in the compute
dtype with q already scaled: q, k [B, T, Hk, Dk], v [B, T, H, Dv], beta, g [B, T, H]; state
S [B, H, Dk, Dv]. T need not be a multiple of C: the tail is zero-padded, and a padded token
(k = v = beta = 0, g = 0: no decay) writes nothing and leaves the state as it was.

The algebra, per chunk with entering state S, 0-based i, j inside the chunk and the segment
sums L_ij = sum_{j < m <= i} g_m (i >= j; L_ii = 0), G_i = sum_{m <= i} g_m:
  Gam_ij = exp(L_ij) for i >= j, else 0 (the decay from token j to token i);
  gam_i = exp(G_i) (from the chunk's start to token i), last_j = Gam_{C-1, j}, gam_L = gam_{C-1};
  A = stril(diag(beta) (K K^T * Gam)), X = (I + A)^-1, Tm = X diag(beta),
  U0 = Tm V, W = Tm diag(gam) K, U = U0 - W S                         (U: the written values u_j)
  O = diag(gam) Q S + (Q K^T * Gam) U,   S_next = gam_L S + (diag(last) K)^T U.
With S'_i = exp(g_i) S_{i-1} the decayed state and u_i = beta_i (v_i - k_i S'_i) what token i
writes, S_i = gam_i S + sum_{j <= i} Gam_ij k_j^T u_j; inserting S'_i = S_{i-1} exp(g_i) into u_i
gives (I + A) U = diag(beta) V - diag(beta gam) K S, whence U; o_i = q_i S_i gives O.

Stability: every exponent is a sum of gates over a range of tokens, <= 0, so no factor exceeds 1
and nothing is ever divided by a decay. The exponents are built as segment sums (one cumsum per
row of the C x C table), not as differences G_i - G_j of one running sum: a difference of two
large running sums loses the digits of the small one (after g = -1e4 at the chunk's start, a
float32 G carries an absolute error near 1e-3 into every later exp(G_i - G_j)), and after a
hard reset (g = -inf) it would be -inf - (-inf) = NaN. A segment sum is -inf exactly when its
range holds a -inf gate (Gam = 0 there: nothing before the reset survives it) and exact to the
rounding of its own few terms otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .chunk import _chunk_major, _from_chunk_major, unit_lower_inverse


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


def gated_delta_rule_chunk(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
    S: torch.Tensor, chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule (see the module docstring): batched over all chunks but for
    the state hand-off U = U0 - W S, S <- gam_L S + (diag(last) K)^T U, the only Python loop.
    Returns (o [B, T, H, Dv], S_T [B, H, Dk, Dv]).

    The backward pass is written out (``_GatedDeltaRuleChunk``): it keeps q, k, v, beta, g, X
    and the chunk-entering states and recomputes the rest with batched products."""
    B, T, H, Dv = v.shape
    Dk = q.shape[-1]
    qc, kc = (_chunk_major_heads(x, chunk_size, H) for x in (q, k))  # [N, BH, C, Dk]
    vc = _chunk_major(v, chunk_size)  # [N, BH, C, Dv]
    bc, gc = (_chunk_major(x.unsqueeze(-1), chunk_size) for x in (beta, g))  # [N, BH, C, 1]
    o, S = _GatedDeltaRuleChunk.apply(qc, kc, vc, bc, gc, S.reshape(B * H, Dk, Dv))
    return _from_chunk_major(o, B, T), S.reshape(B, H, Dk, Dv)


def _decays(gc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gc [N, BH, C, 1] -> (Gam [N, BH, C, C], gam [N, BH, C, 1]): Gam_ij = exp(L_ij) for i >= j,
    0 above the diagonal; gam_i = exp(G_i) (see the module docstring).

    L is the cumsum down each column j of the table g_m [m > j]: the running sum never
    subtracts, so a -inf gate makes -inf (Gam = 0) and never NaN."""
    g = gc.squeeze(-1)  # [N, BH, C]
    C = g.shape[-1]
    L = g.unsqueeze(-1).expand(*g.shape, C).tril(-1).cumsum(dim=-2)  # [.., m, j] -> [.., i, j]
    G = g.cumsum(dim=-1).unsqueeze(-1)
    if torch.is_grad_enabled() and gc.requires_grad:  # double backward: no in-place steps
        return L.exp().tril(), G.exp()
    return L.exp_().tril_(), G.exp_()


def _wy(kc: torch.Tensor, bc: torch.Tensor, Gam: torch.Tensor) -> torch.Tensor:
    """X = (I + stril(diag(beta) (K K^T * Gam)))^-1 per chunk: [N, BH, C, C]
    (chunk.unit_lower_inverse)."""
    A = kc @ kc.transpose(-1, -2)
    A = A * Gam * bc if torch.is_grad_enabled() else A.mul_(Gam).mul_(bc)
    return unit_lower_inverse(A, overwrite=True)


class _GatedDeltaRuleChunk(torch.autograd.Function):
    """The chunked gated delta rule on chunk-major tensors with a hand-written backward.

    Forward: qc, kc [N, BH, C, Dk], vc [N, BH, C, Dv], bc, gc [N, BH, C, 1], S0 [BH, Dk, Dv] ->
    (o [N, BH, C, Dv], S_final [BH, Dk, Dv]). Backward, with dS the gradient of the state leaving
    a chunk (dS_final for the last one), in reverse chunk order (the only loop):
      dU = P^T dO + Kl dS,  dS <- gam_L dS + (diag(gam) Q)^T dO - W^T dU
    with P = Q K^T * Gam and Kl = diag(last) K; then batched over the chunks:
      dQ = diag(gam) dO S^T + (dO U^T * Gam) K,  dK = (dO U^T * Gam)^T Q + diag(last) U dS^T
           + diag(gam) Tm^T dW + (E + E^T) K,
      dW = -dU S^T,  dV = Tm^T dU,  dTm = dW K^T diag(gam) + dU V^T,  dX = dTm diag(beta),
      dA = stril(-X^T dX X^T),  E = diag(beta) dA * Gam,
      dbeta_j = sum_i dTm_ij X_ij + sum_i dA_ji (K K^T * Gam)_ji,
    and the gates through the tables: dGam = (dO U^T) * Q K^T + diag(beta) dA * K K^T (+ the
    gradient of the last row, last_j = Gam_{C-1, j}), dgam_i = q_i . (dO S^T)_i
    + k_i . (Tm^T dW)_i (+ <dS_leaving, S> at i = C-1 through gam_L); then
    dg_m = sum_{i >= m} gam_i dgam_i + sum_{i >= m > j} Gam_ij dGam_ij (every exponent that sums
    g_m). The backward is made of differentiable operations; under create_graph it recomputes X
    and the chunk states from the inputs, so double backward is exact too.
    """

    @staticmethod
    def _states(kc, vc, bc, gc, S0):
        """The decay tables, X and the states entering every chunk:
        (Gam, gam, X, S_in [N, BH, Dk, Dv], U, S_final)."""
        Gam, gam = _decays(gc)
        X = _wy(kc, bc, Gam)
        Tm = X * bc.transpose(-1, -2)  # X diag(beta)
        W, U = Tm @ (kc * gam), Tm @ vc  # U holds U0 until the loop reaches its chunk
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
                S = torch.baddbmm(S * gL[n], KlT[n], Un)  # gam_L S + Kl^T U
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
            torch.mul(S_in[n], gL[n], out=nxt).baddbmm_(KlT[n], U[n])
        return Gam, gam, X, S_in, U, final

    @staticmethod
    def forward(ctx, qc, kc, vc, bc, gc, S0):  # type: ignore[override]
        Gam, gam, X, S_in, U, S = _GatedDeltaRuleChunk._states(kc, vc, bc, gc, S0)
        scores = (qc @ kc.transpose(-1, -2)).mul_(Gam)  # P = Q K^T * Gam (lower triangular)
        o = (qc @ S_in).mul_(gam).flatten(0, 1).baddbmm_(scores.flatten(0, 1), U.flatten(0, 1))
        ctx.save_for_backward(qc, kc, vc, bc, gc, S0, X, S_in)
        return o.unflatten(0, qc.shape[:2]), S

    @staticmethod
    def backward(ctx, do, dS):  # type: ignore[override]
        qc, kc, vc, bc, gc, S0, X, S_in = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph (double backward): X and S_in were made without a graph in forward;
            # recompute them from the inputs so that second derivatives flow through them too.
            Gam, gam, X, S_in, _, _ = _GatedDeltaRuleChunk._states(kc, vc, bc, gc, S0)
        else:
            Gam, gam = _decays(gc)
        if do is None:
            do = qc.new_zeros(*qc.shape[:-1], vc.shape[-1])
        if dS is None:
            dS = S_in.new_zeros(S_in.shape[1:])
        last = Gam[..., -1:, :].transpose(-1, -2)  # [N, BH, C, 1]
        gL = gam[..., -1:, :]  # [N, BH, 1, 1]
        bT = bc.transpose(-1, -2)
        Tm = X * bT
        kg = kc * gam
        W = Tm @ kg
        U = torch.baddbmm((Tm @ vc).flatten(0, 1), W.flatten(0, 1), S_in.flatten(0, 1),
                          alpha=-1).unflatten(0, qc.shape[:2])  # U0 - W S_in, all chunks
        kl = kc * last
        kT = kc.transpose(-1, -2)
        P = _mul_(qc @ kT, Gam)  # Q K^T * Gam
        dU_out = P.transpose(-1, -2) @ do  # [N, BH, C, Dv]
        QtdO = qc.transpose(-1, -2) @ (do * gam)  # (diag(gam) Q)^T dO  [N, BH, Dk, Dv]
        dS_n, leaving, dUs = dS, [], []
        for n in range(qc.shape[0] - 1, -1, -1):
            leaving.append(dS_n)
            dU = torch.baddbmm(dU_out[n], kl[n], dS_n)  # P^T dO + Kl dS
            dS_n = torch.baddbmm(torch.addcmul(QtdO[n], dS_n, gL[n]), W[n].transpose(-1, -2),
                                 dU, alpha=-1)
            dUs.append(dU)
        del dU_out, QtdO, W
        G_out = torch.stack(leaving[::-1])  # [N, BH, Dk, Dv], gradient of each leaving state
        del leaving
        dU = torch.stack(dUs[::-1])  # [N, BH, C, Dv]
        del dUs
        # Intermediates are freed as soon as they are used up. Signs: dWm = -dW, dAm = -dA
        # (the negations ride on alpha/value arguments instead of passes of their own).
        # Output O = diag(gam) Q S_in + (Q K^T * Gam) U.
        dOU = do @ U.transpose(-1, -2)  # [N, BH, C, C]
        dP = dOU * Gam
        # dL = dGam * Gam, the gradient of the exponents L_ij: through P it is dOU * Q K^T * Gam.
        dL = _mul_(dOU, P)
        del dOU, P
        dOS = do @ S_in.transpose(-1, -2)  # [N, BH, C, Dk]
        dgam = (qc * dOS).sum(dim=-1, keepdim=True)  # [N, BH, C, 1]
        dq = _bmm_add(_mul_(dOS, gam), dP, kc)
        del dOS
        dk = dP.transpose(-1, -2) @ qc
        del dP
        # State S_next = gam_L S_in + Kl^T U.
        UG = U @ G_out.transpose(-1, -2)  # d(Kl) = U dS^T  [N, BH, C, Dk]
        dk = torch.addcmul(dk, UG, last)
        dlast = (kc * UG).sum(dim=-1, keepdim=True)  # [N, BH, C, 1]
        dgL = (G_out * S_in).sum(dim=(-2, -1), keepdim=True)  # [N, BH, 1, 1]
        del UG, G_out, U
        # U = Tm V - W S_in with W = Tm diag(gam) K.
        dWm = dU @ S_in.transpose(-1, -2)  # [N, BH, C, Dk]
        R = Tm.transpose(-1, -2) @ dWm  # -d(diag(gam) K)
        dk = torch.addcmul(dk, R, gam, value=-1)
        dgam = dgam - (kc * R).sum(dim=-1, keepdim=True)
        del R
        dv = Tm.transpose(-1, -2) @ dU
        dTm = _bmm_add(dU @ vc.transpose(-1, -2), dWm, kg.transpose(-1, -2), alpha=-1)
        del dWm, dU, Tm, kg
        db = (dTm * X).sum(dim=-2).unsqueeze(-1)  # through Tm = X diag(beta)
        XT = X.transpose(-1, -2)
        dAm = (XT @ _mul_(dTm, bT) @ XT).tril(-1)  # -stril(dL) of the solve
        del dTm, XT
        M = _mul_(kc @ kT, Gam)  # K K^T * Gam
        db = db - (dAm * M).sum(dim=-1, keepdim=True)
        bdAm = _mul_(dAm, bc)  # -d(K K^T * Gam) = -diag(beta) dA
        del dAm
        E = bdAm * Gam
        dk = _bmm_add(dk, E + E.transpose(-1, -2), kc, alpha=-1)
        del E
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
        return dq, dk, dv, db, dg, dS_n


def _mul_(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a * b, written into ``a`` (a temporary of the backward) unless autograd records it
    (double backward)."""
    return a * b if torch.is_grad_enabled() else a.mul_(b)


def _addcmul_(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, value: float) -> torch.Tensor:
    """x + value a * b, written into ``x`` (a temporary) unless autograd records it."""
    if torch.is_grad_enabled():
        return torch.addcmul(x, a, b, value=value)
    return x.addcmul_(a, b, value=value)


def _bmm_add(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """x + alpha a @ b for [N, BH, ...] tensors: one baddbmm over N * BH, out of place."""
    return torch.baddbmm(x.flatten(0, 1), a.flatten(0, 1), b.flatten(0, 1),
                         alpha=alpha).unflatten(0, x.shape[:2])
