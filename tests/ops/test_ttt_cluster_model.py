"""The tile model of the TTT-MLP cluster forward (ops/ttt/cluster_model.py; docs/gpu_ttt_kernels.md,
"The tile model (`ops/ttt/cluster_model.py`)"): in float64 with float64 operands it is the
token loop (and the dual form) on odd sizes, every flag on and off, 1, 2 and 4 slices; in
float32 its slices change only the order of summation; with bfloat16 and float16 operands it
stays within the issue's bounds of the float64 loop; its roundings are where the kernel's are
(an independent float64 recomputation of one mini-batch with the same roundings agrees with it,
float32 operands do not); and its two cluster sums run in slice order, then the bias (a case
whose float32 result depends on that order).
"""

from __future__ import annotations

import pytest
import torch

from fastweights.ops.ttt.chunk import ttt_mlp_dual
from fastweights.ops.ttt.cluster_model import ttt_mlp_cluster, ttt_mlp_cluster_model
from fastweights.ops.ttt.common import LN_EPS, Carry, gelu, gelu_grad
from fastweights.ops.ttt.naive import mlp_f_res, ttt_naive

F64 = torch.float64
BF16_OUT, BF16_STATE = 1e-2, 2e-2  # the bounds, max |x - ref| / max |ref|


def make_case(B=1, T=11, H=2, D=16, b=5, ln=True, ln_bias=True, b1=True, b2=True, seed=0,
              scale=0.3):
    """float64 inputs (q, k, v, eta, tau, ln_weight, ln_bias) and start weights (W1, b1, W2,
    b2) [B, H, ...] of one TTT-MLP call, Dh = 4 D; ``scale`` None: weights ~ 1/sqrt(fan-in)
    (an initialisation's size), else ``scale`` randn."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, D, generator=g, dtype=F64) for _ in range(3))
    eta = (0.1 + torch.rand(B, T, H, generator=g, dtype=F64)) / D
    tau = (torch.rand(H, b, generator=g, dtype=F64) * 1.5 - 0.2).clamp_min(0)
    Dh = 4 * D
    shapes = [(D, Dh), (Dh,), (Dh, D), (D,)]
    sizes = [0.3] * 4 if scale is not None else [D ** -0.5, 0.1, Dh ** -0.5, 0.1]
    start = tuple(None if (i == 1 and not b1) or (i == 3 and not b2)
                  else s * torch.randn(B, H, *shape, generator=g, dtype=F64)
                  for i, (shape, s) in enumerate(zip(shapes, sizes)))
    lnw = 1.0 + 0.3 * torch.randn(H, D, generator=g, dtype=F64) if ln else None
    lnb = 0.3 * torch.randn(H, D, generator=g, dtype=F64) if ln and ln_bias else None
    return (q, k, v, eta, tau, lnw, lnb), start


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref|."""
    return ((x.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def max_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return (x.double() - ref.double()).abs().max().item()


def compare_carry(got: Carry, want: Carry, tol: float, what: str) -> None:
    """The start weights and (when open) the gradient sums of two carries, None where None."""
    assert got.pos == want.pos, (what, got.pos, want.pos)
    assert (got.grads is None) == (want.grads is None), what
    pairs = list(zip(got.start, want.start)) + list(zip(got.grads or (), want.grads or ()))
    for i, (x, y) in enumerate(pairs):
        assert (x is None) == (y is None), (what, i)
        if x is not None:
            assert max_err(x, y) <= tol, (what, i, max_err(x, y))


# (B, H, T, D, b, slice_units, flags): T % b != 0 except one; C = 4 D / slice_units in 1, 2, 4
F64_CASES = [
    (1, 2, 21, 16, 5, 16, {}),
    (2, 1, 37, 32, 16, 32, {"residual": False}),
    (1, 3, 12, 16, 4, 32, {"ln_bias": False, "b2": False}),
    (2, 2, 13, 16, 5, 64, {"ln": False, "b1": False}),
    (1, 2, 23, 32, 5, 64, {"ln": False, "b1": False, "b2": False, "residual": False}),
    (3, 1, 9, 16, 16, 16, {"b1": False}),
]


@pytest.mark.parametrize("B, H, T, D, b, U, flags", F64_CASES,
                         ids=[f"B{c[0]}H{c[1]}T{c[2]}D{c[3]}b{c[4]}U{c[5]}-" + "-".join(
                             f"no_{k}" for k in c[6]) for c in F64_CASES])
def test_float64_is_the_token_loop(B, H, T, D, b, U, flags):
    """float64 everything (operands too): the output, the weights after the last full
    mini-batch and the gradient sums of the partial last one are the token loop's (autograd's
    gradients, no shared code) and the dual form's, to 1e-10."""
    flags = dict(flags)
    residual = flags.pop("residual", True)
    # without the LayerNorm the inner loop diverges from weights of 0.3 randn
    scale = 0.3 if flags.get("ln", True) else None
    (q, k, v, eta, tau, lnw, lnb), start = make_case(B=B, T=T, H=H, D=D, b=b, seed=T,
                                                     scale=scale, **flags)
    carry = Carry(start, None, 0)
    o, got = ttt_mlp_cluster(q, k, v, eta, carry, lnw, lnb, residual, tau, F64, U)
    ro, want = ttt_naive(mlp_f_res, q, k, v, eta, carry, lnw, lnb, residual, tau)
    do, dual = ttt_mlp_dual(q, k, v, eta, carry, lnw, lnb, residual, tau)
    assert o.dtype == F64 and max_err(o, ro) <= 1e-10 and max_err(o, do) <= 1e-10
    assert got.pos == T % b
    compare_carry(got, want, 1e-10, "token loop")
    compare_carry(got, dual, 1e-10, "dual form")


def test_float32_slices_change_only_the_order_of_sums():
    """float32 weights and operands: 1 slice of 128 hidden units and 4 of 32 give the same
    output, weights and sums to float32 accuracy (only the order of the cluster sums and of
    the products' accumulation differs)."""
    (q, k, v, eta, tau, lnw, lnb), start = make_case(B=1, T=37, H=2, D=32, b=16, seed=3)
    args = [x.float() for x in (q, k, v, eta)]
    carry = Carry(tuple(x.flatten(0, 1).float() for x in start), None, 0)
    one, four = (ttt_mlp_cluster_model(*args, tau.float(), lnw.float(), lnb.float(), *carry.start,
                                       True, torch.float32, U) for U in (128, 32))
    assert one[0].dtype == torch.float32
    for x, y in zip(one, four):
        assert rel(x, y) <= 1e-5, rel(x, y)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("D, T", [(64, 80), (128, 40)], ids=["D64T80", "D128T40"])
def test_half_operands_within_bounds(dtype, D, T):
    """q, k, v in bfloat16 / float16 (operands in that dtype), float32 weights of an
    initialisation's size, b 16, slices of 128, every flag on: the output within 1e-2 and the
    weights, their change over the call and the partial mini-batch's sums within 2e-2 of
    max |ref| of the float64 token loop on the same rounded inputs (measured:
    docs/gpu_ttt_kernels.md, "The tile model (`ops/ttt/cluster_model.py`)")."""
    (q, k, v, eta, tau, lnw, lnb), start = make_case(B=1, T=T, H=2, D=D, b=16, seed=D + T,
                                                     scale=None)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    eta, tau, lnw, lnb = (x.float() for x in (eta, tau, lnw, lnb))
    start = tuple(x.float() for x in start)
    o, got = ttt_mlp_cluster(q, k, v, eta, Carry(start, None, 0), lnw, lnb, True, tau,
                             slice_units=128)
    ro, want = ttt_naive(mlp_f_res, *(x.double() for x in (q, k, v, eta)),
                         Carry(tuple(x.double() for x in start), None, 0), lnw.double(),
                         lnb.double(), True, tau.double())
    assert o.dtype == dtype and rel(o, ro) <= BF16_OUT, rel(o, ro)
    for x, y in zip(got.start + (got.grads or ()), want.start + (want.grads or ())):
        assert x.dtype == torch.float32 and rel(x, y) <= BF16_STATE, rel(x, y)
    for x, y, w in zip(got.start, want.start, start):  # the updates alone, too
        assert rel(x - w, y - w.double()) <= BF16_STATE, rel(x - w, y - w.double())


def _r(x: torch.Tensor) -> torch.Tensor:
    """x rounded to a bfloat16 operand, back in float64."""
    return x.bfloat16().double()


def one_minibatch(q, k, v, eta, tau, lnw, lnb, W1, b1, W2, b2):
    """An independent float64 recomputation of one mini-batch of one head, every product's
    operands rounded to bfloat16 (docs/gpu_ttt_kernels.md, "The tile model"), residual,
    LayerNorm and biases on, whole hidden rows (no slices): q, k, v [m, D], eta [m], tau [b].
    Returns (o [m, D], and W1, b1, W2, b2 after it if m == b, else its gradient sums)."""
    m, b = q.shape[0], tau.shape[0]
    E = torch.zeros(m, m, dtype=F64)
    for i in range(m):
        for j in range(i + 1):
            E[i, j] = tau[i] * eta[j]
    Z1 = _r(k) @ _r(W1) + b1
    X2, gp = gelu(Z1), gelu_grad(Z1)
    Z2 = _r(X2) @ _r(W2) + b2
    mu = Z2.mean(1, keepdim=True)
    s = torch.sqrt(((Z2 - mu) ** 2).mean(1, keepdim=True) + LN_EPS)
    xh = (Z2 - mu) / s
    g = lnw * (lnw * xh + lnb - (v - k))
    G2 = (g - g.mean(1, keepdim=True) - xh * (g * xh).mean(1, keepdim=True)) / s
    G1 = (_r(G2) @ _r(W2).T) * gp
    Zbar1 = _r(q) @ _r(W1) + b1 - _r(E * (_r(q) @ _r(k).T + 1)) @ _r(G1)
    Xbar2 = gelu(Zbar1)
    A2 = _r(Xbar2) @ _r(X2).T + 1
    Zbar2 = _r(Xbar2) @ _r(W2) + b2 - _r(E * A2) @ _r(G2)
    mu = Zbar2.mean(1, keepdim=True)
    s = torch.sqrt(((Zbar2 - mu) ** 2).mean(1, keepdim=True) + LN_EPS)
    o = q + lnw * (Zbar2 - mu) / s + lnb
    c = -tau[b - 1] if m == b else 1.0
    H1, H2 = G1 * (c * eta)[:, None], G2 * (c * eta)[:, None]
    sums = (_r(k).T @ _r(H1), H1.sum(0), _r(X2).T @ _r(H2), H2.sum(0))
    if m < b:
        return o, sums
    return o, tuple(w + d for w, d in zip((W1, b1, W2, b2), sums))


def median_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """median |x - ref| / max |ref| over the elements."""
    return ((x.double() - ref).abs().median() / ref.abs().max()).item()


@pytest.mark.parametrize("T", [16, 11], ids=["full", "partial"])
def test_bfloat16_roundings_are_the_models(T):
    """bfloat16 operands, one mini-batch (full: updated weights; partial: gradient sums), 4
    slices, both heads: with float64 accumulation the model is ``one_minibatch`` to 1e-10
    (the roundings at the same points). With float32 accumulation (the kernel's) the typical
    element (the median) is within 1e-5 of max |ref| and at least 30 times closer than the
    model with float32 operands (so the roundings are really there; measured about 1e-8
    against 2e-4). Not the largest element: a float32 value that lands on the other side of a
    bfloat16 rounding boundary than the float64 one moves its operand by a bfloat16 step,
    and what depends on it by up to 1e-3."""
    D, b = 32, 16
    (q, k, v, eta, tau, lnw, lnb), start = make_case(B=1, T=T, H=2, D=D, b=b, seed=20 + T,
                                                     scale=None)
    tau = tau.clamp_min(0.05)  # tau_b > 0: the weights move
    q, k, v = (_r(x) for x in (q, k, v))  # inputs as bfloat16 values
    flat = [x.flatten(0, 1) for x in start]
    args = (q, k, v, eta, tau, lnw, lnb)
    exact64 = ttt_mlp_cluster_model(*args, *flat, True, torch.bfloat16, 32)
    args32 = [x.float() for x in args]
    kernel = ttt_mlp_cluster_model(*args32, *(x.float() for x in flat), True, torch.bfloat16, 32)
    plain = ttt_mlp_cluster_model(*args32, *(x.float() for x in flat), True, torch.float32, 32)
    pick = slice(5, 9) if T % b else slice(1, 5)  # the sums, or the weights
    for h in range(2):
        ro, rest = one_minibatch(*(x[0, :, h] for x in (q, k, v, eta)), tau[h], lnw[h], lnb[h],
                                 *(x[h] for x in flat))
        want = (ro, *rest)

        def got(out: tuple[torch.Tensor, ...], h: int = h) -> list[torch.Tensor]:
            return [out[0][0, :, h]] + [x[h] for x in out[pick]]

        errs = [rel(x, y) for x, y in zip(got(exact64), want)]
        assert max(errs) <= 1e-10, (h, errs)
        near = [median_err(x, y) for x, y in zip(got(kernel), want)]
        far = [median_err(x, y) for x, y in zip(got(plain), want)]
        assert max(near) <= 1e-5, (h, near)
        assert all(30 * n < f for n, f in zip(near, far)), (h, near, far)


@pytest.mark.parametrize("operand", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cluster_sums_in_slice_order_then_bias(operand):
    """float32, one hidden unit per slice, 4 slices whose shares of Z2 and Zq2 are
    0, 1, 2^25, -2^25 (gelu(16) = 16 exactly), b2 = 2: in slice order, then the bias, both
    sums are 2; other orders round differently in float32 (bias first: 4; reversed, or in
    pairs: 3). One token of a mini-batch of 2 with tau_1 = 0: the output is Zq2 (no step
    reaches it) and the gradient sum s2 = eta G2 = Z2."""
    D = 4
    q = torch.zeros(1, 1, 1, D)
    q[..., 0] = 1.0
    W1 = torch.zeros(1, D, 4)
    W1[0, 0] = 16.0  # every hidden unit's Z1 = 16 for q = k = e_0
    W2 = torch.zeros(1, 4, D)
    W2[0, :, 0] = torch.tensor([0.0, 1 / 16, 2.0 ** 21, -(2.0 ** 21)])
    b2 = torch.zeros(1, D)
    b2[0, 0] = 2.0
    eta = torch.ones(1, 1, 1)
    tau = torch.tensor([[0.0, 1.0]])
    o, *rest = ttt_mlp_cluster_model(q, q, torch.zeros_like(q), eta, tau, None, None, W1, None,
                                     W2, b2, False, operand, 1)
    s2 = rest[-1]
    assert o[0, 0, 0, 0].item() == 2.0 and s2[0, 0].item() == 2.0, (o, s2)


def test_bad_input():
    """Bad arguments are named before any work."""
    (q, k, v, eta, tau, lnw, lnb), start = make_case(T=5, D=16, b=5)
    flat = [x.flatten(0, 1) for x in start]
    with pytest.raises(ValueError, match="slice_units"):
        ttt_mlp_cluster_model(q, k, v, eta, tau, lnw, lnb, *flat, True, F64, 24)
    with pytest.raises(ValueError, match="b <= 16"):
        ttt_mlp_cluster_model(q, k, v, eta, torch.ones(2, 17, dtype=F64), lnw, lnb, *flat, True,
                              F64, 16)
    with pytest.raises(ValueError, match="operand_dtype"):
        ttt_mlp_cluster_model(q, k, v, eta, tau, lnw, lnb, *flat, True, torch.int8, 16)
    with pytest.raises(ValueError, match="W2"):
        ttt_mlp_cluster_model(q, k, v, eta, tau, lnw, lnb, flat[0], flat[1], flat[2].float(),
                              flat[3], True, F64, 16)
    with pytest.raises(ValueError, match="boundary"):
        ttt_mlp_cluster(q, k, v, eta, Carry(tuple(start), tuple(start), 2), lnw, lnb, True, tau)
