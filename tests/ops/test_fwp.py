"""linear_attn and delta_rule: every form against the naive oracle (docs/maths.md 1.3, 1.4, 1.7)."""

from __future__ import annotations

import pytest
import torch

from fastweights.ops import delta_rule, elu_plus_one, linear_attn, sum_norm
from tests.helpers import assert_close64

SHAPES = [(2, 37, 3, 5, 7), (1, 1, 1, 4, 4), (3, 16, 2, 8, 3), (1, 65, 2, 6, 6)]
CHUNKS = [1, 8, 16, 64]
IDS = [f"B{b}-T{t}-H{h}-Dk{dk}-Dv{dv}" for b, t, h, dk, dv in SHAPES]


def make(B, T, H, Dk, Dv, seed=0, dtype=torch.float64, positive=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(B, T, H, Dk, generator=g, dtype=dtype)
    k = torch.rand(B, T, H, Dk, generator=g, dtype=dtype)
    if not positive:
        q, k = q - 0.5, k - 0.5
    v = torch.randn(B, T, H, Dv, generator=g, dtype=dtype)
    beta = torch.rand(B, T, H, generator=g, dtype=dtype)
    return q, k, v, beta


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
@pytest.mark.parametrize("normalize", [False, True], ids=["unnorm", "norm"])
@pytest.mark.parametrize("chunk", CHUNKS, ids=lambda c: f"C{c}")
def test_linear_attn_forms_agree(shape, normalize, chunk):
    q, k, v, _ = make(*shape)
    g = torch.Generator().manual_seed(1)
    B, _T, H, Dk, Dv = shape
    S0 = torch.randn(B, H, Dk, Dv, generator=g, dtype=torch.float64)
    z0 = torch.rand(B, H, Dk, generator=g, dtype=torch.float64)
    ref, (Sr, zr) = linear_attn(q, k, v, normalize=normalize, scale=0.7, initial_state=(S0, z0),
                                output_final_state=True, mode="naive")
    for mode in ("recurrent", "chunk"):
        o, (S, z) = linear_attn(q, k, v, normalize=normalize, scale=0.7, initial_state=(S0, z0),
                                output_final_state=True, mode=mode, chunk_size=chunk)
        assert_close64(o, ref, what=f"{mode} o")
        assert_close64(S, Sr, what=f"{mode} S")
        assert_close64(z, zr, what=f"{mode} z")


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
@pytest.mark.parametrize("chunk", CHUNKS, ids=lambda c: f"C{c}")
def test_delta_rule_forms_agree(shape, chunk):
    q, k, v, beta = make(*shape)
    k = sum_norm(k)
    B, _T, H, Dk, Dv = shape
    S0 = torch.randn(B, H, Dk, Dv, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    ref, Sr = delta_rule(q, k, v, beta, scale=1.3, initial_state=S0, output_final_state=True, mode="naive")
    for mode in ("recurrent", "chunk"):
        o, S = delta_rule(q, k, v, beta, scale=1.3, initial_state=S0, output_final_state=True,
                          mode=mode, chunk_size=chunk)
        assert_close64(o, ref, what=f"{mode} o")
        assert_close64(S, Sr, what=f"{mode} S")


def test_linear_attn_unnormalised_identity_is_masked_quadratic():
    q, k, v, _ = make(2, 11, 2, 4, 3, positive=False)
    o, _ = linear_attn(q, k, v, mode="chunk", chunk_size=4)
    scores = torch.einsum("bthd,bshd->bhts", q, k).tril()
    assert_close64(o, torch.einsum("bhts,bshe->bthe", scores, v))


def test_linear_attn_normalised_is_kernel_attention():
    q, k, v, _ = make(1, 9, 2, 4, 3)
    o, _ = linear_attn(q, k, v, normalize=True, eps=0.0, chunk_size=4)
    w = torch.einsum("bthd,bshd->bhts", q, k).tril()
    w = w / w.sum(-1, keepdim=True)
    assert_close64(o, torch.einsum("bhts,bshe->bthe", w, v))


@pytest.mark.parametrize("op", ["linear", "delta"])
@pytest.mark.parametrize("splits", [(5,), (1, 2, 3), (20, 21)], ids=str)
def test_pieces_equal_whole(op, splits):
    q, k, v, beta = make(2, 29, 2, 5, 4, seed=3)
    k = sum_norm(k)

    def run(sl, state):
        if op == "linear":
            return linear_attn(q[:, sl], k[:, sl], v[:, sl], normalize=True, initial_state=state,
                               output_final_state=True, chunk_size=8)
        return delta_rule(q[:, sl], k[:, sl], v[:, sl], beta[:, sl], initial_state=state,
                          output_final_state=True, chunk_size=8)

    whole, sw = run(slice(None), None)
    outs, state, start = [], None, 0
    for stop in [*splits, 29]:
        o, state = run(slice(start, stop), state)
        outs.append(o)
        start = stop
    assert_close64(torch.cat(outs, 1), whole)
    for a, b in zip(state if isinstance(state, tuple) else (state,), sw if isinstance(sw, tuple) else (sw,)):
        assert_close64(a, b)


@pytest.mark.parametrize("op", ["linear", "delta"])
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_causality(op, mode):
    q, k, v, beta = make(1, 20, 2, 4, 4, seed=4)
    k = sum_norm(k)
    f = (lambda q, k, v, b: linear_attn(q, k, v, normalize=True, mode=mode, chunk_size=8)[0]) \
        if op == "linear" else (lambda q, k, v, b: delta_rule(q, k, v, b, mode=mode, chunk_size=8)[0])
    base = f(q, k, v, beta)
    q2, k2, v2, b2 = (x.clone() for x in (q, k, v, beta))
    for x in (q2, k2, v2):
        x[:, 12:] += 5.0
    k2[:, 12:] = sum_norm(k2[:, 12:])
    b2[:, 12:] = 0.9
    pert = f(q2, k2, v2, b2)
    assert_close64(pert[:, :12], base[:, :12])
    assert (pert[:, 12:] - base[:, 12:]).abs().max() > 1e-3


@pytest.mark.parametrize("mode,chunk", [("naive", 1), ("recurrent", 1), ("chunk", 4), ("chunk", 3)])
def test_gradcheck_linear_attn(mode, chunk):
    q, k, v, _ = make(1, 9, 2, 3, 4, seed=5)
    S0 = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    z0 = torch.rand(1, 2, 3, dtype=torch.float64)
    args = [x.requires_grad_() for x in (q, k, v, S0, z0)]

    def f(q, k, v, S0, z0):
        o, (S, z) = linear_attn(q, k, v, normalize=True, initial_state=(S0, z0),
                                output_final_state=True, mode=mode, chunk_size=chunk)
        return o, S, z

    assert torch.autograd.gradcheck(f, args)


@pytest.mark.parametrize("mode,chunk", [("naive", 1), ("recurrent", 1), ("chunk", 4), ("chunk", 3)])
def test_gradcheck_delta_rule_including_beta(mode, chunk):
    q, k, v, beta = make(1, 9, 2, 3, 4, seed=6)
    S0 = torch.randn(1, 2, 3, 4, dtype=torch.float64)
    args = [x.requires_grad_() for x in (q, sum_norm(k).detach(), v, beta, S0)]

    def f(q, k, v, beta, S0):
        return delta_rule(q, k, v, beta, initial_state=S0, output_final_state=True, mode=mode,
                          chunk_size=chunk)

    assert torch.autograd.gradcheck(f, args)


def test_chunk_gradients_match_naive():
    q, k, v, beta = make(2, 23, 2, 5, 6, seed=7)
    k = sum_norm(k)
    grads = {}
    for mode in ("naive", "chunk"):
        xs = [x.clone().requires_grad_() for x in (q, k, v, beta)]
        o, S = delta_rule(*xs, output_final_state=True, mode=mode, chunk_size=8)
        (o.square().sum() + S.sum()).backward()
        grads[mode] = [x.grad for x in xs]
    for a, b in zip(grads["naive"], grads["chunk"]):
        assert_close64(a, b)


@pytest.mark.parametrize("chunk", [1, 4, 5, 16])
@pytest.mark.parametrize("use", ["o", "S", "both"])
def test_chunk_backward_matches_naive_autograd(chunk, use):
    """The chunked form's hand-written backward against autograd through the naive loop: raw
    (unnormalised) keys, some beta exactly 0 or 1, B = 2, Dk != Dv, T not a multiple of C, a
    random initial state, and losses that use only o, only the final state, or both."""
    q, k, v, beta = make(2, 19, 3, 5, 4, seed=21)
    beta = beta.clone()
    beta[0, :3], beta[1, 5:8] = 0.0, 1.0
    S0 = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    wo = torch.randn(2, 19, 3, 4, dtype=torch.float64)
    wS = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    grads = {}
    for mode in ("naive", "chunk"):
        xs = [x.clone().requires_grad_() for x in (q, k, v, beta, S0)]
        o, S = delta_rule(*xs[:4], initial_state=xs[4], output_final_state=True, mode=mode,
                          chunk_size=chunk)
        loss = {"o": (o * wo).sum(), "S": (S * wS).sum(), "both": (o * wo).sum() + (S * wS).sum()}[use]
        got = torch.autograd.grad(loss, xs, allow_unused=True)
        grads[mode] = [torch.zeros_like(x) if g is None else g for x, g in zip(xs, got)]
    for name, a, b in zip(["q", "k", "v", "beta", "S0"], grads["chunk"], grads["naive"]):
        assert_close64(a, b, what=f"d{name}")


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("chunk", [1, 4, 7, 64])
@pytest.mark.parametrize("use", ["o", "S", "both"])
def test_linear_attn_chunk_backward_matches_naive_autograd(normalize, chunk, use):
    """The chunked sum rule's hand-written backward against autograd through the naive form."""
    q, k, v, _ = make(2, 19, 3, 5, 4, seed=23)
    q, k = elu_plus_one(q), elu_plus_one(k)
    S0 = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    z0 = torch.rand(2, 3, 5, dtype=torch.float64)
    wo, wS, wz = torch.randn(2, 19, 3, 4, dtype=torch.float64), torch.randn_like(S0), torch.randn_like(z0)
    grads = {}
    for mode in ("naive", "chunk"):
        xs = [x.clone().requires_grad_() for x in (q, k, v, S0, z0)]
        o, (S, z) = linear_attn(*xs[:3], normalize=normalize, initial_state=(xs[3], xs[4]),
                                output_final_state=True, mode=mode, chunk_size=chunk)
        on_state = (S * wS).sum() + (z * wz).sum()
        loss = {"o": (o * wo).sum(), "S": on_state, "both": (o * wo).sum() + on_state}[use]
        got = torch.autograd.grad(loss, xs, allow_unused=True)
        grads[mode] = [torch.zeros_like(x) if g is None else g for x, g in zip(xs, got)]
    for name, a, b in zip(["q", "k", "v", "S0", "z0"], grads["chunk"], grads["naive"]):
        assert_close64(a, b, what=f"d{name}")


def test_linear_attn_chunk_backward_is_twice_differentiable():
    q, k, v, _ = make(1, 7, 1, 3, 2, seed=24)
    S0, z0 = torch.randn(1, 1, 3, 2, dtype=torch.float64), torch.rand(1, 1, 3, dtype=torch.float64)
    args = [x.requires_grad_() for x in (q, elu_plus_one(k).detach(), v, S0, z0)]

    def f(q, k, v, S0, z0):
        o, (S, z) = linear_attn(q, k, v, normalize=True, initial_state=(S0, z0),
                                output_final_state=True, chunk_size=3)
        return o, S, z

    assert torch.autograd.gradgradcheck(f, args)


def test_chunk_backward_is_twice_differentiable():
    q, k, v, beta = make(1, 7, 1, 3, 2, seed=22)
    S0 = torch.randn(1, 1, 3, 2, dtype=torch.float64)
    args = [x.requires_grad_() for x in (q, sum_norm(k).detach(), v, beta, S0)]

    def f(q, k, v, beta, S0):
        return delta_rule(q, k, v, beta, initial_state=S0, output_final_state=True, chunk_size=3)

    assert torch.autograd.gradgradcheck(f, args)


def test_beta_zero_keeps_memory():
    q, k, v, beta = make(1, 15, 2, 4, 3, seed=8)
    S0 = torch.randn(1, 2, 4, 3, dtype=torch.float64)
    o, S = delta_rule(q, k, v, torch.zeros_like(beta), initial_state=S0, output_final_state=True)
    assert_close64(S, S0)
    assert_close64(o, torch.einsum("bthd,bhde->bthe", q, S0))


def test_orthogonal_keys_beta_one_equals_sum_rule():
    d = 6
    keys = torch.linalg.qr(torch.randn(d, d, dtype=torch.float64))[0][:5]  # orthonormal rows
    k = keys[None, :, None]  # [1, 5, 1, d]
    q = torch.randn(1, 5, 1, d, dtype=torch.float64)
    v = torch.randn(1, 5, 1, 3, dtype=torch.float64)
    od, Sd = delta_rule(q, k, v, torch.ones(1, 5, 1, dtype=torch.float64), output_final_state=True)
    os_, (Ss, _) = linear_attn(q, k, v, output_final_state=True)
    assert_close64(od, os_)
    assert_close64(Sd, Ss)


def test_overwrite_with_repeated_key():
    d = 4
    key = torch.zeros(d, dtype=torch.float64)
    key[1] = 1.0
    k = key.expand(1, 2, 1, d).clone()
    v = torch.tensor([[1.0, 2.0, 3.0], [-4.0, 5.0, 0.5]], dtype=torch.float64)[None, :, None]
    od, _ = delta_rule(k, k, v, torch.ones(1, 2, 1, dtype=torch.float64))
    os_, _ = linear_attn(k, k, v)
    assert_close64(od[0, 1, 0], v[0, 1, 0])  # latest value
    assert_close64(os_[0, 1, 0], v[0, 0, 0] + v[0, 1, 0])  # sum rule adds


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("op", ["linear", "delta"])
def test_low_precision_close_to_float64(dtype, tol, op):
    q, k, v, beta = make(2, 70, 2, 8, 8, seed=9)
    k = sum_norm(k)
    q = sum_norm(q)

    def run(*xs):
        if op == "linear":
            return linear_attn(*xs[:3], normalize=True, output_final_state=True, chunk_size=16)
        return delta_rule(*xs, output_final_state=True, chunk_size=16)

    ref, _sref = run(q, k, v, beta)
    low, slow = run(*(x.to(dtype) for x in (q, k, v, beta)))
    assert low.dtype == dtype
    S = slow[0] if isinstance(slow, tuple) else slow
    assert S.dtype == torch.float32
    scale = ref.abs().max().item()
    assert (low.double() - ref).abs().max().item() <= tol * max(scale, 1.0)


@pytest.mark.parametrize("n", [16, 32, 48, 64, 128, 7])
@pytest.mark.parametrize("overwrite", [False, True])
def test_unit_lower_inverse_equals_the_triangular_solve(n, overwrite):
    """The blocked (I + stril(A))^-1 (16 x 16 solves merged by products; other sizes: the plain
    solve) equals torch's unitriangular solve in float64; only the strictly lower triangle is
    read, and A is left alone unless ``overwrite``."""
    from fastweights.ops.delta_rule.chunk import unit_lower_inverse

    gen = torch.Generator().manual_seed(n)
    A = 0.3 * torch.randn(4, 3, n, n, generator=gen, dtype=torch.float64)
    eye = torch.eye(n, dtype=torch.float64).expand_as(A)
    ref = torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True)
    noisy = A + torch.triu(torch.randn(n, n, generator=gen, dtype=torch.float64))  # diag and up
    before = noisy.clone()
    X = unit_lower_inverse(noisy, overwrite=overwrite)
    torch.testing.assert_close(X, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(X @ (torch.tril(A, -1) + eye), eye, rtol=0, atol=1e-12)
    if not overwrite:
        assert torch.equal(noisy, before)
