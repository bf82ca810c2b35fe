"""LinearAttention / DeltaNet options: feature maps, normalisations, update rules, FAVOR redraw."""

from __future__ import annotations

import itertools

import pytest
import torch

from fastweights import build_mixer
from fastweights.layers import DeltaNet, LinearAttention
from tests.helpers import assert_close64

COMBOS = [
    (fm, norm, upd)
    for fm, norm, upd in itertools.product(
        ["elu", "relu", "dpfp", "favor", "identity"], ["none", "attention", "sum", "sum+attention"],
        ["sum", "delta"])
    if not (upd == "delta" and norm.endswith("attention"))
]


@pytest.mark.parametrize("fm,norm,upd", COMBOS, ids=["-".join(c) for c in COMBOS])
def test_every_configuration_streams(fm, norm, upd):
    torch.manual_seed(0)
    layer = LinearAttention(12, 3, feature_map=fm, normalize=norm, update=upd, nu=2, m=5,
                            chunk_size=4).double().eval()
    x = torch.randn(2, 11, 12, dtype=torch.float64)
    whole, _ = layer(x)
    a, s = layer(x[:, :6])
    b, _ = layer(x[:, 6:], s)
    assert_close64(torch.cat([a, b], 1), whole)
    ref = LinearAttention(12, 3, feature_map=fm, normalize=norm, update=upd, nu=2, m=5,
                          mode="naive").double().eval()
    ref.load_state_dict(layer.state_dict())
    assert_close64(ref(x)[0], whole)


def test_sum_plus_attention_normalisation_is_both_normalisers():
    """normalize='sum+attention' (the fast weight paper's ablation): sum-normalised features fed
    to the attention-normalised sum rule, checked against the ops composed by hand (float64)."""
    from fastweights.ops import elu_plus_one, linear_attn, sum_norm

    torch.manual_seed(1)
    layer = LinearAttention(15, 3, normalize="sum+attention").double()
    x = torch.randn(2, 9, 15, dtype=torch.float64)
    proj = layer.qkvb(x).unflatten(-1, (3, 15))  # [B, T, H, 3D]
    q, k, v = proj[..., :5], proj[..., 5:10], proj[..., 10:]
    q, k = sum_norm(elu_plus_one(q)), sum_norm(elu_plus_one(k))
    o, _ = linear_attn(q, k, v, normalize=True, mode="naive")
    expected = layer.out(o.flatten(2) / 5 ** 0.5)
    assert_close64(layer(x)[0], expected)
    only_sum = LinearAttention(15, 3, normalize="sum").double()
    only_sum.load_state_dict(layer.state_dict())
    assert not torch.allclose(only_sum(x)[0], expected)  # the attention normaliser matters


def test_feature_dims_and_state_size():
    assert LinearAttention(16, 2, feature_map="dpfp", nu=3).feature_dim == 2 * 8 * 3
    assert LinearAttention(16, 2, feature_map="favor", m=7).feature_dim == 14
    layer = DeltaNet(16, 2)
    assert layer.update == "delta" and layer.normalize == "sum" and layer.feature_map == "elu"
    assert layer.state_size() == 2 * 8 * 8


def test_favor_redraws_in_training_only():
    layer = LinearAttention(8, 2, feature_map="favor", m=4)
    x = torch.randn(1, 3, 8)
    p0 = layer.projection.clone()
    layer.train()
    layer(x)
    p1 = layer.projection.clone()
    assert not torch.equal(p0, p1)
    layer.eval()
    layer(x)
    assert torch.equal(layer.projection, p1)


def test_bad_layer_options():
    with pytest.raises(ValueError, match="feature_map must be one of"):
        LinearAttention(8, 2, feature_map="gelu")
    with pytest.raises(ValueError, match="nu must be"):
        LinearAttention(8, 2, feature_map="dpfp", nu=0)
    with pytest.raises(ValueError, match="divisible by n_heads"):
        LinearAttention(10, 3)


def test_chunk_size_default_is_the_measured_one_per_device():
    from fastweights.ops.backend import preferred_chunk_size

    assert preferred_chunk_size("delta_rule", "cpu") == 32  # measured (docs/performance.md)
    assert preferred_chunk_size("linear_attn", torch.device("cpu")) == 64
    assert preferred_chunk_size("delta_rule", "meta") == 64  # not measured: 64
    with pytest.raises(ValueError, match="op must be"):
        preferred_chunk_size("not_an_op", "cpu")
    torch.manual_seed(0)
    auto = build_mixer("delta", 16, 2).double()
    fixed = build_mixer("delta", 16, 2, chunk_size=5).double()
    fixed.load_state_dict(auto.state_dict())
    assert auto.chunk_size is None and fixed.chunk_size == 5
    x = torch.randn(2, 75, 16, dtype=torch.float64)  # spans several chunks of either size
    assert torch.allclose(auto(x)[0], fixed(x)[0], atol=1e-12)
    with pytest.raises((ValueError, TypeError), match="chunk_size"):
        build_mixer("delta", 16, 2, chunk_size=0)


def test_delta_rule_with_attention_normalisation_layer():
    """update='delta' with normalize='sum+attention' (the fast weight paper's Table 3 ablation):
    the op's (S, z) state is carried, pieces equal the whole, packed documents equal separate
    calls, and it differs from the plain sum-normalised delta rule."""
    torch.manual_seed(0)
    layer = LinearAttention(12, 3, normalize="sum+attention", update="delta").double()
    x = torch.randn(2, 19, 12, dtype=torch.float64)
    y, st = layer(x)
    assert len(st) == 2 and st[0].shape == (2, 3, 4, 4) and st[1].shape == (2, 3, 4)
    assert layer.state_size() == 3 * 4 * 4 + 3 * 4
    y1, s1 = layer(x[:, :7])
    y2, _ = layer(x[:, 7:], s1)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y)
    plain = LinearAttention(12, 3, normalize="sum", update="delta").double()
    plain.load_state_dict(layer.state_dict())
    assert not torch.allclose(plain(x)[0], y)
    cu = torch.tensor([0, 5, 19])
    packed, states = layer(x[:1], cu_seqlens=cu)
    torch.testing.assert_close(packed, torch.cat([layer(x[:1, :5])[0], layer(x[:1, 5:])[0]], 1))
    assert len(states) == 2
