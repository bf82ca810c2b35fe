"""TTT-MLP's dual-form mini-batch scan (SPEC.md 2.4) with a hand-written backward pass.

Dimension legend: N mini-batches, BH = B * H (batch and heads folded into one dim), b mini-batch
size, Dk1 = Dk (+1 with the bias b1), Dh = 4 Dk hidden size, Dh1 = Dh (+1 with the bias b2),
Dv value dim. Step-major layout: per-token tensors ``[N, BH, b, D]``, contiguous, so every
step reads one contiguous batch of small matrices.

Per mini-batch n with entering weights (W1, W2) (biases folded in as extra rows, dual.py's
``_join``), KQ = [Ka; Qa] the keys and queries with their column of ones, E the b x b step-size
matrix and M1 = E * (Qa Ka^T), the forward step is

    [Z1; Zq1] = KQ W1;  X2 = [gelu(Z1), 1];  Z2 = X2 W2;  G2 = dl/dZ2 (LayerNorm gradient)
    A = G2 W2h^T (W2h: W2 without its bias row);  G1 = A * gelu'(Z1)
    Zbar1 = Zq1 - M1 G1;  Xbar2 = [gelu(Zbar1), 1];  Zbar2 = Xbar2 W2 - (E * Xbar2 X2^T) G2
    W1 <- W1 - tau_b (Ka * eta)^T G1;  W2 <- W2 - tau_b (X2 * eta)^T G2

(on the first mini-batch of a call that starts inside one, the carried gradient sums P1, P2
also enter: Zbar1 -= tau_i Qa P1, Zbar2 -= tau_i Xbar2 P2, the sums gain P; a last, partly
filled mini-batch returns its gradient sums instead of updating the weights).

The backward pass runs the steps in reverse with the gradient of the weights leaving each step
(D) as its carried state. Everything that needs neither a step's weights nor D (the b x b
products with E, the LayerNorm's affine gradients, the keys' and queries' share through M1) is
batched over all mini-batches before or after the loop; per step the loop does the products
with the step's weights and with D. It differentiates twice through the LayerNorm (dl/dZ2 is a
gradient already) and through gelu' (gelu'' appears).

Memory trade (``checkpoint_group``): by default the forward pass keeps the weights entering
every mini-batch (Dk1 Dh + Dh1 Dv floats per head per mini-batch, about 2 x 64 x 256 for head
dim 64; 268 MB for T 4096, 8 heads, b 16) and the per-token rows the backward pass reads
(about 6 Dh + 3 Dv floats per token and head, ~230 MB there); nothing of the step is computed
twice. With ``checkpoint_group=g`` it keeps only the weights entering every g-th mini-batch and
the backward pass runs each group's forward steps again (one more forward of the scan), holding
one group's rows at a time. Results are bit-identical either way.

Double backward (create_graph=True): the backward pass then differentiates a plain re-run of
the same steps with autograd, so second derivatives are exact too (slow, for tests).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .common import LN_EPS

_C = math.sqrt(2.0 / math.pi)
_A = 0.044715


def _gelu_parts(x: torch.Tensor, out: torch.Tensor | None = None, second: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """gelu_tanh(x), gelu'(x) and (``second``) gelu''(x), from one logistic sigmoid:
    0.5 (1 + tanh u) = sigmoid(2u), u = c (x + a x^3). (torch's tanh is ~3x slower than its
    sigmoid on CPU.) gelu is written into ``out`` when given."""
    x2 = x * x
    s = torch.sigmoid((2 * _C) * x * (1 + _A * x2))
    up = _C * (1 + 3 * _A * x2)  # du/dx
    ss = s * (1 - s)  # d sigmoid(2u) / d(2u)
    y = torch.mul(x, s, out=out)
    g1 = s + 2 * x * up * ss
    if not second:
        return y, g1, None
    # d/dx [s + 2 x u' s (1 - s)], with u'' = 6 a c x
    g2 = ss * (4 * up + (12 * _A * _C) * x2 + 4 * x * up * up * (1 - 2 * s))
    return y, g1, g2


def _ln_grad(z: torch.Tensor, tgt: torch.Tensor, lw: torch.Tensor | None,
             lb: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """dl/dZ of 1/2 ||[LN](Z) - tgt||^2 per row (SPEC 2.2), with the LayerNorm's x_hat and
    1/s for the backward pass (None without LayerNorm). lw, lb: [BH, 1, Dv]."""
    if lw is None:
        return z - tgt, None, None
    zc = z - z.mean(-1, keepdim=True)
    r = torch.rsqrt(zc.square().mean(-1, keepdim=True) + LN_EPS)
    xh = zc * r
    y = lw * xh if lb is None else torch.addcmul(lb, lw, xh)
    g = lw * (y - tgt)
    G = (g - g.mean(-1, keepdim=True) - xh * (g * xh).mean(-1, keepdim=True)) * r
    return G, xh, r


def _ln_grad_backward(dG: torch.Tensor, G: torch.Tensor, xh: torch.Tensor, r: torch.Tensor,
                      tgt: torch.Tensor, lw: torch.Tensor, lb: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Vector-Jacobian product of ``_ln_grad`` w.r.t. Z: returns (dZ, dg), where dg is the
    gradient w.r.t. g = gamma (LN(Z) - tgt), from which the target's and gamma/beta's come.

    With h = g - mean(g) - x_hat mean(g x_hat) and G = r h:
    dg = P(r dG) (P the same projection), dx_hat = gamma^2 dg - r dG mean(g x_hat)
    - g mean(r dG x_hat), dZ = r (dx_hat - mean(dx_hat) - x_hat (mean(dG G) + mean(dx_hat x_hat)))."""
    y = lw * xh if lb is None else torch.addcmul(lb, lw, xh)
    g = lw * (y - tgt)
    dh = r * dG
    m_dh_xh = (dh * xh).mean(-1, keepdim=True)
    dg = dh - dh.mean(-1, keepdim=True) - xh * m_dh_xh
    dxh = lw * lw * dg - dh * (g * xh).mean(-1, keepdim=True) - g * m_dh_xh
    coef = (dG * G).mean(-1, keepdim=True) + (dxh * xh).mean(-1, keepdim=True)
    dZ = r * (dxh - dxh.mean(-1, keepdim=True) - xh * coef)
    return dZ, dg


class _Inputs:
    """The scan's inputs in step-major layout and what is derived from them once per call.

    Ka, Qa [N, BH, b, Dk1]; tgt [N, BH, b, Dv]; eta [N, BH, b]; E [N, BH, b, b]; tau [BH, b];
    P1 [BH, Dk1, Dh], P2 [BH, Dh1, Dv] or None; lw, lb [BH, Dv] or None."""

    def __init__(self, Ka, Qa, tgt, eta, E, tau, P1, P2, lw, lb, has_b2: bool, tail: bool):
        self.Ka, self.Qa, self.tgt, self.eta, self.E, self.tau = Ka, Qa, tgt, eta, E, tau
        self.P1, self.P2, self.has_b2, self.tail = P1, P2, has_b2, tail
        self.lw = None if lw is None else lw.unsqueeze(-2)  # [BH, 1, Dv]
        self.lb = None if lb is None else lb.unsqueeze(-2)
        self.N, self.b = Ka.shape[0], Ka.shape[2]
        self.KQ = torch.cat([Ka, Qa], dim=-2)  # [N, BH, 2b, Dk1]: one product for both
        self.QK = Qa @ Ka.transpose(-1, -2)  # [N, BH, b, b]
        self.M1 = E * self.QK
        self.eta_c = eta.unsqueeze(-1)  # [N, BH, b, 1]
        self.tau_rows = tau.unsqueeze(-1)  # [BH, b, 1]
        self.tau_b = tau[:, -1:].unsqueeze(-1)  # [BH, 1, 1]
        # Keys scaled by eta and tau_b: the weight update is one fused product per step.
        self.Ka_step = Ka * (self.eta_c * self.tau_b)
        self.prior = P1 is not None


_SAVED = ("W1", "W2", "X2", "Xbar2", "g1p", "Ag1pp", "G1", "gbp", "G2", "xh", "r", "XX")


def _run(x: _Inputs, n0: int, n1: int, W1: torch.Tensor, W2: torch.Tensor,
         store: dict[str, torch.Tensor] | None, want_out: bool = True
         ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, Any, Any]:
    """Forward steps n0..n1-1 from the weights (W1, W2) entering step n0. Returns (Zbar2 per
    step, W1, W2 after them, and the gradient sums S1, S2 of a last partial mini-batch or None).
    ``store``: buffers [n1 - n0, ...] (``_alloc``) that receive the entering weights and the
    rows the backward pass reads; None: plain operations only (then autograd can differentiate
    this, which double backward uses)."""
    b, Dh = x.b, W2.shape[-2] - x.has_b2
    outs, S1, S2 = [], None, None
    for n in range(n0, n1):
        j = n - n0
        st = None if store is None else {k: v[j] for k, v in store.items()}
        if st is not None:
            st["W1"].copy_(W1)
            st["W2"].copy_(W2)
        Z = x.KQ[n] @ W1  # [BH, 2b, Dh]
        Z1, Zq1 = Z[:, :b], Z[:, b:]
        X2 = st["X2"] if st is not None else Z.new_ones(Z.shape[0], b, Dh + x.has_b2)
        _, g1p, g1pp = _gelu_parts(Z1, out=X2[..., :Dh] if st is not None else None, second=True)
        if st is None:
            X2 = torch.cat([_, X2[..., Dh:]], dim=-1)
        Z2 = X2 @ W2  # [BH, b, Dv]
        G2, xh, r = _ln_grad(Z2, x.tgt[n], x.lw, x.lb)
        A = G2 @ W2[:, :Dh].transpose(-1, -2)  # [BH, b, Dh]
        G1 = torch.mul(A, g1p, out=None if st is None else st["G1"])
        Zbar1 = torch.baddbmm(Zq1, x.M1[n], G1, alpha=-1)
        if n == 0 and x.prior:
            Zbar1 = Zbar1 - x.tau_rows * (x.Qa[0] @ x.P1)
        Xbar2 = st["Xbar2"] if st is not None else None
        xb, gbp, _ = _gelu_parts(Zbar1, out=Xbar2[..., :Dh] if st is not None else None)
        if st is None:
            Xbar2 = torch.cat([xb, X2[..., Dh:]], dim=-1)
        XX = torch.matmul(Xbar2, X2.transpose(-1, -2), out=None if st is None else st["XX"])
        if want_out:
            Zq2 = Xbar2 @ W2
            if n == 0 and x.prior:
                Zq2 = Zq2 - x.tau_rows * (Xbar2 @ x.P2)
            outs.append(torch.baddbmm(Zq2, x.E[n] * XX, G2, alpha=-1))
        if st is not None:
            st["g1p"].copy_(g1p)
            torch.mul(A, g1pp, out=st["Ag1pp"])
            st["gbp"].copy_(gbp)
            st["G2"].copy_(G2)
            if xh is not None:
                st["xh"].copy_(xh)
                st["r"].copy_(r)
        X2_eta = X2 * x.eta_c[n]
        if n == x.N - 1 and x.tail:
            # A last, partly filled mini-batch: its weights stay, its gradient sums go out.
            S1 = x.Ka[n].transpose(-1, -2) @ (G1 * x.eta_c[n])
            S2 = X2_eta.transpose(-1, -2) @ G2
            if n == 0 and x.prior:
                S1, S2 = S1 + x.P1, S2 + x.P2
            continue
        if n == 0 and x.prior:  # SPEC 2.3: W_b = W_0 - tau_b (carried sums + this call's)
            W1, W2 = W1 - x.tau_b * x.P1, W2 - x.tau_b * x.P2
        W1 = torch.baddbmm(W1, x.Ka_step[n].transpose(-1, -2), G1, alpha=-1)
        W2 = torch.baddbmm(W2, (X2_eta * x.tau_b).transpose(-1, -2), G2, alpha=-1)
    return outs, W1, W2, S1, S2


def _alloc(x: _Inputs, n: int, W1: torch.Tensor, W2: torch.Tensor) -> dict[str, torch.Tensor]:
    """Buffers for ``n`` steps' saved rows (see ``_run``)."""
    BH, b, Dh1, Dv = W1.shape[0], x.b, W2.shape[-2], W2.shape[-1]
    Dh = W1.shape[-1]
    shapes = {
        "W1": W1.shape[1:], "W2": W2.shape[1:], "X2": (b, Dh1), "Xbar2": (b, Dh1),
        "g1p": (b, Dh), "Ag1pp": (b, Dh), "G1": (b, Dh), "gbp": (b, Dh), "G2": (b, Dv),
        "xh": (b, Dv) if x.lw is not None else (0,), "r": (b, 1) if x.lw is not None else (0,),
        "XX": (b, b),
    }
    bufs = {k: W1.new_empty(n, BH, *s) for k, s in shapes.items()}
    if x.has_b2:  # the bias's column of ones, written once
        bufs["X2"][..., -1] = 1.0
        bufs["Xbar2"][..., -1] = 1.0
    return bufs


def _backward_group(x: _Inputs, n0: int, n1: int, st: dict[str, torch.Tensor],
                    dO: torch.Tensor, D1: torch.Tensor, D2: torch.Tensor,
                    tail_base: tuple[torch.Tensor, torch.Tensor] | None,
                    acc: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Reverse steps n1-1..n0 with the saved rows ``st`` of these steps and the gradient
    dO [N, BH, b, Dv] of every Zbar2. D1, D2: the gradient w.r.t. the weights leaving step
    n1-1, or, when that is a partial last mini-batch (``tail_base`` given), w.r.t. its gradient
    sums, ``tail_base`` then being the gradient w.r.t. its unchanged weights.
    Writes the per-token gradients into ``acc`` and returns the gradient w.r.t. the weights
    entering step n0."""
    b, Dh = x.b, st["g1p"].shape[-1]
    sl = slice(n0, n1)
    E, dOg = x.E[sl], dO[sl]
    G2, X2, Xbar2 = st["G2"], st["X2"], st["Xbar2"]
    # Batched over the group: Zbar2's b x b term -(E * Xbar2 X2^T) G2.
    dM2 = -(dOg @ G2.transpose(-1, -2))  # [n, BH, b, b]
    R2 = dM2 * E
    dXbar2_pre = R2 @ X2  # [n, BH, b, Dh1]
    dX2_pre = R2.transpose(-1, -2) @ Xbar2
    dG2_pre = -((E * st["XX"]).transpose(-1, -2) @ dOg)  # [n, BH, b, Dv]
    dE = dM2 * st["XX"]
    del R2, dM2
    dZbar1s = torch.empty_like(st["G1"])
    dgs = torch.empty_like(G2)
    dKQ = x.KQ.new_empty(n1 - n0, *x.KQ.shape[1:])
    deta = x.eta.new_zeros(n1 - n0, *x.eta.shape[1:])
    dtau = acc["dtau"]
    tau_b, lw = x.tau_b, x.lw
    for n in range(n1 - 1, n0 - 1, -1):
        j = n - n0
        W1, W2 = st["W1"][j], st["W2"][j]
        last = tail_base is not None and n == n1 - 1
        base1, base2 = tail_base if last else (D1, D2)  # the weights' own path through the step
        # D: the gradient of what this step hands on; ce = d(hand-off)/d(sums) * eta per row.
        ce = x.eta_c[n] if last else -tau_b * x.eta_c[n]  # [BH, b, 1]
        dOn = dOg[j]
        dXbar2 = torch.baddbmm(dXbar2_pre[j], dOn, W2.transpose(-1, -2))  # [BH, b, Dh1]
        if n == 0 and x.prior:
            tdO = x.tau_rows * dOn
            dXbar2 = dXbar2 - tdO @ x.P2.transpose(-1, -2)
            acc["dP2"] = acc["dP2"] - Xbar2[j].transpose(-1, -2) @ tdO
            dtau -= (dOn * (Xbar2[j] @ x.P2)).sum(-1)
        dZbar1 = torch.mul(dXbar2[..., :Dh], st["gbp"][j], out=dZbar1s[j])
        U1 = x.Ka[n] @ D1  # [BH, b, Dh]
        U2 = X2[j] @ D2  # [BH, b, Dv]
        dG1 = torch.baddbmm(ce * U1, x.M1[n].transpose(-1, -2), dZbar1, alpha=-1)
        dA = dG1 * st["g1p"][j]
        dZ1 = dG1 * st["Ag1pp"][j]
        dG2 = torch.baddbmm(torch.addcmul(dG2_pre[j], ce, U2), dA, W2[:, :Dh])
        if lw is None:
            dZ2 = dgs[j].copy_(dG2)
        else:
            dZ2, dg = _ln_grad_backward(dG2, G2[j], st["xh"][j], st["r"][j], x.tgt[n], lw, x.lb)
            dgs[j].copy_(dg)
        dX2 = torch.baddbmm(dX2_pre[j], ce * G2[j], D2.transpose(-1, -2))
        dX2 = torch.baddbmm(dX2, dZ2, W2.transpose(-1, -2))
        dZ1 = torch.addcmul(dZ1, dX2[..., :Dh], st["g1p"][j])
        dZcat = torch.cat([dZ1, dZbar1], dim=-2)  # [BH, 2b, Dh]
        torch.matmul(dZcat, W1.transpose(-1, -2), out=dKQ[j])
        dKQ[j, :, :b].baddbmm_(ce * st["G1"][j], D1.transpose(-1, -2))
        r12 = (U1 * st["G1"][j]).sum(-1) + (U2 * G2[j]).sum(-1)  # [BH, b]
        deta[j] = r12 if last else -tau_b.view(-1, 1) * r12  # through the gradient sums
        if n == 0 and x.prior:
            coef = 1 if last else -tau_b
            acc["dP1"] = acc["dP1"] + coef * D1
            acc["dP2"] = acc["dP2"] + coef * D2
            tdZ = x.tau_rows * dZbar1
            acc["dQa0"] = -(tdZ @ x.P1.transpose(-1, -2))
            acc["dP1"] = acc["dP1"] - x.Qa[0].transpose(-1, -2) @ tdZ
            dtau -= (dZbar1 * (x.Qa[0] @ x.P1)).sum(-1)
            if not last:
                dtau[:, -1] -= (D1 * x.P1).sum((-1, -2)) + (D2 * x.P2).sum((-1, -2))
        if not last:
            dtau[:, -1] -= (r12 * x.eta[n]).sum(-1)
        dW1 = torch.baddbmm(base1, x.KQ[n].transpose(-1, -2), dZcat)
        dW2 = torch.baddbmm(base2, Xbar2[j].transpose(-1, -2), dOn)
        dW2 = torch.baddbmm(dW2, X2[j].transpose(-1, -2), dZ2)
        dW2[:, :Dh].baddbmm_(dA.transpose(-1, -2), G2[j])
        D1, D2 = dW1, dW2
    # Batched again: the keys' and queries' share through M1 = E * Qa Ka^T.
    dM1 = -(dZbar1s @ st["G1"].transpose(-1, -2))  # [n, BH, b, b]
    dE = dE + dM1 * x.QK[sl]
    R1 = dM1 * E
    dKa = dKQ[:, :, :b] + R1.transpose(-1, -2) @ x.Qa[sl]
    dQa = dKQ[:, :, b:] + R1 @ x.Ka[sl]
    acc["dKa"][sl], acc["dQa"][sl], acc["dE"][sl], acc["deta"][sl] = dKa, dQa, dE, deta
    if lw is None:
        acc["dtgt"][sl] = -dgs
    else:
        acc["dtgt"][sl] = -lw * dgs
        y = lw * st["xh"] if x.lb is None else torch.addcmul(x.lb, lw, st["xh"])
        # per row here, summed once at the end: the same sums whatever the checkpoint groups
        acc["dlw_rows"][sl] = dgs * (y - x.tgt[sl] + lw * st["xh"])
    return D1, D2


class MLPScan(torch.autograd.Function):
    """The scan as one autograd node (module docstring). ``apply(Ka, Qa, tgt, eta, E, tau, W1,
    W2, P1, P2, lw, lb, has_b2, tail, group)`` with the layouts of ``_Inputs`` and W1
    [BH, Dk1, Dh], W2 [BH, Dh1, Dv] -> (Zbar2 [N, BH, b, Dv], W1, W2 after the last full
    mini-batch, and with ``tail`` the last partial mini-batch's gradient sums S1, S2, else None).
    ``group``: checkpoint groups of this many mini-batches (None: keep every step's rows)."""

    @staticmethod
    def forward(ctx, Ka, Qa, tgt, eta, E, tau, W1, W2, P1, P2, lw, lb, has_b2, tail,
                group):  # type: ignore[override]
        x = _Inputs(Ka, Qa, tgt, eta, E, tau, P1, P2, lw, lb, has_b2, tail)
        N = x.N
        ctx.set_materialize_grads(False)
        ctx.meta = (has_b2, tail, group)
        if not any(ctx.needs_input_grad):
            outs, W1f, W2f, S1, S2 = _run(x, 0, N, W1, W2, None)
            return torch.stack(outs), W1f, W2f, S1, S2
        if group is None or group >= N:
            store = _alloc(x, N, W1, W2)
            outs, W1f, W2f, S1, S2 = _run(x, 0, N, W1, W2, store)
            saved = [store[k] for k in _SAVED]
        else:  # keep only the weights entering each group (recomputed from there in backward)
            starts = range(0, N, group)
            W1g, W2g = W1.new_empty(len(starts), *W1.shape), W2.new_empty(len(starts), *W2.shape)
            outs, W1f, W2f = [], W1, W2
            for i, n0 in enumerate(starts):
                W1g[i].copy_(W1f)
                W2g[i].copy_(W2f)
                o, W1f, W2f, S1, S2 = _run(x, n0, min(n0 + group, N), W1f, W2f, None)
                outs += o
            saved = [W1g, W2g]
        ctx.save_for_backward(Ka, Qa, tgt, eta, E, tau, W1, W2, P1, P2, lw, lb, *saved)
        return torch.stack(outs), W1f, W2f, S1, S2

    @staticmethod
    def backward(ctx, dO, dW1f, dW2f, dS1, dS2):  # type: ignore[override]
        Ka, Qa, tgt, eta, E, tau, W1, W2, P1, P2, lw, lb, *saved = ctx.saved_tensors
        has_b2, tail, group = ctx.meta
        inputs = (Ka, Qa, tgt, eta, E, tau, W1, W2, P1, P2, lw, lb)
        if torch.is_grad_enabled():
            return _double_backward_ready(ctx, inputs, (dO, dW1f, dW2f, dS1, dS2))
        x = _Inputs(Ka, Qa, tgt, eta, E, tau, P1, P2, lw, lb, has_b2, tail)
        N = x.N
        z = torch.zeros_like
        dO = z(tgt) if dO is None else dO
        D1 = z(W1) if dW1f is None else dW1f
        D2 = z(W2) if dW2f is None else dW2f
        acc: dict[str, Any] = {
            "dKa": torch.empty_like(Ka), "dQa": torch.empty_like(Qa), "dE": torch.empty_like(E),
            "deta": torch.empty_like(eta), "dtgt": torch.empty_like(tgt), "dtau": z(tau),
            "dlw_rows": None if lw is None else torch.empty_like(tgt),
            "dP1": None if P1 is None else z(P1), "dP2": None if P2 is None else z(P2),
        }
        if tail:  # the last step hands on its gradient sums; its weights leave unchanged
            tail_in = (z(W1) if dS1 is None else dS1, z(W2) if dS2 is None else dS2)
        if group is None or group >= N:
            groups = [(0, N, dict(zip(_SAVED, saved)))]
        else:
            W1g, W2g = saved
            groups = [(n0, min(n0 + group, N), (W1g[i], W2g[i]))
                      for i, n0 in enumerate(range(0, N, group))]
        for n0, n1, st in reversed(groups):
            if isinstance(st, tuple):  # checkpointed: this group's forward steps again
                store = _alloc(x, n1 - n0, W1, W2)
                _run(x, n0, n1, *st, store, want_out=False)
                st = store
            last_tail = tail and n1 == N
            D1, D2 = _backward_group(x, n0, n1, st, dO, *(tail_in if last_tail else (D1, D2)),
                                     (D1, D2) if last_tail else None, acc)
            del st
        if P1 is not None:
            acc["dQa"][0] += acc["dQa0"]
        dlw = None if lw is None else acc["dlw_rows"].sum((0, 2))
        dlb = None if lb is None else -acc["dtgt"].sum((0, 2))  # d/dbeta = gamma dg = -d/dtgt
        return (acc["dKa"], acc["dQa"], acc["dtgt"], acc["deta"], acc["dE"], acc["dtau"], D1, D2,
                acc["dP1"], acc["dP2"], dlw, dlb, None, None, None)


def _double_backward_ready(ctx: Any, inputs: tuple[Any, ...], grads: tuple[Any, ...]
                           ) -> tuple[Any, ...]:
    """The backward pass under create_graph: autograd through a plain re-run of the steps, so
    that the gradients are themselves differentiable."""
    has_b2, tail, _ = ctx.meta
    x = _Inputs(*inputs[:6], *inputs[8:], has_b2, tail)
    outs, W1f, W2f, S1, S2 = _run(x, 0, x.N, inputs[6], inputs[7], None)
    got = [torch.stack(outs), W1f, W2f, S1, S2]
    pairs = [(o, g) for o, g in zip(got, grads) if o is not None and g is not None]
    wrt = [(i, t) for i, t in enumerate(inputs) if t is not None and ctx.needs_input_grad[i]]
    res = torch.autograd.grad([o for o, _ in pairs], [t for _, t in wrt],
                              [g for _, g in pairs], create_graph=True, allow_unused=True)
    out: list[Any] = [None] * 15
    for (i, _), r in zip(wrt, res):
        out[i] = r
    return tuple(out)
