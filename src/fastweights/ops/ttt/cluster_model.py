"""A PyTorch tile model of the TTT-MLP cluster forward (docs/gpu_ttt_kernels.md, "The tile model
(`ops/ttt/cluster_model.py`)"): the dual form of docs/maths.md 2.2-2.4 computed with the
kernel's blocking, its roundings and its order of summation, so that the CUDA kernel (and an
emulator of its source) can be compared with it number for number, and the model itself with
the float64 token loop.

The blocking: each (batch, head) is one cluster; its hidden units are cut into C slices of
``slice_units`` (one per CTA), a mini-batch's rows padded to BB = 16. Every product is
P(a, b) = R(a) @ R(b) with R(x) = x rounded to the operand dtype and back to the compute dtype
(float32; float64 when the weights are float64): the tensor cores' operands, accumulated in
the compute dtype. Everything else (biases, GELU, the LayerNorm and its gradient, the step
sizes, the weights themselves) is in the compute dtype, unrounded. The two sums over the
slices (Z2 and the read-out's Zq2 with A2) run in slice order 0..C-1, then the bias.

Dimension legend: B batch, T time, H heads, D = Dk = Dv head dim, Dh hidden units (a multiple
of ``slice_units``), b mini-batch size (<= 16), BB = 16 padded rows, U = slice_units.
"""

from __future__ import annotations

import torch

from ..._checks import check_arg, check_positive_int, check_qkv, check_tensor
from .common import _GELU_C, LN_EPS, Carry

BB = 16  # rows of a mini-batch tile (b <= BB; padded rows are zero)
_GELU_A = 0.044715
OPERAND_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _gelu(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gelu_tanh(x) and its derivative as the kernels write them (ops/ttt/triton.py ``_gelu``):
    with s = sigmoid(2 u), u = c (x + a x^3): gelu = x s, gelu' = s + 2 x u' s (1 - s)."""
    x2 = x * x
    s = torch.sigmoid(x * (x2 * _GELU_A + 1.0) * (2.0 * _GELU_C))
    return x * s, s + x * (x2 * (3.0 * _GELU_A) + 1.0) * s * (1.0 - s) * (2.0 * _GELU_C)


def _ln(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LayerNorm statistics over the last dim of z [..., D]: (x_hat, r = 1/sqrt(var + eps)),
    the variance biased and taken around the mean (two passes)."""
    zc = z - z.mean(-1, keepdim=True)
    r = 1.0 / torch.sqrt((zc * zc).mean(-1, keepdim=True) + LN_EPS)
    return zc * r, r


def _loss_grad(z: torch.Tensor, tgt: torch.Tensor, gamma: torch.Tensor | None,
               beta: torch.Tensor | None) -> torch.Tensor:
    """dl/dZ of l = 1/2 ||[LN](Z) - tgt||^2 per row of z [BH, BB, D] (docs/maths.md 2.2);
    gamma, beta [BH, 1, D]: r (g - mean(g) - x_hat mean(g x_hat)), g = gamma (LN(Z) - tgt)."""
    if gamma is None:
        return z - tgt
    xh, r = _ln(z)
    y = gamma * xh if beta is None else gamma * xh + beta
    g = gamma * (y - tgt)
    return r * (g - g.mean(-1, keepdim=True) - xh * (g * xh).mean(-1, keepdim=True))


def _tile(x: torch.Tensor, t0: int, m: int) -> torch.Tensor:
    """Tokens t0..t0+m-1 of x [BH, T, *d] as a [BH, BB, *d] tile, padded rows zero."""
    out = x.new_zeros(x.shape[0], BB, *x.shape[2:])
    out[:, :m] = x[:, t0:t0 + m]
    return out


def _check(q, k, v, eta, tau, ln_weight, ln_bias, W1, b1, W2, b2, residual, operand_dtype,
           slice_units) -> None:
    """Every argument's shape, dtype and range, before any work."""
    B, T, H, D, Dv = check_qkv(q, k, v)
    if Dv != D:
        raise ValueError(f"v must have the head dim of q and k (Dk == Dv), got Dk {D}, Dv {Dv}")
    check_arg("eta", eta, (B, T, H), "[B, T, H]", q)
    check_arg("tau", tau, (H, None), "[H, b]", q)
    b = tau.shape[-1]
    if not 1 <= b <= BB:
        raise ValueError(f"tau [H, b] must have 1 <= b <= {BB} (the tile's rows), got b = {b}")
    if ln_bias is not None and ln_weight is None:
        raise ValueError("ln_bias needs ln_weight (a LayerNorm without gain is not modelled)")
    for name, x in (("ln_weight", ln_weight), ("ln_bias", ln_bias)):
        if x is not None:
            check_arg(name, x, (H, D), "[H, D]", q)
    check_tensor("W1", W1, 3, "[B*H, D, Dh]")
    Dh = W1.shape[-1]
    BH = B * H
    for name, x, shape, layout in (("W1", W1, (BH, D, Dh), "[B*H, D, Dh]"),
                                   ("b1", b1, (BH, Dh), "[B*H, Dh]"),
                                   ("W2", W2, (BH, Dh, D), "[B*H, Dh, D]"),
                                   ("b2", b2, (BH, D), "[B*H, D]")):
        if x is None and name.startswith("b"):
            continue
        check_arg(name, x, shape, layout, q)
        if x.dtype != W1.dtype or x.dtype not in (torch.float32, torch.float64):
            raise ValueError(f"{name} must be float32 or float64 like W1 ({W1.dtype}), "
                             f"got {x.dtype}")
    if not isinstance(residual, bool):
        raise TypeError(f"residual must be a bool, got {type(residual).__name__}")
    if operand_dtype not in OPERAND_DTYPES:
        raise ValueError(f"operand_dtype must be one of {OPERAND_DTYPES}, got {operand_dtype!r}")
    check_positive_int("slice_units", slice_units)
    if Dh % slice_units:
        raise ValueError(f"W1's hidden units Dh = {Dh} must be a multiple of slice_units "
                         f"= {slice_units}")


def ttt_mlp_cluster_model(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, tau: torch.Tensor,
    ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None, W1: torch.Tensor,
    b1: torch.Tensor | None, W2: torch.Tensor, b2: torch.Tensor | None, residual: bool,
    operand_dtype: torch.dtype, slice_units: int = 128,
) -> tuple[torch.Tensor, ...]:
    """TTT-MLP from a mini-batch boundary as the cluster kernel computes it, with
    ``_MLPTriton.forward``'s contract: q, k, v [B, T, H, D] (any floating dtype), eta
    [B, T, H], tau [H, b], ln_weight, ln_bias [H, D] or None, W1 [B*H, D, Dh], b1 [B*H, Dh] or
    None, W2 [B*H, Dh, D], b2 [B*H, D] or None (float32, or float64); products with operands
    rounded to ``operand_dtype``, hidden units in slices of ``slice_units``.

    Returns (o [B, T, H, D] in q's dtype, W1, b1, W2, b2 after the last full mini-batch,
    S1, s1, S2, s2 the gradient sums sum_j eta_j grad_j of a last partial mini-batch, zeros
    when T % b == 0), the weights and sums in the compute dtype, biases zeros where None."""
    _check(q, k, v, eta, tau, ln_weight, ln_bias, W1, b1, W2, b2, residual, operand_dtype,
           slice_units)
    B, T, H, D = q.shape
    b, BH, Dh = tau.shape[-1], B * H, W1.shape[-1]
    acc = W1.dtype  # the compute dtype: float32, or float64
    U = slice_units
    cuts = [slice(s * U, (s + 1) * U) for s in range(Dh // U)]  # slice s: hidden units of CTA s
    has_b1, has_b2 = b1 is not None, b2 is not None

    def R(x: torch.Tensor) -> torch.Tensor:
        """x rounded to an operand of the products."""
        return x.to(operand_dtype).to(acc)

    def P(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """A tensor-core product: rounded operands, accumulated in the compute dtype."""
        return R(x) @ R(y)

    def rows(x: torch.Tensor) -> torch.Tensor:
        """[B, T, H, *d] -> [B*H, T, *d] in the compute dtype."""
        return x.to(acc).movedim(2, 1).reshape(BH, T, *x.shape[3:])

    Qs, Ks, Vs, etas = rows(q), rows(k), rows(v), rows(eta)
    tau_r = torch.zeros(BH, BB, dtype=acc, device=q.device)
    tau_r[:, :b] = tau.to(acc).repeat(B, 1)  # tau_i, 0 past b
    causal = torch.ones(BB, BB, dtype=torch.bool, device=q.device).tril()  # j <= i
    gamma = None if ln_weight is None else ln_weight.to(acc).repeat(B, 1).unsqueeze(1)
    beta = None if ln_bias is None else ln_bias.to(acc).repeat(B, 1).unsqueeze(1)
    W1, W2 = W1.to(acc).clone(), W2.to(acc).clone()
    b1 = b1.to(acc).clone() if has_b1 else W1.new_zeros(BH, Dh)
    b2 = b2.to(acc).clone() if has_b2 else W1.new_zeros(BH, D)
    sums = [torch.zeros_like(x) for x in (W1, b1, W2, b2)]
    tau_b = tau_r[:, b - 1].reshape(BH, 1)
    outs = []
    for t0 in range(0, T, b):
        m = min(b, T - t0)
        K, Q, V, eta_n = (_tile(x, t0, m) for x in (Ks, Qs, Vs, etas))
        tgt = V - K if residual else V
        E = torch.where(causal, tau_r[:, :, None] * eta_n[:, None, :], 0.0)  # E_ij, j <= i
        coef = -tau_b if m == b else torch.ones_like(tau_b)
        # the keys' pass: per slice Z1_s, X2_s, gelu'(Z1_s) and its share of Z2
        X2, GP, Z2 = [], [], None
        for s in cuts:
            Z1 = P(K, W1[:, :, s])
            if has_b1:
                Z1 = Z1 + b1[:, None, s]
            x2, gp = _gelu(Z1)
            part = P(x2, W2[:, s])
            Z2 = part if Z2 is None else Z2 + part  # cluster sum 1, slices in order
            X2.append(x2)
            GP.append(gp)
        if has_b2:
            Z2 = Z2 + b2[:, None]
        G2 = _loss_grad(Z2, tgt, gamma, beta)  # in every CTA
        A1 = P(Q, K.transpose(-1, -2))
        if has_b1:
            A1 = A1 + 1.0
        M1 = -(E * A1)
        # the queries' pass: per slice G1_s, Zbar1_s, Xbar2_s and its shares of Zq2 and A2
        G1, Zq2, A2 = [], None, None
        for s, x2, gp in zip(cuts, X2, GP):
            g1 = P(G2, W2[:, s].transpose(-1, -2)) * gp
            zbar1 = P(Q, W1[:, :, s])
            if has_b1:
                zbar1 = zbar1 + b1[:, None, s]
            xbar2 = _gelu(zbar1 + P(M1, g1))[0]
            part, a2 = P(xbar2, W2[:, s]), P(xbar2, x2.transpose(-1, -2))
            # cluster sum 2, slices in order
            Zq2, A2 = (part, a2) if Zq2 is None else (Zq2 + part, A2 + a2)
            G1.append(g1)
        if has_b2:
            Zq2, A2 = Zq2 + b2[:, None], A2 + 1.0
        Zbar2 = Zq2 + P(-(E * A2), G2)
        o = Zbar2
        if gamma is not None:  # the output LayerNorm, in every CTA
            o = gamma * _ln(Zbar2)[0]
            o = o if beta is None else o + beta
        if residual:
            o = o + Q
        outs.append(o[:, :m])
        # the updates (a full mini-batch) or the gradient sums (the partial last one), from
        # the rows above: every product used the start weights
        e = (eta_n * coef)[:, :, None]
        H2 = G2 * e
        dst = (W1, b1, W2, b2) if m == b else sums
        for s, x2, g1 in zip(cuts, X2, G1):
            H1 = g1 * e
            dst[0][:, :, s] += P(K.transpose(-1, -2), H1)
            dst[2][:, s] += P(x2.transpose(-1, -2), H2)
            if has_b1:
                dst[1][:, s] += H1.sum(1)
        if has_b2:
            dst[3].add_(H2.sum(1))
    o = torch.cat(outs, dim=1) if outs else Qs.new_zeros(BH, 0, D)
    o = o.reshape(B, H, T, D).transpose(1, 2).to(q.dtype)
    return (o, W1, b1, W2, b2, *sums)


def ttt_mlp_cluster(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, carry: Carry,
    ln_weight: torch.Tensor | None, ln_bias: torch.Tensor | None, residual: bool,
    tau: torch.Tensor, operand_dtype: torch.dtype | None = None, slice_units: int = 128,
) -> tuple[torch.Tensor, Carry]:
    """``ttt_mlp_cluster_model`` with ``chunk.ttt_mlp_dual``'s arguments and results: a
    ``Carry`` at a mini-batch boundary (pos 0) of [B, H, ...] weights in, (o [B, T, H, D] in
    q's dtype, Carry) out, biases None where the carry has none. ``operand_dtype`` defaults
    to q's dtype (the kernel multiplies its inputs as they are)."""
    if not isinstance(carry, Carry) or not (isinstance(carry.pos, int) and carry.pos == 0):
        raise ValueError("carry must be a Carry at a mini-batch boundary (pos 0): the cluster "
                         "kernel starts at one")
    B, T, H = q.shape[:3]
    W1, b1, W2, b2 = carry.start
    for name, x in zip(("W1", "b1", "W2", "b2"), carry.start):
        if x is not None and tuple(x.shape[:2]) != (B, H):
            raise ValueError(f"carry.start's {name} must be [B, H, ...] = [{B}, {H}, ...], "
                             f"got {tuple(x.shape)}")

    def flat(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.flatten(0, 1)

    o, *out = ttt_mlp_cluster_model(
        q, k, v, eta, tau, ln_weight, ln_bias, flat(W1), flat(b1), flat(W2), flat(b2), residual,
        q.dtype if operand_dtype is None else operand_dtype, slice_units)
    keep = (True, b1 is not None, True, b2 is not None)

    def weights(xs: list[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
        return tuple(x.unflatten(0, (B, H)) if on else None for x, on in zip(xs, keep))

    tail = T % tau.shape[-1]
    return o, Carry(weights(out[:4]), weights(out[4:]) if tail else None, tail)
