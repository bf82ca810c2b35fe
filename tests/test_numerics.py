"""Numerics: bfloat16 autocast training steps, long streams with carried state, and
inputs of extreme magnitude stay finite; states and normalisers stay float32.

The million-token streams are marked ``slow`` (skipped by default; ``python -m pytest -m slow``).
"""

from __future__ import annotations

import pytest
import torch

from fastweights import build_mixer, mixer_names
from fastweights.ops import (
    aft,
    aft_conv,
    aft_local,
    dpfp,
    draw_favor_projection,
    favor_features,
    linear_attn,
    relu,
    sum_norm,
)
from tests.layers.test_contract import SMALL_OPTIONS

D_MODEL, N_HEADS = 16, 2

# State items that are caches of the layer's own (autocast bfloat16) projections of past tokens,
# not accumulated sums: softmax attention's KV cache. Everything else must be float32.
INPUT_CACHES = {"softmax"}


def floating_tensors(state) -> list[torch.Tensor]:
    """Every floating-point tensor inside a (nested) layer state."""
    if isinstance(state, torch.Tensor):
        return [state] if state.is_floating_point() else []
    if isinstance(state, (tuple, list)):
        return [t for s in state for t in floating_tensors(s)]
    return []


@pytest.mark.parametrize("name", mixer_names())
def test_bf16_autocast_training_steps(name):
    """Two SGD steps under CPU bfloat16 autocast, the sequence fed in two pieces with the state
    carried: finite loss and gradients, float32 states."""
    torch.manual_seed(0)
    layer = build_mixer(name, D_MODEL, N_HEADS, **SMALL_OPTIONS.get(name, {}))
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x = torch.randn(2, 11, D_MODEL)
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y1, state = layer(x[:, :6])
            y2, state = layer(x[:, 6:], state)
        assert y1.dtype == y2.dtype == torch.bfloat16
        loss = (torch.cat([y1, y2], 1).float() - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        assert torch.isfinite(loss)
        for pname, p in layer.named_parameters():
            assert p.grad is None or torch.isfinite(p.grad).all(), pname
        opt.step()
    tensors = floating_tensors(state)
    assert tensors and all(torch.isfinite(t).all() for t in tensors)
    if name not in INPUT_CACHES:
        assert {t.dtype for t in tensors} == {torch.float32}


STREAM_MIXERS = ["delta", "norm", "infini", "aft-simple", "ttt-linear"]


def run_stream(name: str, total: int, piece: int) -> None:
    torch.manual_seed(0)
    layer = build_mixer(name, D_MODEL, N_HEADS).eval()
    gen = torch.Generator().manual_seed(1)
    state = None
    with torch.no_grad():
        for start in range(0, total, piece):
            x = torch.randn(1, min(piece, total - start), D_MODEL, generator=gen)
            y, state = layer(x, state)
            assert torch.isfinite(y).all(), f"non-finite output at token {start}"
    for t in floating_tensors(state):
        assert torch.isfinite(t).all()
        assert t.dtype == torch.float32


@pytest.mark.parametrize("name", STREAM_MIXERS)
def test_long_stream_finite(name):
    """20k tokens in pieces of 2000 (not a multiple of any block size), state carried."""
    run_stream(name, 20_000, 1_999)


@pytest.mark.slow
@pytest.mark.parametrize("name", STREAM_MIXERS)
def test_million_token_stream_finite(name):
    run_stream(name, 1_000_000, 8_191)


def test_aft_large_keys_match_float64():
    """Keys around 80 (exp(80) is near float32's limit; a sum of them overflows): the
    max-shifted float32 forms stay finite and agree with float64."""
    torch.manual_seed(0)
    B, T, D, H = 2, 23, 6, 3
    q, v = torch.randn(B, T, D), torch.randn(B, T, D)
    k = 80.0 + 5 * torch.randn(B, T, D)
    w = torch.randn(T, T)
    calls = {
        "aft": lambda q, k, v, w: aft(q, k, v, w, chunk_size=5)[0],
        "aft-noncausal": lambda q, k, v, w: aft(q, k, v, w, causal=False, chunk_size=5)[0],
        "aft-simple": lambda q, k, v, w: aft(q, k, v)[0],
        "aft_local": lambda q, k, v, w: aft_local(q, k, v, w[:, :4], window=4, chunk_size=5)[0],
        "aft-simple-recurrent": lambda q, k, v, w: aft(q, k, v, mode="recurrent")[0],
    }
    for label, call in calls.items():
        o32 = call(q, k, v, w)
        o64 = call(q.double(), k.double(), v.double(), w.double())
        assert torch.isfinite(o32).all(), label
        torch.testing.assert_close(o32.double(), o64, rtol=1e-4, atol=1e-4, msg=label)
    qc, vc = torch.randn(B, T, H, 2), torch.randn(B, T, H, 2)
    kc, wc = 80.0 + 5 * torch.randn(B, T, H), torch.randn(H, 5)
    o32 = aft_conv(qc, kc, vc, wc, chunk_size=4)[0]
    o64 = aft_conv(qc.double(), kc.double(), vc.double(), wc.double(), chunk_size=4)[0]
    assert torch.isfinite(o32).all()
    torch.testing.assert_close(o32.double(), o64, rtol=1e-4, atol=1e-4)


def test_favor_large_norm_inputs_finite():
    """||x|| ~ 300: exp(x.w) alone overflows; folding -||x||^2/2 into the exponent keeps the
    features finite (they underflow to 0), and normalised attention over them stays finite."""
    torch.manual_seed(0)
    proj = draw_favor_projection(16, 8, generator=torch.Generator().manual_seed(0))
    x = 100.0 * torch.randn(2, 9, 3, 8)
    feats = favor_features(x, proj)
    assert torch.isfinite(feats).all() and (feats >= 0).all()
    o, _ = linear_attn(feats, feats, torch.randn(2, 9, 3, 4), normalize=True, chunk_size=4)
    assert torch.isfinite(o).all()
    layer = build_mixer("favor", D_MODEL, N_HEADS, chunk_size=4).eval()
    y, state = layer(1e3 * torch.randn(2, 9, D_MODEL))
    assert torch.isfinite(y).all() and all(torch.isfinite(t).all() for t in state)


def test_near_zero_normalisers_finite():
    """Sum normalisation of all-zero features (DPFP at x = 0) and attention normalisation with
    q . z = 0 (ReLU features of negative inputs) give finite outputs, not 0/0."""
    zero = torch.zeros(2, 5, 3, 4)
    assert torch.isfinite(sum_norm(dpfp(zero))).all()
    tiny = torch.full((2, 5, 3, 4), 1e-30)
    assert torch.isfinite(sum_norm(tiny)).all()
    neg = relu(-torch.rand(2, 5, 3, 4) - 0.1)  # exactly zero features
    for mode in ("chunk", "recurrent", "naive"):
        o, (S, z) = linear_attn(neg, neg, torch.randn(2, 5, 3, 4), normalize=True, mode=mode,
                                chunk_size=2, output_final_state=True)
        assert torch.isfinite(o).all() and torch.isfinite(S).all() and torch.isfinite(z).all()
    for name in ("linear", "dpfp", "delta"):
        layer = build_mixer(name, D_MODEL, N_HEADS, **SMALL_OPTIONS.get(name, {})).eval()
        with torch.no_grad():
            for p in layer.parameters():
                p.zero_()  # all-zero projections: every feature vector and normaliser is zero
        y, _ = layer(torch.randn(2, 5, D_MODEL))
        assert torch.isfinite(y).all(), name
