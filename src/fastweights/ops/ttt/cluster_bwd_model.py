"""A PyTorch tile model of the TTT-MLP cluster backward's sequential pass (docs/gpu_ttt_kernels.md,
"The backward's tile model (`ops/ttt/cluster_bwd_model.py`)"): one launch of ops/ttt/triton.py's
``_mlp_bwd_b_kernel`` over a full segment (TAIL off), computed with the cluster kernel's
blocking, roundings and order of summation, so that the CUDA kernel can be compared with it
number for number and the model itself with the float64 token loop. Likewise
``mlp_bwd_a_cluster_model`` for the backward's read-out pass, one launch of
``_mlp_bwd_a_kernel`` (docs/gpu_ttt_kernels.md, "The read-out backward's tile model"), with
its own three cluster sums. ``bwd_a_model``, ``bwd_b_model`` and ``fwd_model`` (the forward
model of ops/ttt/cluster_model.py as the forward and the recompute) put the models in the
kernels' places in a whole ``ttt_mlp`` call.

The blocking: per (batch, head) one cluster; its hidden units in C slices of ``slice_units``
(one per CTA), each CTA holding its slice of the carried gradients D1_s [Dk, U], d1_s [U],
D2_s [U, Dv]. Every product is P(a, b) = R(a) @ R(b), R rounding to the operand dtype and back
to float32 (the tensor cores' operands, float32 accumulation); everything else (GELU and its
derivatives, the keys' LayerNorm gradient, step sizes, sums over tokens, the carried
gradients) is float32, unrounded. The two cluster sums of a mini-batch run in slice order
0..C-1, then the terms every CTA holds.

Orientation: tiles here are token rows ([BB, D]); the rows of ``_mlp_bwd_a_kernel`` (hs, vs,
at) are stored transposed ([feature, token]) and converted on reading (written, by the read-out
model); the sequential model uses ``at`` (dA2^T) and the scores tile A^T as stored.

Dimension legend: B batch, T time, H heads, Dk, Dv head dims, Dh hidden units (a multiple of
``slice_units``), b mini-batch size, BB its padded tile (the rows' last dim), BV, BHD the
rows' padded value and hidden dims, U = slice_units, seg mini-batches per segment.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .cluster_model import _gelu, _ln
from .common import _GELU_C

_GELU_A = 0.044715
OPERAND_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
F32 = torch.float32


def _gelu2(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gelu_tanh(x), gelu'(x), gelu''(x) as ops/ttt/triton.py's ``_gelu2`` writes them: with
    u' = c (1 + 3 a x^2), gelu'' = 4 s (1 - s) (u' + 3 a c x^2 + x u'^2 (1 - 2 s))."""
    y, g1 = _gelu(x)
    x2 = x * x
    s = torch.sigmoid(x * (x2 * _GELU_A + 1.0) * (2.0 * _GELU_C))
    up = (x2 * (3.0 * _GELU_A) + 1.0) * _GELU_C
    g2 = s * (1.0 - s) * 4.0 * (up + x2 * (3.0 * _GELU_A) * _GELU_C
                                + x * up * up * (1.0 - 2.0 * s))
    return y, g1, g2


def _ln_back(dy: torch.Tensor, xh: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """LayerNorm's backward without affine over the last dim (triton_tiles.py ``_ln_back``):
    r (dy - mean(dy) - x_hat mean(dy x_hat))."""
    return r * (dy - dy.mean(-1, keepdim=True) - xh * (dy * xh).mean(-1, keepdim=True))


def _ln_grad_back(dG: torch.Tensor, G: torch.Tensor, xh: torch.Tensor, r: torch.Tensor,
                  g: torch.Tensor, gam: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The vector-Jacobian product of the keys' loss gradient w.r.t. Z2 and g = gamma (LN(Z2)
    - tgt), per token row (triton_tiles.py ``_ln_grad_back``): (dZ2, dg)."""
    D = dG.shape[-1]
    dg = _ln_back(dG, xh, r)
    c = r * ((g * xh).sum(-1, keepdim=True) / D)
    m = (dG * xh).sum(-1, keepdim=True) / D * r
    dxh = gam * gam * dg - c * dG - g * m
    mdg = (dG * G).sum(-1, keepdim=True) / D
    return _ln_back(dxh, xh, r) - (r * mdg) * xh, dg


def _product(operand_dtype: torch.dtype):
    """P(x, y) = R(x) @ R(y): a tensor-core product, both operands rounded to
    ``operand_dtype`` and back to float32, float32 accumulation."""
    def P(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x.to(operand_dtype).to(F32) @ y.to(operand_dtype).to(F32)

    return P


def _tr(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-1, -2)


def _rows(x: torch.Tensor, n: int, b: int, BB: int) -> torch.Tensor:
    """Mini-batch n's tokens of x [B, T, H, *d] as [B*H, BB, *d] float32, padding (rows past
    b or T) zero."""
    B, T, H = x.shape[:3]
    m = max(0, min(b, T - n * b))
    out = x.new_zeros(B, BB, H, *x.shape[3:], dtype=F32)
    out[:, :m] = x[:, n * b:n * b + m].to(F32)
    return out.movedim(2, 1).reshape(B * H, BB, *x.shape[3:])


def _put(dst: torch.Tensor, x: torch.Tensor, n: int, b: int) -> None:
    """x [B*H, BB, *d] written to mini-batch n's tokens of dst [B, T, H, *d] (those < T)."""
    B, T, H = dst.shape[:3]
    m = max(0, min(b, T - n * b))
    dst[:, n * b:n * b + m] = x.reshape(B, H, -1, *x.shape[2:])[:, :, :m].movedim(1, 2)


def _check_shapes(want: dict) -> None:
    """Each name's tensor against its shape: ``want`` maps name -> (tensor, shape)."""
    for name, (x, shape) in want.items():
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{name} must have shape {list(shape)}, got {got}")


def _check_f32(**tensors: torch.Tensor) -> None:
    for name, x in tensors.items():
        if x.dtype != F32:
            raise ValueError(f"{name} must be float32 (the kernel's), got {x.dtype}")


def _check_common(operand_dtype, slice_units, Dh) -> None:
    if operand_dtype not in OPERAND_DTYPES:
        raise ValueError(f"operand_dtype must be one of {OPERAND_DTYPES}, got {operand_dtype!r}")
    if not isinstance(slice_units, int) or isinstance(slice_units, bool) or slice_units < 1:
        raise ValueError(f"slice_units must be a positive int, got {slice_units!r}")
    if Dh % slice_units:
        raise ValueError(f"the hidden units Dh = {Dh} must be a multiple of slice_units = "
                         f"{slice_units}")


def _launch_sizes(q, hs, vs, at, H: int) -> tuple[int, int, int, int, int]:
    """B, B*H, and the rows' tiles BB, BV, BHD from a launch's q and rows (their ranks
    checked)."""
    for name, x, rank in (("q", q, 4), ("hs", hs, 5), ("vs", vs, 5), ("at", at, 4)):
        if not isinstance(x, torch.Tensor) or x.dim() != rank:
            raise ValueError(f"{name} must be a tensor of {rank} dims (the kernel's layout), "
                             f"got {getattr(x, 'shape', type(x).__name__)}")
    B = q.shape[0]
    return B, B * H, at.shape[-1], vs.shape[-2], hs.shape[-2]


def _check_slots(w1, w2, Dk, Dh, Dv, BH, nb, w_bh, w_j) -> None:
    """w1, w2 hold whole [Dk, Dh], [Dh, Dv] slots up to the last one a launch of nb
    mini-batches reads."""
    if w1.numel() % (Dk * Dh) or w2.numel() % (Dh * Dv):
        raise ValueError(f"w1, w2 must hold whole [Dk, Dh] = [{Dk}, {Dh}], [Dh, Dv] = [{Dh}, "
                         f"{Dv}] slots, got {w1.numel()}, {w2.numel()} elements")
    last = (BH - 1) * w_bh + (nb - 1) * w_j  # the last slot read
    if min(w1.numel() // (Dk * Dh), w2.numel() // (Dh * Dv)) <= last:
        raise ValueError(f"w1, w2 must hold slot bh * w_bh + j * w_j up to {last} (w_bh "
                         f"{w_bh}, w_j {w_j}), got {w1.numel() // (Dk * Dh)}, "
                         f"{w2.numel() // (Dh * Dv)} slots")


def _head_params(tau: torch.Tensor, lnw: torch.Tensor | None, lnb: torch.Tensor | None,
                 B: int, BB: int, has_ln: bool, has_lnb: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Per (batch, head) row bh = b * H + h: tau_r [B*H, BB] (head h's tau_i, 0 past b) and
    the inner LayerNorm's gamma, beta [B*H, 1, Dv] float32 (beta zeros without a bias; both
    None without the LayerNorm)."""
    H, b = tau.shape
    tau_r = torch.zeros(H, BB, dtype=F32, device=tau.device)
    tau_r[:, :b] = tau.to(F32)
    gam = bet = None
    if has_ln:
        gam = lnw.to(F32).repeat(B, 1)[:, None, :]
        bet = lnb.to(F32).repeat(B, 1)[:, None, :] if has_lnb else torch.zeros_like(gam)
    return tau_r.repeat(B, 1), gam, bet


def _check(q, k, v, eta, tau, A, w1, w2, dw1, db1, dw2, db2, hs, vs, rr, at, acc, dtau, dk,
           dv, deta, T, H, Dk, Dv, Dh, b, N, n0, n1, seg, w_bh, w_j, operand_dtype,
           slice_units) -> None:
    """The launch's tensors against its sizes, before any work."""
    _check_common(operand_dtype, slice_units, Dh)
    if not (0 <= n0 < n1 <= N and n1 - n0 <= seg and n1 * b <= T):
        raise ValueError(f"n0, n1 must be a segment of full mini-batches (0 <= n0 < n1 <= N = "
                         f"{N}, n1 - n0 <= seg = {seg}, n1 * b <= T = {T}), got {n0}, {n1}")
    B, BH, BB, BV, BHD = _launch_sizes(q, hs, vs, at, H)
    want = {"q": (q, (B, T, H, Dk)), "k": (k, (B, T, H, Dk)), "v": (v, (B, T, H, Dv)),
            "eta": (eta, (B, T, H)), "tau": (tau, (H, b)), "A": (A, (BH, N, BB, BB)),
            "dw1": (dw1, (BH, Dk, Dh)), "db1": (db1, (BH, Dh)), "dw2": (dw2, (BH, Dh, Dv)),
            "db2": (db2, (BH, Dv)), "hs": (hs, (BH, seg, 4, BHD, BB)),
            "vs": (vs, (BH, seg, 5, BV, BB)), "rr": (rr, (BH, seg, BB)),
            "at": (at, (BH, seg, BB, BB)), "acc": (acc, (BH, 2, BV)), "dtau": (dtau, (BH, BB)),
            "dk": (dk, (B, T, H, Dk)), "dv": (dv, (B, T, H, Dv)), "deta": (deta, (B, T, H))}
    _check_shapes(want)
    _check_f32(w1=w1, w2=w2, dw1=dw1, db1=db1, dw2=dw2, db2=db2, acc=acc, dtau=dtau, dk=dk,
               dv=dv, deta=deta)
    if b > BB or Dv > BV or Dh > BHD:
        raise ValueError(f"the rows' tiles (BB {BB}, BV {BV}, BHD {BHD}) must hold b {b}, Dv "
                         f"{Dv}, Dh {Dh}")
    _check_slots(w1, w2, Dk, Dh, Dv, BH, n1 - n0, w_bh, w_j)


def mlp_bwd_b_cluster_model(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, tau: torch.Tensor,
    A: torch.Tensor, lnw: torch.Tensor | None, lnb: torch.Tensor | None, w1: torch.Tensor,
    w2: torch.Tensor, dw1: torch.Tensor, db1: torch.Tensor, dw2: torch.Tensor,
    db2: torch.Tensor, hs: torch.Tensor, vs: torch.Tensor, rr: torch.Tensor, at: torch.Tensor,
    acc: torch.Tensor, dtau: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
    deta: torch.Tensor, T: int, H: int, Dk: int, Dv: int, Dh: int, b: int, N: int, n0: int,
    n1: int, seg: int, w_bh: int, w_j: int, *, has_b1: bool, has_b2: bool, has_ln: bool,
    has_lnb: bool, residual: bool, operand_dtype: torch.dtype, slice_units: int = 128,
) -> None:
    """One launch of ``_mlp_bwd_b_kernel`` with TAIL off (mini-batches n1-1 down to n0 of a
    full segment) as the cluster kernel computes it: the same tensors (q, k, v [B, T, H, D*]
    in their dtype; eta [B, T, H], tau [H, b]; A [B*H, N, BB, BB] the scores of ``_qk_kernel``;
    lnw, lnb [H, Dv] or None; w1, w2 the slots of start weights [., Dk, Dh], [., Dh, Dv], slot
    bh * w_bh + j * w_j for mini-batch n0 + j; the rows hs [B*H, seg, 4, BHD, BB], vs
    [B*H, seg, 5, BV, BB], rr [B*H, seg, BB], at [B*H, seg, BB, BB]), updating in place as the
    kernel does: the carried gradients dw1 [B*H, Dk, Dh], db1 [B*H, Dh], dw2 [B*H, Dh, Dv], db2
    [B*H, Dv] (into those of the weights entering n0), acc [B*H, 2, BV] (dgamma, dbeta), dtau
    [B*H, BB] (tau_b's share at b - 1), dk and deta (added to), dv (written). Products with
    operands rounded to ``operand_dtype``, hidden units in slices of ``slice_units``."""
    _check(q, k, v, eta, tau, A, w1, w2, dw1, db1, dw2, db2, hs, vs, rr, at, acc, dtau, dk, dv,
           deta, T, H, Dk, Dv, Dh, b, N, n0, n1, seg, w_bh, w_j, operand_dtype, slice_units)
    B = q.shape[0]
    BH, BB = B * H, at.shape[-1]
    U = slice_units
    cuts = [slice(s * U, (s + 1) * U) for s in range(Dh // U)]  # slice s: CTA s's hidden units
    dev = q.device
    bh = torch.arange(BH, device=dev)

    P, tr = _product(operand_dtype), _tr

    def rows(x: torch.Tensor, n: int) -> torch.Tensor:
        return _rows(x, n, b, BB)

    def put(dst: torch.Tensor, x: torch.Tensor, n: int) -> None:
        _put(dst, x, n, b)

    tau_r, gam, bet = _head_params(tau, lnw, lnb, B, BB, has_ln, has_lnb)
    coef = -tau_r[:, b - 1, None, None]  # [BH, 1, 1]: -tau_b
    causal = torch.ones(BB, BB, dtype=torch.bool, device=dev).triu()  # row j <= column i
    w1 = w1.reshape(-1, Dk, Dh)
    w2 = w2.reshape(-1, Dh, Dv)
    for n in range(n1 - 1, n0 - 1, -1):
        j = n - n0
        W1, W2 = w1[bh * w_bh + j * w_j], w2[bh * w_bh + j * w_j]  # [BH, Dk, Dh], [BH, Dh, Dv]
        Z1, Aw, Zb1, dZb1 = tr(hs[:, j, :, :Dh]).unbind(1)  # [BH, BB, Dh] each
        G2, dZb2, dG2_out, xh, g = tr(vs[:, j, :, :Dv]).unbind(1)  # [BH, BB, Dv] each
        r = rr[:, j, :, None]  # [BH, BB, 1]
        AT = at[:, j]  # [BH, BB, BB] as stored: dA2^T
        K, Q, Vt = rows(k, n), rows(q, n), rows(v, n)
        eta_n = rows(eta, n)  # [BH, BB]
        Et = torch.where(causal, eta_n[:, :, None] * tau_r[:, None, :], 0.0)  # E^T
        M1T = Et * A[:, n]  # M1^T = (E * A1)^T, A1 = Q K^T [+ 1]: the scores tile is A1^T
        ce = coef * eta_n[:, :, None]  # [BH, BB, 1]
        # 1. per slice: G1_s, K D1_s + d1_s, dG1_s, dA_s
        sl = []
        for s in cuts:
            X2, g1p = _gelu(Z1[..., s])
            G1 = Aw[..., s] * g1p
            kD1 = P(K, dw1[:, :, s])
            if has_b1:
                kD1 = kD1 + db1[:, None, s]
            dG1 = ce * kD1 - P(M1T, dZb1[..., s])
            sl.append({"X2": X2, "g1p": g1p, "G1": G1, "se1": (G1 * kD1).sum(-1), "dG1": dG1,
                       "dA": dG1 * g1p})
        # 2. cluster sum 1, slices in order, then the terms every CTA holds
        dG2 = xD2 = se1 = None
        for s, p in zip(cuts, sl):
            parts = (P(p["dA"], W2[:, s]), P(p["X2"], dw2[:, s]), p["se1"])
            dG2, xD2, se1 = parts if dG2 is None else (dG2 + parts[0], xD2 + parts[1],
                                                       se1 + parts[2])
        dG2 = dG2 + dG2_out
        if has_b2:
            xD2 = xD2 + db2[:, None]
        dG2 = dG2 + ce * xD2
        se = se1 + (G2 * xD2).sum(-1)  # [BH, BB]
        # 3. deta, dtau, the keys' LayerNorm gradient backward, dv, acc, db2
        put(deta, (rows(deta, n) + coef[:, :, 0] * se), n)
        dtau[:, b - 1] -= (se * eta_n).sum(-1)
        dZ2, dtgt = dG2, -dG2
        if has_ln:
            dZ2, dg = _ln_grad_back(dG2, G2, xh, r, g, gam)
            dtgt = -gam * dg
            e = gam * xh + bet - Vt
            if residual:
                e = e + rows(k, n)
            acc[:, 0, :Dv] += (dg * (e + gam * xh)).sum(1)
            acc[:, 1, :Dv] -= dtgt.sum(1)
        put(dv, dtgt, n)
        if has_b2:
            db2 += (dZb2 + dZ2).sum(1)
        # 4. per slice: dX2_s and dZ1_s
        for s, p in zip(cuts, sl):
            Xb2 = _gelu(Zb1[..., s])[0]
            _, g1p, g1pp = _gelu2(Z1[..., s])
            dX2 = ce * P(G2, tr(dw2[:, s])) + P(AT, Xb2) + P(dZ2, tr(W2[:, s]))
            p["Xb2"] = Xb2
            p["dZ1"] = p["dG1"] * Aw[..., s] * g1pp + dX2 * g1p
        # 5. cluster sum 2, slices in order: dK's shares
        dk_part = None
        for s, p in zip(cuts, sl):
            part = P(ce * p["G1"], tr(dw1[:, :, s])) + P(p["dZ1"], tr(W1[:, :, s]))
            dk_part = part if dk_part is None else dk_part + part
        if residual:
            dk_part = dk_part - dtgt
        put(dk, rows(dk, n) + dk_part, n)
        # 6. per slice (D1, D2 read above): the gradient of the start weights
        for s, p in zip(cuts, sl):
            dw1[:, :, s] += P(tr(Q), dZb1[..., s]) + P(tr(K), p["dZ1"])
            if has_b1:
                db1[:, s] += (dZb1[..., s] + p["dZ1"]).sum(1)
            dw2[:, s] += (P(tr(p["Xb2"]), dZb2) + P(tr(p["X2"]), dZ2)
                          + P(tr(p["dA"]), G2))


def _check_a(q, k, v, eta, tau, A, w1, b1, w2, b2, do, hs, vs, rr, at, acc, dtau, dq, dk,
             deta, T, H, Dk, Dv, Dh, b, N, n0, n1, seg, w_bh, w_j, operand_dtype,
             slice_units) -> None:
    """A ``_mlp_bwd_a_kernel`` launch's tensors against its sizes, before any work."""
    _check_common(operand_dtype, slice_units, Dh)
    if not (0 <= n0 < n1 <= N and n1 - n0 <= seg and (n1 - 1) * b < T):
        raise ValueError(f"n0, n1 must be a segment of mini-batches (0 <= n0 < n1 <= N = {N}, "
                         f"n1 - n0 <= seg = {seg}, (n1 - 1) * b < T = {T}), got {n0}, {n1}")
    B, BH, BB, BV, BHD = _launch_sizes(q, hs, vs, at, H)
    _check_shapes({"q": (q, (B, T, H, Dk)), "k": (k, (B, T, H, Dk)), "v": (v, (B, T, H, Dv)),
                   "eta": (eta, (B, T, H)), "tau": (tau, (H, b)), "A": (A, (BH, N, BB, BB)),
                   "do": (do, (B, T, H, Dv)), "hs": (hs, (BH, seg, 4, BHD, BB)),
                   "vs": (vs, (BH, seg, 5, BV, BB)), "rr": (rr, (BH, seg, BB)),
                   "at": (at, (BH, seg, BB, BB)), "acc": (acc, (BH, N, 2, BV)),
                   "dtau": (dtau, (BH, N, BB)), "dq": (dq, (B, T, H, Dk)),
                   "dk": (dk, (B, T, H, Dk)), "deta": (deta, (B, T, H))})
    _check_f32(w1=w1, b1=b1, w2=w2, b2=b2, hs=hs, vs=vs, rr=rr, at=at, acc=acc, dtau=dtau,
               dq=dq, dk=dk, deta=deta)
    if b > BB or Dv > BV or Dh > BHD:
        raise ValueError(f"the rows' tiles (BB {BB}, BV {BV}, BHD {BHD}) must hold b {b}, Dv "
                         f"{Dv}, Dh {Dh}")
    _check_slots(w1, w2, Dk, Dh, Dv, BH, n1 - n0, w_bh, w_j)
    if b1.numel() < w1.numel() // Dk or b2.numel() < w2.numel() // Dh:
        raise ValueError(f"b1, b2 must hold a [Dh], [Dv] slot for each of w1's, w2's, got "
                         f"{b1.numel()}, {b2.numel()} elements")


def mlp_bwd_a_cluster_model(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, tau: torch.Tensor,
    A: torch.Tensor, lnw: torch.Tensor | None, lnb: torch.Tensor | None, w1: torch.Tensor,
    b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor, do: torch.Tensor, hs: torch.Tensor,
    vs: torch.Tensor, rr: torch.Tensor, at: torch.Tensor, acc: torch.Tensor,
    dtau: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, deta: torch.Tensor, T: int, H: int,
    Dk: int, Dv: int, Dh: int, b: int, N: int, n0: int, n1: int, seg: int, w_bh: int,
    w_j: int, *, has_b1: bool, has_b2: bool, has_ln: bool, has_lnb: bool, residual: bool,
    operand_dtype: torch.dtype, slice_units: int = 128,
) -> None:
    """One launch of ``_mlp_bwd_a_kernel`` (grid (n1 - n0, B*H): mini-batches n0..n1-1, each
    from its own slot) as the cluster kernel computes it (docs/gpu_ttt_kernels.md, "The read-out
    backward's tile model"). The kernel's tensors: q, k [B, T, H, Dk], v [B, T, H, Dv] in their
    dtype; eta [B, T, H], tau [H, b]; A [B*H, N, BB, BB] the scores of ``_qk_kernel``; lnw, lnb
    [H, Dv] or None; the slots w1 [., Dk, Dh], b1 [., Dh], w2 [., Dh, Dv], b2 [., Dv] (float32;
    slot bh * w_bh + j * w_j for mini-batch n0 + j, the biases read only with their flags); do
    [B, T, H, Dv]. Writes, as the kernel does (rows transposed, [feature, token]; padding rows
    computed from zero inputs like the others; past Dh, Dv zero): hs [B*H, seg, 4, BHD, BB]
    (Z1, A = G2 W2^T, Zbar1, dZbar1), vs [B*H, seg, 5, BV, BB] (G2, dZbar2, the read-out's
    share of dG2; x_hat and g of the keys' LayerNorm, with it), rr [B*H, seg, BB] (its 1/s,
    with it), at [B*H, seg, BB, BB] (dA2^T), acc [B*H, N, 2, BV] (mini-batch n's dgamma, dbeta,
    with the LayerNorm), dtau [B*H, N, BB], and for the tokens of the segment dq (final), dk
    and deta (the read-out's shares). A last, partial mini-batch (its tokens past T) is
    computed like a full one.

    Per hidden slice s of ``slice_units`` units (CTA s), every product P(a, b) = R(a) @ R(b)
    with R the rounding to ``operand_dtype`` (float32 accumulation), M1 = -(E * A1), M2 =
    -(E * A2), E_ij = tau_i eta_j (j <= i):
    Z1_s = P(K, W1_s) + b1_s; Z2 = sum_s P(gelu(Z1_s), W2_s) + b2 (cluster sum 1); G2;
    A_s = P(G2, W2_s^T); Zbar1_s = P(Q, W1_s) + b1_s + P(M1, A_s gelu'(Z1_s)); Zq2 = sum_s
    P(Xbar2_s, W2_s) + b2 and A2 = sum_s P(Xbar2_s, X2_s^T) [+ 1] (cluster sum 2); Zbar2 =
    Zq2 + P(M2, G2); dZbar2 from dO; dG2's share P(M2^T, dZbar2); dN2 = -P(dZbar2, G2^T);
    dXbar2_s = P(dA2, X2_s) + P(dZbar2, W2_s^T); dN1 = -sum_s P(dZbar1_s, G1_s^T) and dQ =
    sum_s P(dZbar1_s, W1_s^T) (cluster sum 3), then dQ + P(dA1, K) [+ dO]; dK's share
    P(dA1^T, Q). Rounded: K, Q, W1_s, W2_s, X2_s, G2, G1_s, E * A1, Xbar2_s, E * A2, dZbar2,
    dA2, dZbar1_s, dA1; everything else (biases, GELU, the LayerNorms and their backward, E,
    dE, the masks, the sums over tokens, what is stored) float32, unrounded."""
    _check_a(q, k, v, eta, tau, A, w1, b1, w2, b2, do, hs, vs, rr, at, acc, dtau, dq, dk, deta,
             T, H, Dk, Dv, Dh, b, N, n0, n1, seg, w_bh, w_j, operand_dtype, slice_units)
    B = q.shape[0]
    BH, BB = B * H, at.shape[-1]
    U = slice_units
    cuts = [slice(s * U, (s + 1) * U) for s in range(Dh // U)]  # slice s: CTA s's hidden units
    P, tr = _product(operand_dtype), _tr
    bh = torch.arange(BH, device=q.device)
    tau_r, gam, bet = _head_params(tau, lnw, lnb, B, BB, has_ln, has_lnb)
    causal = torch.ones(BB, BB, dtype=torch.bool, device=q.device).tril()  # j <= i
    w1, b1 = w1.reshape(-1, Dk, Dh), b1.reshape(-1, Dh)
    w2, b2 = w2.reshape(-1, Dh, Dv), b2.reshape(-1, Dv)

    def cat(xs: list[torch.Tensor]) -> torch.Tensor:
        """The slices' [B*H, BB, U] tiles as one [B*H, Dh, BB] row tile."""
        return tr(torch.cat(xs, dim=-1))

    for n in range(n0, n1):
        j = n - n0
        slot = bh * w_bh + j * w_j
        W1, W2 = w1[slot], w2[slot]  # [BH, Dk, Dh], [BH, Dh, Dv]
        c1 = b1[slot][:, None] if has_b1 else None  # [BH, 1, Dh]
        c2 = b2[slot][:, None] if has_b2 else None  # [BH, 1, Dv]
        K, Q, dO = _rows(k, n, b, BB), _rows(q, n, b, BB), _rows(do, n, b, BB)
        eta_n = _rows(eta, n, b, BB)  # [BH, BB]
        tgt = _rows(v, n, b, BB) - K if residual else _rows(v, n, b, BB)
        E = torch.where(causal, tau_r[:, :, None] * eta_n[:, None, :], 0.0)  # E_ij
        A1 = tr(A[:, n])  # Q K^T [+ 1]: the scores tile is A1^T
        # 1. per slice Z1_s, X2_s; cluster sum 1: Z2; the loss gradient G2 in every CTA
        Z1, X2, Z2 = [], [], None
        for s in cuts:
            z1 = P(K, W1[:, :, s])
            if has_b1:
                z1 = z1 + c1[..., s]
            x2 = _gelu(z1)[0]
            part = P(x2, W2[:, s])
            Z2 = part if Z2 is None else Z2 + part
            Z1.append(z1)
            X2.append(x2)
        if has_b2:
            Z2 = Z2 + c2
        if has_ln:
            xh, r = _ln(Z2)
            g = gam * (gam * xh + bet - tgt)
            G2 = _ln_back(g, xh, r)
        else:
            G2 = Z2 - tgt
        # 2. per slice A_s, G1_s, Zbar1_s, Xbar2_s; cluster sum 2: Zq2, A2
        M1 = -(E * A1)
        Aw, G1, Zb1, Xb2, Zq2, A2 = [], [], [], [], None, None
        for s, z1, x2 in zip(cuts, Z1, X2):
            a = P(G2, tr(W2[:, s]))
            g1 = a * _gelu(z1)[1]
            zb1 = P(Q, W1[:, :, s])
            if has_b1:
                zb1 = zb1 + c1[..., s]
            zb1 = zb1 + P(M1, g1)
            xb2 = _gelu(zb1)[0]
            part, a2 = P(xb2, W2[:, s]), P(xb2, tr(x2))
            Zq2, A2 = (part, a2) if Zq2 is None else (Zq2 + part, A2 + a2)
            Aw.append(a)
            G1.append(g1)
            Zb1.append(zb1)
            Xb2.append(xb2)
        if has_b2:
            Zq2, A2 = Zq2 + c2, A2 + 1.0
        # 3. in every CTA: Zbar2, the read-out's backward, dA2, dE
        M2 = -(E * A2)
        Zbar2 = Zq2 + P(M2, G2)
        dZb2 = dO
        if has_ln:
            xo, ro = _ln(Zbar2)
            acc[:, n] = 0.0
            acc[:, n, 0, :Dv] = (dO * xo).sum(1)
            acc[:, n, 1, :Dv] = dO.sum(1)
            dZb2 = _ln_back(gam * dO, xo, ro)
        dG2 = P(tr(M2), dZb2)  # the read-out's share of dG2
        dN2 = -P(dZb2, tr(G2))  # the gradient of E * A2
        dA2 = torch.where(causal, dN2 * E, 0.0)
        dE = torch.where(causal, dN2 * A2, 0.0)
        # 4. per slice dXbar2_s, dZbar1_s; cluster sum 3: dN1, dQ's shares
        dZb1, dN1, dQ = [], None, None
        for s, x2, g1, zb1 in zip(cuts, X2, G1, Zb1):
            dzb1 = (P(dA2, x2) + P(dZb2, tr(W2[:, s]))) * _gelu(zb1)[1]
            parts = (P(dzb1, tr(g1)), P(dzb1, tr(W1[:, :, s])))
            dN1, dQ = parts if dN1 is None else (dN1 + parts[0], dQ + parts[1])
            dZb1.append(dzb1)
        # 5. in every CTA: dA1, dE, dQ, dK's and deta's shares, dtau
        dN1 = -dN1  # the gradient of E * A1
        dA1 = torch.where(causal, dN1 * E, 0.0)
        dE = dE + torch.where(causal, dN1 * A1, 0.0)
        dQ = dQ + P(dA1, K)
        if residual:
            dQ = dQ + dO
        _put(dq, dQ, n, b)
        _put(dk, P(tr(dA1), Q), n, b)
        _put(deta, (dE * tau_r[:, :, None]).sum(1), n, b)  # sum_i dE_ij tau_i
        dtau[:, n] = (dE * eta_n[:, None, :]).sum(2)  # sum_j dE_ij eta_j
        # the rows, transposed into the kernel's layouts
        hs[:, j] = 0.0
        for i, x in enumerate((Z1, Aw, Zb1, dZb1)):
            hs[:, j, i, :Dh] = cat(x)
        vs[:, j, :3] = 0.0
        for i, x in enumerate((G2, dZb2, dG2)):
            vs[:, j, i, :Dv] = tr(x)
        if has_ln:
            vs[:, j, 3:] = 0.0
            vs[:, j, 3, :Dv], vs[:, j, 4, :Dv] = tr(xh), tr(g)
            rr[:, j] = r[..., 0]
        at[:, j] = tr(dA2)


# the positional arguments of a ``_mlp_bwd_b_kernel`` launch (ops/ttt/triton.py)
_LAUNCH_ARGS = ("q", "k", "v", "eta", "tau", "A", "lnw", "lnb", "w1", "w2", "ds1", "dsb1", "ds2",
                "dsb2", "dw1", "db1", "dw2", "db2", "hs", "vs", "rr", "at", "sc", "acc", "dtau",
                "dk", "dv", "deta", "T", "H", "Dk", "Dv", "Dh", "b", "N", "n0", "n1", "seg",
                "w_bh", "w_j")
_OUTPUTS = ("dw1", "db1", "dw2", "db2", "acc", "dtau", "dk", "dv", "deta")
# and of a ``_mlp_bwd_a_kernel`` launch (its grid gives n1 - n0)
_LAUNCH_ARGS_A = ("q", "k", "v", "eta", "tau", "A", "lnw", "lnb", "w1", "b1", "w2", "b2", "do",
                  "hs", "vs", "rr", "at", "acc", "dtau", "dq", "dk", "deta", "T", "H", "Dk", "Dv",
                  "Dh", "b", "N", "n0", "seg", "w_bh", "w_j")
_OUTPUTS_A = ("hs", "vs", "rr", "at", "acc", "dtau", "dq", "dk", "deta")


def _flags(a: dict, consts: dict) -> dict:
    """The model's keyword arguments from a launch's constexprs: the flags, and lnw, lnb into
    ``a`` (None where their flag is off: the launch passes a stand-in)."""
    a["lnw"] = a["lnw"] if consts["HAS_LN"] else None
    a["lnb"] = a["lnb"] if consts["HAS_LNB"] else None
    return {"has_b1": consts["HAS_B1"], "has_b2": consts["HAS_B2"], "has_ln": consts["HAS_LN"],
            "has_lnb": consts["HAS_LNB"], "residual": consts["RESIDUAL"]}


def _model_launch(a: dict, consts: dict, operand_dtype: torch.dtype, slice_units: int) -> None:
    """``mlp_bwd_b_cluster_model`` on a kernel launch's arguments ``a`` and constexprs."""
    a = dict(a)
    fl = _flags(a, consts)
    kw = {n: a[n] for n in _LAUNCH_ARGS if n not in ("ds1", "dsb1", "ds2", "dsb2", "sc")}
    mlp_bwd_b_cluster_model(**kw, **fl, operand_dtype=operand_dtype, slice_units=slice_units)


def _model_launch_a(a: dict, consts: dict, operand_dtype: torch.dtype,
                    slice_units: int) -> None:
    """``mlp_bwd_a_cluster_model`` on a kernel launch's arguments ``a`` (with n1) and
    constexprs."""
    a = dict(a)
    fl = _flags(a, consts)
    mlp_bwd_a_cluster_model(**{n: a[n] for n in (*_LAUNCH_ARGS_A, "n1")}, **fl,
                            operand_dtype=operand_dtype, slice_units=slice_units)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max(1, max |ref|)."""
    return ((x - ref).abs().max() / ref.abs().max().clamp_min(1.0)).item()


def _rel_max(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref| (0 where both are zero)."""
    err = (x - ref).abs().max().item()
    return err / ref.abs().max().item() if err else 0.0


def _diffs_b(a: dict, theirs: dict, consts: dict) -> dict:
    tok = slice(a["n0"] * a["b"], a["n1"] * a["b"])  # dk, dv, deta: the segment's
    return {n: _rel(a[n][:, tok], theirs[n][:, tok]) if n in ("dk", "dv", "deta")
            else _rel(a[n], theirs[n]) for n in _OUTPUTS}


def _diffs_a(a: dict, theirs: dict, consts: dict) -> dict:
    """Each piece the launch wrote: max |model - kernel| / max |kernel|."""
    nb, n0, b, Dh, Dv = a["n1"] - a["n0"], a["n0"], a["b"], a["Dh"], a["Dv"]
    tok = slice(n0 * b, min(a["n1"] * b, a["T"]))
    pieces = {f"hs.{name}": (lambda x, i=i: x["hs"][:, :nb, i, :Dh])
              for i, name in enumerate(("Z1", "A", "Zbar1", "dZbar1"))}
    value_rows = ("G2", "dZbar2", "dG2", "x_hat", "g") if consts["HAS_LN"] else ("G2", "dZbar2",
                                                                                  "dG2")
    pieces.update({f"vs.{name}": (lambda x, i=i: x["vs"][:, :nb, i, :Dv])
                   for i, name in enumerate(value_rows)})
    pieces["at"] = lambda x: x["at"][:, :nb]
    pieces["dtau"] = lambda x: x["dtau"][:, n0:n0 + nb]
    if consts["HAS_LN"]:
        pieces["rr"] = lambda x: x["rr"][:, :nb]
        pieces["acc"] = lambda x: x["acc"][:, n0:n0 + nb]
    for name in ("dq", "dk", "deta"):
        pieces[name] = lambda x, name=name: x[name][:, tok]
    return {name: _rel_max(get(a), get(theirs)) for name, get in pieces.items()}


class _ModelKernel:
    """Stands in for a kernel (``kernel[grid](*args, **constexprs)``): the launches ``take``
    accepts go to ``model`` (``compare``: the kernel too, on copies of the outputs, and
    ``diffs`` of the two go into ``compare``), the others to the kernel. ``names``: the
    launch's positional arguments; ``outputs``: those it writes."""

    def __init__(self, kernel, names, outputs, take, model, diffs, operand_dtype, slice_units,
                 compare, calls):
        self.kernel, self.names, self.outputs, self.take = kernel, names, outputs, take
        self.model, self.diffs = model, diffs
        self.operand_dtype, self.slice_units = operand_dtype, slice_units
        self.compare, self.calls = compare, calls

    def __getitem__(self, grid):
        def launch(*args, **consts):
            if not self.take(consts):
                return self.kernel[grid](*args, **consts)
            a = dict(zip(self.names, args))
            a.setdefault("n1", a["n0"] + grid[0])  # a grid over the segment's mini-batches
            self.calls.append((a["n0"], a["n1"]))
            if self.compare is not None:
                theirs = {n: a[n].clone() for n in self.outputs}
                self.kernel[grid](*(theirs.get(n, x) for n, x in zip(self.names, args)),
                                  **consts)
            self.model(a, consts, self.operand_dtype, self.slice_units)
            if self.compare is not None:
                self.compare.append(self.diffs(a, theirs, consts))

        return launch


@contextlib.contextmanager
def _swapped(name: str, stand_in) -> Iterator[None]:
    """ops/ttt/triton.py's kernel ``name`` replaced by ``stand_in`` within the block."""
    from . import triton as module

    kernel = getattr(module, name)
    setattr(module, name, stand_in(kernel))
    try:
        yield
    finally:
        setattr(module, name, kernel)


@contextlib.contextmanager
def bwd_b_model(operand_dtype: torch.dtype = F32, slice_units: int = 128,
                compare: list | None = None) -> Iterator[list]:
    """Within the block, every launch of ops/ttt/triton.py's ``_mlp_bwd_b_kernel`` on a full
    segment (TAIL off) runs ``mlp_bwd_b_cluster_model`` instead (a partial last mini-batch
    stays on the kernel), so that a whole ``ttt_mlp`` backward runs with the model. With
    ``compare`` (a list), the kernel also runs each of those launches on copies of its
    outputs, and max |model - kernel| / max(1, max |kernel|) of each output (the carried
    gradients, acc, dtau; the segment's tokens of dk, dv, deta) goes into ``compare`` as a
    dict per launch. Yields the list of the (n0, n1) segments the model ran."""
    calls: list = []
    with _swapped("_mlp_bwd_b_kernel", lambda kernel: _ModelKernel(
            kernel, _LAUNCH_ARGS, _OUTPUTS, lambda consts: not consts["TAIL"], _model_launch,
            _diffs_b, operand_dtype, slice_units, compare, calls)):
        yield calls


@contextlib.contextmanager
def bwd_a_model(operand_dtype: torch.dtype = F32, slice_units: int = 128,
                compare: list | None = None) -> Iterator[list]:
    """Within the block, every launch of ops/ttt/triton.py's ``_mlp_bwd_a_kernel`` (a partial
    last mini-batch's too) runs ``mlp_bwd_a_cluster_model`` instead. With ``compare`` (a
    list), the kernel also runs each launch on copies of its outputs, and max |model - kernel|
    / max |kernel| of each piece the launch wrote (hs's and vs's rows by name, rr, at, acc,
    dtau of its mini-batches, the segment's tokens of dq, dk, deta) goes into ``compare`` as a
    dict per launch. Yields the list of the (n0, n1) segments the model ran."""
    calls: list = []
    with _swapped("_mlp_bwd_a_kernel", lambda kernel: _ModelKernel(
            kernel, _LAUNCH_ARGS_A, _OUTPUTS_A, lambda consts: True, _model_launch_a,
            _diffs_a, operand_dtype, slice_units, compare, calls)):
        yield calls


class _ForwardModel:
    """Stands in for ``_mlp_fwd_kernel`` or ``_mlp_recompute_kernel``
    (``kernel[grid](*args, **constexprs)``): ops/ttt/cluster_model.py's
    ``ttt_mlp_cluster_model`` one mini-batch at a time, writing what the kernel writes (the
    forward: o, the final weights in place, the partial mini-batch's gradient sums and the
    checkpoints; the recompute: the weights entering each mini-batch of the segment into its
    slots)."""

    def __init__(self, recompute: bool, operand_dtype: torch.dtype, slice_units: int,
                 calls: list):
        self.recompute, self.operand_dtype, self.slice_units = recompute, operand_dtype, slice_units
        self.calls = calls

    def step(self, a: dict, consts: dict, n: int, w: tuple) -> tuple[torch.Tensor, ...]:
        """``ttt_mlp_cluster_model`` on mini-batch n from the weights w (W1, b1, W2, b2)."""
        from .cluster_model import ttt_mlp_cluster_model

        fl = _flags(a, consts)
        t = slice(n * a["b"], min(n * a["b"] + a["b"], a["T"]))
        return ttt_mlp_cluster_model(
            a["q"][:, t], a["k"][:, t], a["v"][:, t], a["eta"][:, t], a["tau"], a["lnw"],
            a["lnb"], w[0], w[1] if fl["has_b1"] else None, w[2], w[3] if fl["has_b2"] else None,
            fl["residual"], self.operand_dtype, self.slice_units)

    def __getitem__(self, grid):
        def launch(*args, **consts):
            names = ("q", "k", "v", "eta", "tau", "A", "lnw", "lnb", "w1", "b1", "w2", "b2", "o")
            a = dict(zip(names, args))
            if self.recompute:  # slots [B*H, seg + 1, ...]; mini-batches n0..n1-2 into 1..
                a.update(zip(("T", "H", "Dk", "Dv", "Dh", "b", "N", "n0", "n1", "seg"),
                             args[-10:]))
                n0, n1 = a["n0"], a["n1"]
                self.calls.append(("recompute", n0, n1))
                slots = [a[x] for x in ("w1", "b1", "w2", "b2")]
                for j in range(n1 - n0 - 1):
                    out = self.step(a, consts, n0 + j, [x[:, j] for x in slots])
                    for x, y in zip(slots, out[1:5]):
                        x[:, j + 1] = y
                return
            a.update(zip(("s1", "sb1", "s2", "sb2", "gs", "ck1", "ckb1", "ck2", "ckb2", "T",
                          "H", "Dk", "Dv", "Dh", "b", "N", "NF", "seg", "store"), args[13:]))
            self.calls.append(("forward", 0, a["N"]))
            w = [a[x] for x in ("w1", "b1", "w2", "b2")]
            for n in range(a["N"]):
                if a["store"] and n % a["seg"] == 0 and n < a["NF"]:
                    for ck, x in zip(("ck1", "ckb1", "ck2", "ckb2"), w):
                        a[ck][:, n // a["seg"]] = x
                out = self.step(a, consts, n, w)
                t = slice(n * a["b"], n * a["b"] + out[0].shape[1])
                a["o"][:, t] = out[0].to(a["o"].dtype)
                for x, y in zip(w if n < a["NF"] else [a[s] for s in ("s1", "sb1", "s2", "sb2")],
                                out[1:5] if n < a["NF"] else out[5:]):
                    x.copy_(y)

        return launch


@contextlib.contextmanager
def fwd_model(operand_dtype: torch.dtype = F32, slice_units: int = 128) -> Iterator[list]:
    """Within the block, ops/ttt/triton.py's ``_mlp_fwd_kernel`` and ``_mlp_recompute_kernel``
    run ops/ttt/cluster_model.py's ``ttt_mlp_cluster_model`` instead (what the cluster kernel
    computes for both), so that with ``bwd_a_model`` and ``bwd_b_model`` a whole ``ttt_mlp``
    forward and backward runs in the tile models. Yields the list of the launches it ran
    (("forward", 0, N) or ("recompute", n0, n1))."""
    calls: list = []
    with _swapped("_mlp_fwd_kernel", lambda kernel: _ForwardModel(
            False, operand_dtype, slice_units, calls)), \
            _swapped("_mlp_recompute_kernel", lambda kernel: _ForwardModel(
                True, operand_dtype, slice_units, calls)):
        yield calls
