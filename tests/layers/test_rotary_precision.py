"""Rotary frequencies are exact in every module dtype (not a buffer rounded to float32/bf16)."""

from __future__ import annotations

import math

import pytest
import torch

from fastweights import build_mixer
from fastweights.layers.positional import apply_rotary


@pytest.mark.parametrize("name", ["softmax", "ttt-linear", "ttt-mlp", "infini"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_rotary_frequencies_survive_dtype_casts(name, dtype):
    layer = build_mixer(name, 24, 2).to(dtype)  # built in float32, then cast
    D = layer.head_dim
    exact = torch.tensor([10000.0 ** (-2 * i / D) for i in range(D // 2)], dtype=torch.float64)
    assert layer.inv_freq.dtype == torch.float64
    assert torch.equal(layer.inv_freq, exact)
    assert not any("inv_freq" in n for n, _ in layer.named_buffers())


def test_float64_softmax_layer_matches_exact_rotary_attention():
    torch.manual_seed(0)
    layer = build_mixer("softmax", 12, 3).double()
    x = torch.randn(2, 9, 12, dtype=torch.float64)
    y, _ = layer(x)
    H, D = 3, 4
    q, k, v = layer.qkv(x).view(2, 9, H, 3 * D).split(D, dim=-1)  # per head [q | k | v]
    inv = torch.tensor([10000.0 ** (-2 * i / D) for i in range(D // 2)], dtype=torch.float64)
    pos = torch.arange(9)
    q, k = apply_rotary(q, pos, inv), apply_rotary(k, pos, inv)
    s = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(D)
    s = s.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("bhts,bshd->bthd", s.softmax(-1), v).reshape(2, 9, H * D)
    assert (y - layer.out(o)).abs().max().item() < 1e-12


@pytest.mark.parametrize("name,period_attr", [("ttt-linear", "mini_batch_size"),
                                              ("infini", "segment_len")])
def test_periodic_rotary_table_equals_apply_rotary(name, period_attr):
    """The cached cos/sin table of mini-batch/segment-local positions gives exactly what
    apply_rotary computes, in each dtype (the cache is per dtype: float64 first, then float32)."""
    layer = build_mixer(name, 24, 2)
    period = getattr(layer, period_attr)
    positions = torch.tensor([0, 5, period - 1, 3, 0, 7]) % period
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        x = torch.randn(2, 6, 2, layer.head_dim).to(dtype)
        ref = apply_rotary(x, positions, layer.inv_freq)
        (got,) = layer._rotate_periodic((x,), positions, period)
        assert got.dtype == dtype and torch.equal(got, ref), dtype
