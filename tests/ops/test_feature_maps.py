"""Feature maps (docs/maths.md 1.2): values, widths, FAVOR+ unbiasedness and overflow safety."""

from __future__ import annotations

import math

import pytest
import torch

from fastweights.ops import (
    dpfp,
    draw_favor_projection,
    elu_plus_one,
    favor_features,
    relu,
    sum_norm,
)
from tests.helpers import assert_close64


def test_elu_plus_one_and_relu_values():
    x = torch.tensor([-2.0, 0.0, 3.0], dtype=torch.float64)
    assert_close64(elu_plus_one(x), torch.tensor([math.exp(-2.0), 1.0, 4.0], dtype=torch.float64))
    assert_close64(relu(x), torch.tensor([0.0, 0.0, 3.0], dtype=torch.float64))


@pytest.mark.parametrize("nu", [1, 2, 3])
def test_dpfp_values_literal(nu):
    x = torch.randn(2, 3, 5, dtype=torch.float64)
    out = dpfp(x, nu)
    assert out.shape == (2, 3, 2 * 5 * nu)
    assert (out >= 0).all()
    r = torch.cat([x.clamp_min(0), (-x).clamp_min(0)], -1)  # [relu(x), relu(-x)]
    n = r.shape[-1]
    expect = torch.cat([
        torch.stack([r[..., i] * r[..., (i - j) % n] for i in range(n)], -1) for j in range(1, nu + 1)
    ], -1)
    assert_close64(out, expect)


def test_dpfp_sign_convention_by_hand():
    # x = [1, -2]: r = [relu(x), relu(-x)] = [1, 0, 0, 2]; roll by 1 -> [2, 1, 0, 0].
    out = dpfp(torch.tensor([1.0, -2.0], dtype=torch.float64), 1)
    assert out.tolist() == [2.0, 0.0, 0.0, 0.0]
    # roll by 2 -> [0, 2, 1, 0]
    out2 = dpfp(torch.tensor([1.0, -2.0], dtype=torch.float64), 2)
    assert out2[4:].tolist() == [0.0, 0.0, 0.0, 0.0]
    out3 = dpfp(torch.tensor([1.0, 2.0], dtype=torch.float64), 2)  # r = [1, 2, 0, 0]
    assert out3.tolist() == [0.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_sum_norm():
    x = torch.rand(3, 7, dtype=torch.float64)
    assert_close64(sum_norm(x, eps=0.0).sum(-1), torch.ones(3, dtype=torch.float64))
    assert torch.isfinite(sum_norm(torch.zeros(2, 4))).all()


@pytest.mark.parametrize("orthogonal", [True, False])
def test_favor_projection_shape_and_orthogonality(orthogonal):
    g = torch.Generator().manual_seed(0)
    w = draw_favor_projection(10, 4, orthogonal=orthogonal, generator=g, dtype=torch.float64)
    assert w.shape == (10, 4)
    if orthogonal:
        block = w[:4] / w[:4].norm(dim=-1, keepdim=True)
        assert_close64(block @ block.T, torch.eye(4, dtype=torch.float64), atol=1e-12)


def test_favor_unbiased_kernel_estimate():
    g = torch.Generator().manual_seed(0)
    d = 4
    q = torch.randn(d, generator=g, dtype=torch.float64) * 0.3
    k = torch.randn(d, generator=g, dtype=torch.float64) * 0.3
    est = []
    for _ in range(8):
        w = draw_favor_projection(2048, d, generator=g, dtype=torch.float64)
        est.append((favor_features(q, w) * favor_features(k, w)).sum())
    mean = torch.stack(est).mean().item()
    assert abs(mean - math.exp(q @ k)) / math.exp(q @ k) < 0.05


def test_favor_large_norm_does_not_overflow():
    w = draw_favor_projection(16, 8, generator=torch.Generator().manual_seed(1))
    x = torch.randn(5, 8) * 100.0
    out = favor_features(x, w)
    assert out.shape == (5, 32) and torch.isfinite(out).all() and (out >= 0).all()
    xb = x.to(torch.bfloat16)
    assert torch.isfinite(favor_features(xb, w).float()).all()


def test_favor_log_domain_matches_direct_formula():
    w = draw_favor_projection(6, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    x = torch.randn(4, 3, dtype=torch.float64)
    xo = x @ w.T
    direct = (2 * 6) ** -0.5 * torch.exp(-(x * x).sum(-1, keepdim=True) / 2) * torch.cat([xo.exp(), (-xo).exp()], -1)
    assert_close64(favor_features(x, w), direct, atol=1e-12)
