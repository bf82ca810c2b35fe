"""A PyTorch tile model of the TTT-MLP cluster backward's sequential pass (docs/gpu_ttt_kernels.md,
"The backward's tile model (`ops/ttt/cluster_bwd_model.py`)"): one launch of ops/ttt/triton.py's
``_mlp_bwd_b_kernel`` over a full segment (TAIL off), computed with the cluster kernel's
blocking, roundings and order of summation, so that the CUDA kernel can be compared with it
number for number and the model itself with the float64 token loop.

The blocking: per (batch, head) one cluster; its hidden units in C slices of ``slice_units``
(one per CTA), each CTA holding its slice of the carried gradients D1_s [Dk, U], d1_s [U],
D2_s [U, Dv]. Every product is P(a, b) = R(a) @ R(b), R rounding to the operand dtype and back
to float32 (the tensor cores' operands, float32 accumulation); everything else (GELU and its
derivatives, the keys' LayerNorm gradient, step sizes, sums over tokens, the carried
gradients) is float32, unrounded. The two cluster sums of a mini-batch run in slice order
0..C-1, then the terms every CTA holds.

Orientation: tiles here are token rows ([BB, D]); the rows of ``_mlp_bwd_a_kernel`` (hs, vs,
at) are stored transposed ([feature, token]) and converted on reading; ``at`` (dA2^T) and the
scores tile A^T are used as stored.

Dimension legend: B batch, T time, H heads, Dk, Dv head dims, Dh hidden units (a multiple of
``slice_units``), b mini-batch size, BB its padded tile (the rows' last dim), BV, BHD the
rows' padded value and hidden dims, U = slice_units, seg mini-batches per segment.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .cluster_model import _gelu
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
    for name, x, rank in (("q", q, 4), ("hs", hs, 5), ("vs", vs, 5), ("at", at, 4)):
        if not isinstance(x, torch.Tensor) or x.dim() != rank:
            raise ValueError(f"{name} must be a tensor of {rank} dims (the kernel's layout), "
                             f"got {getattr(x, 'shape', type(x).__name__)}")
    B = q.shape[0]
    BH = B * H
    BB, BV, BHD = at.shape[-1], vs.shape[-2], hs.shape[-2]
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


# the positional arguments of a ``_mlp_bwd_b_kernel`` launch (ops/ttt/triton.py)
_LAUNCH_ARGS = ("q", "k", "v", "eta", "tau", "A", "lnw", "lnb", "w1", "w2", "ds1", "dsb1", "ds2",
                "dsb2", "dw1", "db1", "dw2", "db2", "hs", "vs", "rr", "at", "sc", "acc", "dtau",
                "dk", "dv", "deta", "T", "H", "Dk", "Dv", "Dh", "b", "N", "n0", "n1", "seg",
                "w_bh", "w_j")
_OUTPUTS = ("dw1", "db1", "dw2", "db2", "acc", "dtau", "dk", "dv", "deta")


def _model_launch(a: dict, consts: dict, operand_dtype: torch.dtype, slice_units: int) -> None:
    """``mlp_bwd_b_cluster_model`` on a kernel launch's arguments ``a`` and constexprs."""
    kw = {n: a[n] for n in _LAUNCH_ARGS if n not in ("ds1", "dsb1", "ds2", "dsb2", "sc")}
    kw["lnw"] = a["lnw"] if consts["HAS_LN"] else None
    kw["lnb"] = a["lnb"] if consts["HAS_LNB"] else None
    mlp_bwd_b_cluster_model(
        **kw, has_b1=consts["HAS_B1"], has_b2=consts["HAS_B2"], has_ln=consts["HAS_LN"],
        has_lnb=consts["HAS_LNB"], residual=consts["RESIDUAL"], operand_dtype=operand_dtype,
        slice_units=slice_units)


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max(1, max |ref|)."""
    return ((x - ref).abs().max() / ref.abs().max().clamp_min(1.0)).item()


class _ModelKernel:
    """Stands in for ``_mlp_bwd_b_kernel`` (``kernel[grid](*args, **constexprs)``): launches
    with TAIL go to the kernel, the others to the model (``compare``: the kernel too, on
    copies of the outputs; see ``bwd_b_model``)."""

    def __init__(self, kernel, operand_dtype: torch.dtype, slice_units: int,
                 compare: list | None, calls: list):
        self.kernel, self.operand_dtype, self.slice_units = kernel, operand_dtype, slice_units
        self.compare, self.calls = compare, calls

    def __getitem__(self, grid):
        def launch(*args, **consts):
            if consts["TAIL"]:
                return self.kernel[grid](*args, **consts)
            a = dict(zip(_LAUNCH_ARGS, args))
            self.calls.append((a["n0"], a["n1"]))
            if self.compare is not None:
                theirs = {n: a[n].clone() for n in _OUTPUTS}
                self.kernel[grid](*(theirs.get(n, x) for n, x in zip(_LAUNCH_ARGS, args)),
                                  **consts)
            _model_launch(a, consts, self.operand_dtype, self.slice_units)
            if self.compare is not None:
                tok = slice(a["n0"] * a["b"], a["n1"] * a["b"])  # dk, dv, deta: the segment's
                self.compare.append({n: _rel(a[n][:, tok], theirs[n][:, tok])
                                     if n in ("dk", "dv", "deta") else _rel(a[n], theirs[n])
                                     for n in _OUTPUTS})

        return launch


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
    from . import triton as module

    kernel = module._mlp_bwd_b_kernel
    calls: list = []
    module._mlp_bwd_b_kernel = _ModelKernel(kernel, operand_dtype, slice_units, compare, calls)
    try:
        yield calls
    finally:
        module._mlp_bwd_b_kernel = kernel
