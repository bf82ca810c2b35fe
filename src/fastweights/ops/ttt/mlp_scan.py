"""TTT-MLP's dual-form mini-batch scan (docs/maths.md 2.4) with a hand-written backward pass.

Dimension legend: N mini-batches, BH = B * H (batch and heads folded into one dim), b mini-batch
size, Dk1 = Dk (+1 with the bias b1), Dh = 4 Dk hidden size, Dh1 = Dh (+1 with the bias b2),
Dv value dim. Step-major layout: per-token tensors ``[N, BH, b, D]``, contiguous, so every
step reads one contiguous batch of small matrices.

Per mini-batch n with entering weights (W1, W2) (biases folded in as extra rows, chunk.py's
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
products with E, the LayerNorm's affine gradients, eta's, tau's and the keys' and queries'
shares through the gradient sums and M1) is batched over a segment of steps before or after
the loop; per step the loop does the products with the step's weights and with D. It
differentiates twice through the LayerNorm (dl/dZ2 is a gradient already) and through gelu'
(gelu'' appears). The weights entering each step are not stored but rebuilt in reverse from
the weights leaving it, by undoing the forward's rank-b update (``_Walk``), starting afresh
from exact copies every ``anchor`` (at most 16) steps; they differ from the forward's by the
rounding of at most ``anchor`` additions (tests: float64 against autograd through the oracle).

Memory trade (``checkpoint_group``): by default the forward pass keeps the per-token rows the
backward pass reads (about 6 Dh + 3 Dv floats per token and head) and the weights every
``anchor`` steps; nothing of a step is computed twice. (Kept per step, the weights alone would be
2 Dh Dk floats per head and mini-batch; autograd through the plain scan keeps both and more.)
With ``checkpoint_group=g`` it keeps only the weights entering every g-th mini-batch (and the
anchors) and the backward pass runs each group's forward steps again, one more forward of the
scan, holding one group's rows at a time. Results are bit-identical either way. The peak memory
of each choice: docs/performance.md (benchmarks/results/cpu_ttt_mlp_backward).

Double backward (create_graph=True): the backward pass then differentiates a plain re-run of
the same steps with autograd, so second derivatives are exact too (slow, for tests).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .common import LN_EPS, gelu, gelu_grad

_C = math.sqrt(2.0 / math.pi)
_A = 0.044715


def _gelu_parts(x: torch.Tensor, y_out: torch.Tensor, g1_out: torch.Tensor | None = None,
                second: bool = False, first: bool = True
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """gelu_tanh(x) written into ``y_out``; returns gelu'(x) (into ``g1_out`` when given; None
    without ``first``, which skips it) and, with ``second``, gelu''(x). No autograd (in-place
    steps). One logistic sigmoid serves all
    three: 0.5 (1 + tanh u) = sigmoid(2u), u = c (x + a x^3), and torch's CPU tanh is slower
    than its sigmoid (docs/performance.md). With s = sigmoid(2u), u' = c (1 + 3 a x^2):
    gelu = x s, gelu' = s + 2 x u' s (1 - s), gelu'' = 4 s (1 - s) (u' + 3 a c x^2
    + x u'^2 (1 - 2 s))."""
    x2 = x * x
    s = x2.mul(2 * _C * _A).add_(2 * _C).mul_(x).sigmoid_()
    torch.mul(x, s, out=y_out)
    if not first:
        return None, None
    ss = torch.addcmul(s, s, s, value=-1)  # s (1 - s)
    up = x2.mul(3 * _C * _A).add_(_C)  # u'
    t = up * x
    g1 = torch.addcmul(s, t, ss, value=2, out=g1_out)
    if not second:
        return g1, None
    q = t.mul_(up)
    q.addcmul_(q, s, value=-2)  # x u'^2 (1 - 2 s)
    return g1, x2.mul_(3 * _A * _C).add_(up).add_(q).mul_(ss).mul_(4)


def _ln_grad(z: torch.Tensor, tgt: torch.Tensor, lw: torch.Tensor | None,
             lb: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """dl/dZ of 1/2 ||[LN](Z) - tgt||^2 per row (docs/maths.md 2.2), with the LayerNorm's x_hat and
    1/s for the backward pass (None without LayerNorm). lw, lb: [BH, 1, Dv]. Plain
    operations (the double-backward reference uses it too)."""
    if lw is None:
        return z - tgt, None, None
    zc = z - z.mean(-1, keepdim=True)
    r = torch.rsqrt(zc.square().mean(-1, keepdim=True) + LN_EPS)
    xh = zc * r
    y = lw * xh if lb is None else torch.addcmul(lb, lw, xh)
    g = lw * (y - tgt)
    G = (g - g.mean(-1, keepdim=True) - xh * (g * xh).mean(-1, keepdim=True)) * r
    return G, xh, r


def _ln_backward(v: torch.Tensor, z: torch.Tensor, mean: torch.Tensor, r: torch.Tensor
                 ) -> torch.Tensor:
    """ATen's LayerNorm backward kernel (no affine) applied to v:
    r (v - mean(v) - x_hat mean(v x_hat)), x_hat = (z - mean) r."""
    return torch.ops.aten.native_layer_norm_backward(v, z, z.shape[-1:], mean, r, None, None,
                                                     [True, False, False])[0]


def _ln_grad_fast(z: torch.Tensor, tgt: torch.Tensor, lw: torch.Tensor | None,
                  lb: torch.Tensor | None) -> tuple[torch.Tensor, Any, Any]:
    """``_ln_grad`` from ATen's fused LayerNorm kernels (the gradient through a LayerNorm
    without affine is its backward kernel applied to g = gamma (LN(Z) - tgt)). Returns
    (dl/dZ, mean, 1/s) (the statistics None without LayerNorm)."""
    if lw is None:
        return z - tgt, None, None
    xh, mean, r = torch.native_layer_norm(z, z.shape[-1:], None, None, LN_EPS)
    y = lw * xh if lb is None else torch.addcmul(lb, lw, xh)
    return _ln_backward(y.sub_(tgt).mul_(lw), z, mean, r), mean, r


class _LNRows:
    """What the backward pass of ``_ln_grad`` needs that does not depend on the incoming
    gradient, for a segment of steps at once: x_hat, e = LN(Z) - tgt, g = gamma e, r x_hat,
    c = r mean(g x_hat) and gamma^2 ([n, BH, b, *] from z2, mean, r [n, BH, b, Dv / 1])."""

    def __init__(self, z: torch.Tensor, mean: torch.Tensor, r: torch.Tensor, tgt: torch.Tensor,
                 lw: torch.Tensor, lb: torch.Tensor | None):
        self.xh = (z - mean).mul_(r)
        self.e = (lw * self.xh if lb is None else torch.addcmul(lb, lw, self.xh)).sub_(tgt)
        self.g = lw * self.e
        self.rxh = r * self.xh
        self.c = (self.g * self.xh).mean(-1, keepdim=True).mul_(r)
        self.lw2 = lw * lw


def _ln_grad_backward(dG: torch.Tensor, G: torch.Tensor, z: torch.Tensor, mean: torch.Tensor,
                      r: torch.Tensor, g: torch.Tensor, rxh: torch.Tensor, c: torch.Tensor,
                      lw2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Vector-Jacobian product of ``_ln_grad`` w.r.t. Z, one step's rows (``_LNRows``): returns
    (dZ, dg), dg being the gradient w.r.t. g = gamma (LN(Z) - tgt), from which the target's and
    gamma/beta's come.

    With P(v) = v - mean(v) - x_hat mean(v x_hat), LNB(v) = r P(v) (ATen's kernel) and
    G = r P(g): dg = LNB(dG), dx_hat = gamma^2 dg - r mean(g x_hat) dG - g mean(dG r x_hat),
    dZ = r (dx_hat - mean(dx_hat) - x_hat (mean(dG G) + mean(dx_hat x_hat)))
       = LNB(dx_hat) - r x_hat mean(dG G)."""
    dg = _ln_backward(dG, z, mean, r)
    dxh = (lw2 * dg).addcmul_(c, dG, value=-1).addcmul_(g, (dG * rxh).mean(-1, keepdim=True),
                                                       value=-1)
    return _ln_backward(dxh, z, mean, r).addcmul_(rxh, (dG * G).mean(-1, keepdim=True),
                                                  value=-1), dg


class _Inputs:
    """The scan's inputs in step-major layout and what is derived from them once per call.

    KQ [N, BH, 2b, Dk1] (each step's keys, then its queries; Ka, Qa are views of the halves);
    tgt [N, BH, b, Dv]; eta [N, BH, b]; E [N, BH, b, b]; tau [BH, b]; P1 [BH, Dk1, Dh],
    P2 [BH, Dh1, Dv] or None; lw, lb [BH, Dv] or None."""

    def __init__(self, KQ, tgt, eta, E, tau, P1, P2, lw, lb, Dh: int, has_b2: bool,
                 tail: bool):
        b = tgt.shape[2]
        Ka, Qa = KQ[:, :, :b], KQ[:, :, b:]
        self.Ka, self.Qa, self.tgt, self.eta, self.E, self.tau = Ka, Qa, tgt, eta, E, tau
        self.P1, self.P2, self.Dh, self.has_b2, self.tail = P1, P2, Dh, has_b2, tail
        self.lw = None if lw is None else lw.unsqueeze(-2)  # [BH, 1, Dv]
        self.lb = None if lb is None else lb.unsqueeze(-2)
        self.N, self.b = KQ.shape[0], b
        self.KQ = KQ  # one product for keys and queries per step
        self.QK = Qa @ Ka.transpose(-1, -2)  # [N, BH, b, b]
        self.M1 = E * self.QK
        self.eta_c = eta.unsqueeze(-1)  # [N, BH, b, 1]
        self.tau_rows = tau.unsqueeze(-1)  # [BH, b, 1]
        self.tau_b = tau[:, -1:].unsqueeze(-1)  # [BH, 1, 1]
        self.prior = P1 is not None
        # Every ``anchor``-th step's entering weights are kept exactly (``_Walk``); a function
        # of the shapes only, so that checkpoint groups change no result.
        self.anchor = max(1, min(16, _SEGMENT_FLOATS // (Ka.shape[1] * self.b * (Dh + 1))))
        # Per-step views, taken once (indexing in the loops costs more than it seems).
        self.eta_tb = self.eta_c * self.tau_b  # eta_j tau_b: a step's update weights
        self.steps = list(zip(self.KQ.unbind(0), tgt.unbind(0), self.M1.unbind(0),
                              E.unbind(0), self.eta_c.unbind(0), self.eta_tb.unbind(0),
                              (Ka * self.eta_tb).transpose(-1, -2).unbind(0)))

    def hands_on_sums(self, n: int) -> bool:
        """Whether step n is a last, partly filled mini-batch (its sums go out, not an update)."""
        return self.tail and n == self.N - 1


# The rows the backward pass reads, per step: [n, BH, ...] each per segment of n steps (``_alloc``).
_SAVED = ("X2", "Xbar2", "g1p", "Ag1pp", "G1", "gbp", "G2", "z2", "mean", "r", "XX")


def _alloc(x: _Inputs, n: int, W1: torch.Tensor, W2: torch.Tensor) -> dict[str, torch.Tensor]:
    """Buffers for ``n`` steps' saved rows (``_run``)."""
    BH, b, Dh, Dh1, Dv = W1.shape[0], x.b, x.Dh, W2.shape[-2], W2.shape[-1]
    ln = x.lw is not None
    shapes = {
        "X2": (b, Dh1), "Xbar2": (b, Dh1),
        "g1p": (b, Dh), "Ag1pp": (b, Dh), "G1": (b, Dh), "gbp": (b, Dh), "G2": (b, Dv),
        "z2": (b, Dv) if ln else (0,), "mean": (b, 1) if ln else (0,),
        "r": (b, 1) if ln else (0,), "XX": (b, b),
    }
    bufs = {k: W1.new_empty(n, BH, *s) for k, s in shapes.items()}
    if x.has_b2:  # the bias's column of ones, written once
        bufs["X2"][..., -1] = 1.0
        bufs["Xbar2"][..., -1] = 1.0
    return bufs


def _run(x: _Inputs, n0: int, n1: int, W1: torch.Tensor, W2: torch.Tensor,
         store: dict[str, torch.Tensor] | None, out: torch.Tensor | None,
         snaps: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
         ) -> tuple[torch.Tensor, torch.Tensor, Any, Any]:
    """Forward steps n0..n1-1 from the weights (W1, W2) entering step n0, without autograd.
    Writes Zbar2 of step n into out[n] (when ``out`` is given) and, with ``store`` (buffers
    [n1 - n0, ...] from ``_alloc``), the rows the backward pass reads; ``snaps``: copies of the
    weights entering each step n0 < n < n1 that is a multiple of ``x.anchor`` (``_Walk``).
    Returns (W1, W2 after the steps, gradient sums S1, S2 of a last partial mini-batch or None).
    """
    b, Dh = x.b, x.Dh
    W1, W2 = W1.clone(), W2.clone()  # updated in place
    W2h_t = W2[:, :Dh].transpose(-1, -2)  # a view of the working copy
    S1 = S2 = None
    n_st = n1 - n0
    if store is None:  # scratch rows with the bias's column of ones, reused by every step
        store = dict(zip(("X2", "Xbar2"), W2.new_ones(2, 1, W2.shape[0], b, W2.shape[-2])))
        keep, steps = False, [0] * n_st  # every step reads slot 0 of the scratch
    else:
        keep, steps = True, range(n_st)
    # per-step views of the buffers (and of their gelu part, without the bias's column), once
    X2s, Xbar2s = store["X2"].unbind(0), store["Xbar2"].unbind(0)
    X2hs, Xbar2hs = store["X2"][..., :Dh].unbind(0), store["Xbar2"][..., :Dh].unbind(0)
    names = ("g1p", "G1", "gbp", "XX", "Ag1pp", "G2", "z2", "mean", "r")
    rows = list(zip(*(store[k].unbind(0) if keep and store[k].numel() else [None] * n_st
                      for k in names)))
    for n in range(n0, n1):
        j, s = n - n0, steps[n - n0]
        kq, tgt, m1, e, eta_c, eta_tb, ka_tb_t = x.steps[n]
        g1p_o, G1_o, gbp_o, XX_o, Ag1pp_o, G2_o, z2_o, mean_o, r_o = rows[j]
        if snaps is not None and n > n0 and n % x.anchor == 0:
            snaps[n] = (W1.clone(), W2.clone())
        X2, Xbar2 = X2s[s], Xbar2s[s]
        Z = torch.matmul(kq, W1)  # [BH, 2b, Dh]: keys' and queries' hidden rows
        g1p, g1pp = _gelu_parts(Z[:, :b], X2hs[s], g1p_o, second=keep)
        Z2 = torch.matmul(X2, W2, out=z2_o)  # [BH, b, Dv]
        G2, mean, r = _ln_grad_fast(Z2, tgt, x.lw, x.lb)
        A = torch.matmul(G2, W2h_t)  # [BH, b, Dh]
        G1 = torch.mul(A, g1p, out=G1_o)
        Zbar1 = torch.baddbmm(Z[:, b:], m1, G1, alpha=-1)
        if n == 0 and x.prior:
            Zbar1.sub_(x.tau_rows * (x.Qa[0] @ x.P1))
        _gelu_parts(Zbar1, Xbar2hs[s], gbp_o, first=keep)  # gelu' only for the backward
        XX = torch.matmul(Xbar2, X2.transpose(-1, -2), out=XX_o)  # [BH, b, b]
        if out is not None:
            o = torch.matmul(Xbar2, W2, out=out[n])
            if n == 0 and x.prior:
                o.sub_(x.tau_rows * (Xbar2 @ x.P2))
            o.baddbmm_(e * XX, G2, alpha=-1)
        if keep:
            torch.mul(A, g1pp, out=Ag1pp_o)
            G2_o.copy_(G2)
            if mean is not None:
                mean_o.copy_(mean)
                r_o.copy_(r)
        if x.hands_on_sums(n):
            S1 = x.Ka[n].transpose(-1, -2) @ (G1 * eta_c)
            S2 = (X2 * eta_c).transpose(-1, -2) @ G2
            if n == 0 and x.prior:
                S1, S2 = S1 + x.P1, S2 + x.P2
            break
        if n == 0 and x.prior:  # docs/maths.md 2.3: W_b = W_0 - tau_b (carried sums + this call's)
            W1.sub_(x.tau_b * x.P1)
            W2.sub_(x.tau_b * x.P2)
        W1.baddbmm_(ka_tb_t, G1, alpha=-1)
        W2.baddbmm_(X2.transpose(-1, -2), G2 * eta_tb, alpha=-1)
    return W1, W2, S1, S2


def _reference(x: _Inputs, W1: torch.Tensor, W2: torch.Tensor) -> tuple[Any, ...]:
    """The forward steps of ``_run`` as plain differentiable operations (for double backward):
    (Zbar2 [N, BH, b, Dv], W1, W2, S1, S2)."""
    b, Dh = x.b, x.Dh

    def ones(h: torch.Tensor) -> torch.Tensor:
        return torch.cat([h, h.new_ones(*h.shape[:-1], 1)], -1) if x.has_b2 else h

    outs, S1, S2 = [], None, None
    for n in range(x.N):
        Z = x.KQ[n] @ W1
        Z1 = Z[:, :b]
        X2 = ones(gelu(Z1))
        G2 = _ln_grad(X2 @ W2, x.tgt[n], x.lw, x.lb)[0]
        G1 = (G2 @ W2[:, :Dh].transpose(-1, -2)) * gelu_grad(Z1)
        Zbar1 = Z[:, b:] - x.M1[n] @ G1
        if n == 0 and x.prior:
            Zbar1 = Zbar1 - x.tau_rows * (x.Qa[0] @ x.P1)
        Xbar2 = ones(gelu(Zbar1))
        o = Xbar2 @ W2 - (x.E[n] * (Xbar2 @ X2.transpose(-1, -2))) @ G2
        if n == 0 and x.prior:
            o = o - x.tau_rows * (Xbar2 @ x.P2)
        outs.append(o)
        sums1 = x.Ka[n].transpose(-1, -2) @ (G1 * x.eta_c[n])
        sums2 = (X2 * x.eta_c[n]).transpose(-1, -2) @ G2
        if n == 0 and x.prior:
            sums1, sums2 = sums1 + x.P1, sums2 + x.P2
        if x.hands_on_sums(n):
            S1, S2 = sums1, sums2
        else:
            W1, W2 = W1 - x.tau_b * sums1, W2 - x.tau_b * sums2
    return torch.stack(outs), W1, W2, S1, S2


class _Walk:
    """The weights entering each step, rebuilt in reverse order in the backward pass instead of
    being kept: W_n = W_{n+1} + tau_b (Ka_n eta_n)^T G1_n (likewise W2 with X2, G2), the
    forward's update undone with the same product, from the exact weights entering every
    ``x.anchor``-th step (``anchors``) or leaving the last one (``final``). Rounding can differ
    from the forward's weights by a few units in the last place (at most ``anchor`` additions);
    no weight matrix per step is stored (2 x Dh x Dk floats per head and step otherwise)."""

    def __init__(self, x: _Inputs, anchors: dict[int, tuple[torch.Tensor, torch.Tensor]],
                 final: tuple[torch.Tensor, torch.Tensor]):
        self.x, self.anchors, self.final, self.W = x, anchors, final, None

    def _start(self, W: tuple[torch.Tensor, torch.Tensor]) -> None:
        W1, W2 = (w.clone() for w in W)
        # buffers updated in place, with views of their transposes for the backward's products
        self.W = (W1, W2, W1.transpose(-1, -2), W2.transpose(-1, -2))

    def at(self, n: int, G1: torch.Tensor, X2t: torch.Tensor, G2: torch.Tensor
           ) -> tuple[torch.Tensor, ...]:
        """(W1, W2, W1^T, W2^T) entering step n (called for n = N-1 down to 0, with step n's
        rows G1, X2^T, G2)."""
        x = self.x
        if n in self.anchors:
            self._start(self.anchors[n])
        else:
            if self.W is None:  # n = N-1: start from the weights the last step leaves
                self._start(self.final)
            if not x.hands_on_sums(n):  # a partial last mini-batch leaves its weights as is
                _, _, _, _, _, eta_tb, ka_tb_t = x.steps[n]
                self.W[0].baddbmm_(ka_tb_t, G1)
                self.W[1].baddbmm_(X2t, G2 * eta_tb)
        return self.W


def _backward_group(x: _Inputs, n0: int, n1: int, st: dict[str, torch.Tensor],
                    dO: torch.Tensor, D1: torch.Tensor, D2: torch.Tensor,
                    tail_base: tuple[torch.Tensor, torch.Tensor] | None,
                    acc: dict[str, Any], walk: _Walk) -> tuple[torch.Tensor, torch.Tensor]:
    """Reverse steps n1-1..n0 with the saved rows ``st`` of these steps and the gradient
    dO [N, BH, b, Dv] of every Zbar2. D1, D2 (owned, updated in place): the gradient w.r.t. the
    weights leaving step n1-1, or, when that is a partial last mini-batch (``tail_base``
    given), w.r.t. its gradient sums, ``tail_base`` then being the gradient w.r.t. its
    unchanged weights. Writes the per-token gradients into ``acc`` and returns the gradient
    w.r.t. the weights entering step n0.

    Step n's sums S = sum_j eta_j (Ka_j^T G1_j, X2_j^T G2_j) reach what it hands on with the
    factor c = -tau_b (1 on a partial last step): with D the gradient of that, the sums give
    G1 c eta_j Ka_j D1, G2 c eta_j X2_j D2, Ka_j c eta_j G1_j D1^T, X2_j c eta_j G2_j D2^T, and
    eta_j, tau_b the rows r_j = (Ka_j D1) . G1_j + (X2_j D2) . G2_j."""
    b, Dh, n = x.b, x.Dh, n1 - n0
    sl = slice(n0, n1)
    E, dOs = x.E[sl], dO[sl]
    G1, G2, X2, Xbar2, XX = st["G1"], st["G2"], st["X2"], st["Xbar2"], st["XX"]
    # c eta_j per step and row: -tau_b eta_j, or eta_j on a partial last mini-batch
    last = tail_base is not None
    ce = x.eta_c[sl] * -x.tau_b
    if last:
        ce[-1] = x.eta_c[n1 - 1]
    # Batched over the group: Zbar2's b x b term -(E * Xbar2 X2^T) G2 (no weights in it).
    dM2 = -(dOs @ G2.transpose(-1, -2))  # [n, BH, b, b]
    R2 = dM2 * E
    dXbar2 = R2 @ X2  # [n, BH, b, Dh1]; the loop adds dO W2^T
    dX2 = R2.transpose(-1, -2) @ Xbar2  # the loop adds the rest
    dG2 = -((E * XX).transpose(-1, -2) @ dOs)  # [n, BH, b, Dv]; the loop adds the rest
    dE = dM2 * XX
    del R2, dM2
    ceG2 = ce * G2
    BH, Dk1 = x.KQ.shape[1], x.KQ.shape[-1]
    dZcat = dOs.new_empty(n, BH, 2 * b, Dh)  # [dZ1; dZbar1] per step
    dKQ = acc["dKQ"][sl]  # written per step, then the batched terms added in place
    V1 = dOs.new_empty(n, BH, b, Dk1)  # G1 D1^T per step
    r2 = x.eta.new_empty(n, BH, b)
    dgs = torch.empty_like(G2)
    dA = dOs.new_zeros(BH, b, X2.shape[-1])  # scratch; a bias column stays 0
    dAh, dAt = dA[..., :Dh], dA.transpose(-1, -2)
    lw = x.lw
    ln = None if lw is None else _LNRows(st["z2"], st["mean"], st["r"], x.tgt[sl], lw, x.lb)
    t = (-1, -2)
    # per-step views, taken once for the whole group
    views = [v.unbind(0) for v in (
        dOs, dXbar2[..., :Dh], dX2[..., :Dh], dG2, dZcat, dZcat[:, :, :b], dZcat[:, :, b:], dKQ,
        V1, r2, st["gbp"], st["g1p"], st["Ag1pp"], G1, G2, X2.transpose(*t), Xbar2.transpose(*t),
        ce, ceG2, x.Ka[sl], x.KQ[sl].transpose(*t), x.M1[sl].transpose(*t), dgs, dXbar2, dX2)]
    views += [v.unbind(0) for v in (st["z2"], st["mean"], st["r"], ln.g, ln.rxh, ln.c)] \
        if ln is not None else [[None] * n] * 6
    for j in range(n - 1, -1, -1):
        (dOn, dXbh, dXkh, dG2n, dZc, dZ1, dZbar1, dKQn, V1n, r2n, gbp, g1p, Ag1pp, G1n, G2n,
         X2t, Xb2t, cen, ceG2n, Kan, KQt, M1t, dg_n, dXb, dXk, z2n, meann, rn, gn, rxhn, cn,
         ) = (v[j] for v in views)
        _, W2, W1t, W2t = walk.at(n0 + j, G1n, X2t, G2n)
        prior = x.prior and n0 + j == 0
        dXb.baddbmm_(dOn, W2t)
        if prior:
            tdO = x.tau_rows * dOn
            dXb.sub_(tdO @ x.P2.transpose(-1, -2))
            acc["dP2"] -= Xb2t @ tdO
            acc["dtau"] -= (dOn * (Xb2t.transpose(-1, -2) @ x.P2)).sum(-1)
        torch.mul(dXbh, gbp, out=dZbar1)
        U2 = torch.matmul(X2t.transpose(-1, -2), D2)  # [BH, b, Dv]
        torch.sum(torch.mul(U2, G2n, out=dg_n), -1, out=r2n)  # dg_n: scratch until the LN
        dG1 = torch.matmul(Kan, D1).mul_(cen).baddbmm_(M1t, dZbar1, alpha=-1)
        torch.mul(dG1, g1p, out=dAh)
        torch.mul(dG1, Ag1pp, out=dZ1)
        dG2n.addcmul_(U2, cen).baddbmm_(dA, W2)
        if ln is None:
            dZ2 = dg_n.copy_(dG2n)
        else:
            dZ2, dg = _ln_grad_backward(dG2n, G2n, z2n, meann, rn, gn, rxhn, cn, ln.lw2)
            dg_n.copy_(dg)
        dXk.baddbmm_(ceG2n, D2.transpose(-1, -2)).baddbmm_(dZ2, W2t)
        dZ1.addcmul_(dXkh, g1p)
        torch.matmul(dZc, W1t, out=dKQn)
        torch.matmul(G1n, D1.transpose(-1, -2), out=V1n)
        if prior:
            coef = 1 if last and j == n - 1 else -x.tau_b
            acc["dP1"] += coef * D1
            acc["dP2"] += coef * D2
            tdZ = x.tau_rows * dZbar1
            acc["dQa0"] = -(tdZ @ x.P1.transpose(-1, -2))
            acc["dP1"] -= x.Qa[0].transpose(-1, -2) @ tdZ
            acc["dtau"] -= (dZbar1 * (x.Qa[0] @ x.P1)).sum(-1)
            if not (last and j == n - 1):
                acc["dtau"][:, -1] -= (D1 * x.P1).sum((-1, -2)) + (D2 * x.P2).sum((-1, -2))
        if last and j == n - 1:  # the sums' gradient is used up; the weights' own path goes on
            D1, D2 = tail_base[0].clone(), tail_base[1].clone()
        D1.baddbmm_(KQt, dZc)
        D2.baddbmm_(Xb2t, dOn).baddbmm_(X2t, dZ2).baddbmm_(dAt, G2n)
    # Batched again: eta's and tau_b's share through the sums, and the keys' and queries'
    # through the sums and M1 = E * Qa Ka^T.
    Ka, Qa = x.Ka[sl], x.Qa[sl]
    r = (V1 * Ka).sum(-1).add_(r2)  # [n, BH, b]
    acc["deta"][sl] = r * -x.tau_b.squeeze(-1)
    if last:
        acc["deta"][n1 - 1] = r[-1]
    steps_b = r[:-1] if last else r
    acc["dtau"][:, -1] -= (steps_b * x.eta[n0:n0 + steps_b.shape[0]]).sum((0, 2))
    dM1 = -(dZcat[:, :, b:] @ G1.transpose(-1, -2))  # [n, BH, b, b]
    dE += dM1 * x.QK[sl]
    R1 = dM1 * E
    dKQ[:, :, :b].addcmul_(V1, ce).add_(R1.transpose(-1, -2) @ Qa)
    dKQ[:, :, b:].add_(R1 @ Ka)
    acc["dE"][sl] = dE
    if ln is None:
        acc["dtgt"][sl] = -dgs
    else:
        acc["dtgt"][sl] = -lw * dgs
        # per row here, summed once at the end: the same sums whatever the checkpoint groups
        acc["dlw_rows"][sl] = dgs * torch.addcmul(ln.e, lw, ln.xh)  # dg dg/dgamma
    return D1, D2


def _segments(N: int, size: int) -> list[tuple[int, int]]:
    """(n0, n1) of consecutive runs of ``size`` steps covering 0..N-1."""
    return [(n0, min(n0 + size, N)) for n0 in range(0, N, size)]


# Saved rows and the backward pass's scratch are kept per segment of ``anchor`` steps (at most
# 16, measured fastest at T 4096: docs/performance.md), with buffers of
# at most about this many floats per row kind: large buffers come back from the C allocator as
# fresh pages on every call, whose first-touch faults cost as much as filling them.
_SEGMENT_FLOATS = 1 << 22


class MLPScan(torch.autograd.Function):
    """The scan as one autograd node (module docstring). ``apply(KQ, tgt, eta, E, tau, W1,
    W2, P1, P2, lw, lb, has_b2, tail, group)`` with the layouts of ``_Inputs`` and W1
    [BH, Dk1, Dh], W2 [BH, Dh1, Dv] -> (Zbar2 [N, BH, b, Dv], W1, W2 after the last full
    mini-batch, and with ``tail`` the last partial mini-batch's gradient sums S1, S2, else None).
    ``group``: checkpoint groups of this many mini-batches (None: keep every step's rows)."""

    @staticmethod
    def forward(ctx, KQ, tgt, eta, E, tau, W1, W2, P1, P2, lw, lb, has_b2, tail,
                group):  # type: ignore[override]
        Dh = W1.shape[-1]
        x = _Inputs(KQ, tgt, eta, E, tau, P1, P2, lw, lb, Dh, has_b2, tail)
        N = x.N
        ctx.set_materialize_grads(False)
        out = tgt.new_empty(N, *tgt.shape[1:])
        if not any(ctx.needs_input_grad):
            W1f, W2f, S1, S2 = _run(x, 0, N, W1, W2, None, out)
            return out, W1f, W2f, S1, S2
        W1f, W2f, saved, anchors = W1, W2, [], {}
        if group is None:  # keep every step's rows, in segments of ``anchor`` steps
            segments = _segments(N, x.anchor)
            for n0, n1 in segments:
                anchors[n0] = (W1f, W2f)  # _run never writes into the weights it is given
                store = _alloc(x, n1 - n0, W1, W2)
                W1f, W2f, S1, S2 = _run(x, n0, n1, W1f, W2f, store, out)
                saved += [store[k] for k in _SAVED]
        else:  # keep the weights entering each group (its steps run again in backward)
            segments = _segments(N, group)
            for n0, n1 in segments:
                anchors[n0] = (W1f, W2f)
                saved += [W1f, W2f]
                W1f, W2f, S1, S2 = _run(x, n0, n1, W1f, W2f, None, out, anchors)
            # the same anchors as without groups: every anchor-th step's entering weights
            anchors = {n: w for n, w in anchors.items() if n % x.anchor == 0}
        ctx.meta = (Dh, has_b2, tail, group, segments, sorted(anchors))
        ctx.save_for_backward(KQ, tgt, eta, E, tau, W1, W2, P1, P2, lw, lb, W1f, W2f,
                              *(w for n in sorted(anchors) for w in anchors[n]), *saved)
        return out, W1f, W2f, S1, S2

    @staticmethod
    def backward(ctx, dO, dW1f, dW2f, dS1, dS2):  # type: ignore[override]
        KQ, tgt, eta, E, tau, W1, W2, P1, P2, lw, lb, W1f, W2f, *saved = ctx.saved_tensors
        Dh, has_b2, tail, group, segments, anchor_steps = ctx.meta
        na = 2 * len(anchor_steps)
        anchors = {n: (saved[2 * i], saved[2 * i + 1]) for i, n in enumerate(anchor_steps)}
        saved = saved[na:]
        if torch.is_grad_enabled():  # create_graph: differentiate a plain re-run instead
            return _double_backward(ctx, (KQ, tgt, eta, E, tau, W1, W2, P1, P2, lw, lb),
                                    (dO, dW1f, dW2f, dS1, dS2))
        x = _Inputs(KQ, tgt, eta, E, tau, P1, P2, lw, lb, Dh, has_b2, tail)
        N = x.N
        z = torch.zeros_like
        dO = z(tgt) if dO is None else dO
        D1 = z(W1) if dW1f is None else dW1f.clone()
        D2 = z(W2) if dW2f is None else dW2f.clone()
        acc: dict[str, Any] = {
            "dKQ": torch.empty_like(KQ), "dE": torch.empty_like(E),
            "deta": torch.empty_like(eta), "dtgt": torch.empty_like(tgt), "dtau": z(tau),
            "dlw_rows": None if lw is None else torch.empty_like(tgt),
            "dP1": None if P1 is None else z(P1), "dP2": None if P2 is None else z(P2),
        }
        if tail:  # the last step hands on its gradient sums; its weights leave unchanged
            tail_base = (D1, D2)
            D1 = z(W1) if dS1 is None else dS1.clone()
            D2 = z(W2) if dS2 is None else dS2.clone()
        per = 2 if group is not None else len(_SAVED)
        walk = _Walk(x, anchors, (W1f, W2f))
        for i in reversed(range(len(segments))):
            n0, n1 = segments[i]
            items = saved[i * per:(i + 1) * per]
            if group is not None:  # checkpointed: this group's forward steps again
                st = _alloc(x, n1 - n0, W1, W2)
                _run(x, n0, n1, *items, st, None)
            else:
                st = dict(zip(_SAVED, items))
            D1, D2 = _backward_group(x, n0, n1, st, dO, D1, D2,
                                     tail_base if tail and n1 == N else None, acc, walk)
            del st, items
        if P1 is not None:
            acc["dKQ"][0, :, x.b:] += acc["dQa0"]
        dlw = None if lw is None else acc["dlw_rows"].sum((0, 2))
        dlb = None if lb is None else -acc["dtgt"].sum((0, 2))  # d/dbeta = gamma dg = -d/dtgt
        return (acc["dKQ"], acc["dtgt"], acc["deta"], acc["dE"], acc["dtau"], D1, D2,
                acc["dP1"], acc["dP2"], dlw, dlb, None, None, None)


def mlp_scan(KQ: torch.Tensor, tgt: torch.Tensor, eta: torch.Tensor,
             E: torch.Tensor, tau: torch.Tensor, W1: torch.Tensor, W2: torch.Tensor,
             P1: torch.Tensor | None, P2: torch.Tensor | None, lw: torch.Tensor | None,
             lb: torch.Tensor | None, has_b2: bool, tail: bool, group: int | None
             ) -> tuple[Any, ...]:
    """The scan (``MLPScan``'s arguments and results): through the autograd node when a
    gradient is being recorded, else straight (nothing kept; inside a Function's forward the
    caller's grad mode cannot be seen, so an inference call would keep the rows for nothing)."""
    inputs = (KQ, tgt, eta, E, tau, W1, W2, P1, P2, lw, lb)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs):
        return MLPScan.apply(*inputs, has_b2, tail, group)
    x = _Inputs(KQ, tgt, eta, E, tau, P1, P2, lw, lb, W1.shape[-1], has_b2, tail)
    out = tgt.new_empty(tgt.shape)
    return out, *_run(x, 0, x.N, W1, W2, None, out)


def _double_backward(ctx: Any, inputs: tuple[Any, ...], grads: tuple[Any, ...]
                     ) -> tuple[Any, ...]:
    """The backward pass under create_graph: autograd through ``_reference``, so that the
    gradients are themselves differentiable. ``inputs``: the saved (KQ, tgt, eta, E, tau, W1,
    W2, P1, P2, lw, lb).

    The reference runs on an alias of each input (``view_as``: a node of its own, still wired to
    the input's history). The inputs can depend on one another (the caller forms E from eta,
    and the residual target from the keys in KQ): a gradient taken w.r.t. the inputs
    themselves would be each one's total derivative, paths through the others included, and the
    caller's graph would then add those paths a second time. W.r.t. the aliases it is the
    partial derivative this node must return."""
    Dh, has_b2, tail = ctx.meta[:3]
    alias = [None if t is None else t.view_as(t) for t in inputs]
    KQ, tgt, eta, E, tau, W1, W2, P1, P2, lw, lb = alias
    x = _Inputs(KQ, tgt, eta, E, tau, P1, P2, lw, lb, Dh, has_b2, tail)
    pairs = [(o, g) for o, g in zip(_reference(x, W1, W2), grads) if o is not None and g is not None]
    wrt = [(i, t) for i, t in enumerate(alias) if t is not None and ctx.needs_input_grad[i]]
    res = torch.autograd.grad([o for o, _ in pairs], [t for _, t in wrt],
                              [g for _, g in pairs], create_graph=True, allow_unused=True)
    out: list[Any] = [None] * 14
    for (i, _), r in zip(wrt, res):
        out[i] = r
    return tuple(out)
