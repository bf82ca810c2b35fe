"""The fused kernels (ops/fused/triton.py) compiled and run on a CUDA GPU against their PyTorch
forms: float32 through the kernels directly (the dispatcher keeps float32 in PyTorch; the two
differ by float32 summation order only), bfloat16 through the public ops and the gated-delta
layer (within the bfloat16 rounding of the outputs). Skipped without a GPU, and under the
Triton interpreter, which tests/conftest.py switches on: run with ``TRITON_INTERPRET=0 python
-m pytest tests/ops/test_fused_cuda.py``.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU and TRITON_INTERPRET=0")

from fastweights.layers import GatedDeltaNet  # noqa: E402
from fastweights.ops import rms_norm_gated, short_conv_silu  # noqa: E402
from fastweights.ops.fused import forms  # noqa: E402

CUDA = "cuda"


def _randn(*shape, seed, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(CUDA, dtype)


def _grads(y, inputs, dy):
    return torch.autograd.grad(y, inputs, dy)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("head_dim", [5, 64, 128, 256])
def test_conv_kernels_float32(head_dim):
    from fastweights.ops.fused import triton as kernels

    B, T, W = 2, 1000, 4
    C = 2 * 2 * head_dim + 37
    wide = _randn(B, T, C + 9, seed=1)
    x = wide[..., 9:].requires_grad_()
    weight = _randn(C, 1, W, seed=2, scale=0.5).requires_grad_()
    bias = _randn(C, seed=3, scale=0.2).requires_grad_()
    past = _randn(B, C, W - 1, seed=4).requires_grad_()
    n = 2 * head_dim
    y = kernels.short_conv_silu_triton(x, weight, bias, past, n, head_dim, 1e-6)
    ref = forms.short_conv_silu_torch(x, weight, bias, past, n, head_dim, 1e-6)
    assert _rel(y, ref) < 1e-5
    dy = _randn(B, T, C, seed=5)
    for g, r in zip(_grads(y, (x, weight, bias, past), dy),
                    _grads(ref, (x, weight, bias, past), dy)):
        assert _rel(g, r) < 1e-5


@pytest.mark.parametrize("activation", ["swish", "sigmoid", None])
def test_norm_kernels_float32(activation):
    from fastweights.ops.fused import triton as kernels

    B, T, H, D = 2, 333, 3, 256
    x = _randn(B, T, H, D, seed=1).requires_grad_()
    wide = _randn(B, T, H * D + 8, seed=2).requires_grad_()
    gate = None if activation is None else wide[..., 8:].unflatten(-1, (H, D))
    weight = _randn(D, seed=3).requires_grad_()
    y = kernels.rms_norm_gated_triton(x, weight, gate, 1e-5, activation or "silu",
                                      torch.float32)
    ref = forms.rms_norm_gated_torch(x, weight, gate, 1e-5, activation == "sigmoid",
                                     torch.float32)
    assert _rel(y, ref) < 1e-5
    inputs = (x, weight) + ((wide,) if gate is not None else ())
    dy = _randn(B, T, H, D, seed=4)
    for g, r in zip(_grads(y, inputs, dy), _grads(ref, inputs, dy)):
        assert _rel(g, r) < 1e-5


def test_public_ops_bfloat16():
    x = _randn(2, 777, 300, seed=1, dtype=torch.bfloat16).requires_grad_()
    weight = _randn(300, 1, 4, seed=2, scale=0.5).requires_grad_()
    past = _randn(2, 300, 3, seed=3, dtype=torch.bfloat16)
    y, s = short_conv_silu(x, weight, initial_state=past, norm_heads=2, head_dim=128,
                           output_final_state=True)
    ref, s_ref = short_conv_silu(x, weight, initial_state=past, norm_heads=2, head_dim=128,
                                 output_final_state=True, backend="torch")
    assert y.dtype == torch.bfloat16 and _rel(y, ref) < 1e-2 and torch.equal(s, s_ref)
    dy = _randn(*y.shape, seed=4, dtype=torch.bfloat16)
    for g, r in zip(_grads(y, (x, weight), dy), _grads(ref, (x, weight), dy)):
        assert _rel(g, r) < 1e-2
    o = _randn(2, 50, 4, 256, seed=5, dtype=torch.bfloat16)
    gate = _randn(2, 50, 4, 256, seed=6, dtype=torch.bfloat16)
    w = _randn(256, seed=7)
    assert _rel(rms_norm_gated(o, w, gate), rms_norm_gated(o, w, gate, backend="torch")) < 1e-2


def test_layer_bfloat16(monkeypatch):
    """The gated-delta layer in bfloat16 with its fused ops on the kernels against the same
    layer with them on PyTorch (the op itself on the automatic choice in both)."""
    import fastweights.ops.fused as fused

    torch.manual_seed(0)
    m = GatedDeltaNet(256, 2, num_v_heads=4).to(CUDA, torch.bfloat16)
    x = _randn(2, 300, 256, seed=1, dtype=torch.bfloat16)
    y, s = m(x)
    calls: list[str] = []
    monkeypatch.setattr(fused, "_choose", lambda op, *a, **k: calls.append(op) or "torch")
    y_ref, s_ref = m(x)
    assert calls and _rel(y, y_ref) < 2e-2
    assert _rel(s[1], s_ref[1]) < 2e-2 and torch.equal(s[0], s_ref[0])
