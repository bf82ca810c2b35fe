"""AFT layers beyond the shared contract: the docs/maths.md 4.5 limits at layer level, the
factorised position bias, max_len, the AFT-conv kernel reparameterisation, modes, options,
dtypes."""

from __future__ import annotations

import pytest
import torch

from fastweights import build_mixer
from fastweights.layers import AFTConv, AFTFull, AFTLocal, AFTSimple
from fastweights.ops import aft, aft_local
from tests.helpers import assert_close64, steps_from

D_MODEL, T = 8, 11


def x_in(B=2, T=T, seed=1):
    return torch.randn(B, T, D_MODEL, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def noisy(layer):
    torch.manual_seed(0)
    layer = layer.double()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return layer


def copy_projections(src, dst):
    dst.qkv.load_state_dict(src.qkv.state_dict())
    dst.out.load_state_dict(src.out.state_dict())


def test_registry_names_build_the_layers():
    for name, cls in [("aft-full", AFTFull), ("aft-local", AFTLocal), ("aft-simple", AFTSimple),
                      ("aft-conv", AFTConv)]:
        assert type(build_mixer(name, 16, 4)) is cls


def test_full_with_zero_bias_is_simple():
    full = noisy(AFTFull(D_MODEL, 2, max_len=16, d_bias=4))
    simple = AFTSimple(D_MODEL, 2).double()
    copy_projections(full, simple)
    with torch.no_grad():
        full.bias.u.zero_()
    assert_close64(full(x_in())[0], simple(x_in())[0])


def test_local_with_wide_window_is_full():
    full = noisy(AFTFull(D_MODEL, 2, max_len=16, d_bias=4))
    local = AFTLocal(D_MODEL, 2, window=T, max_len=16, d_bias=4).double()
    local.load_state_dict(full.state_dict())
    assert_close64(local(x_in())[0], full(x_in())[0])


def test_local_band_is_the_factorised_bias():
    """The layer's band equals the window of w = U V^T, applied by the whole-sequence op."""
    layer = noisy(AFTLocal(D_MODEL, 2, window=3, max_len=16, d_bias=4))
    x = x_in()
    q, k, v = layer._qkv(x)
    w = layer.bias.u @ layer.bias.v.T
    i = torch.arange(x.shape[1])[:, None]
    band = torch.where(i >= torch.arange(3), w[i, (i - torch.arange(3)).clamp_min(0)], 0.0)
    ref = layer.out(aft_local(q, k, v, band, window=3)[0])
    assert_close64(layer(x)[0], ref)
    full = noisy(AFTFull(D_MODEL, 2, max_len=16, d_bias=4))
    q, k, v = full._qkv(x)
    assert_close64(full(x)[0], full.out(aft(q, k, v, full.bias.u @ full.bias.v.T)[0]))


@pytest.mark.parametrize("window", [1, 4, 20], ids=lambda w: f"s{w}")
def test_local_one_token_steps_equal_whole(window):
    """The decoding step (its token's biases alone, the recurrence on the checked state)
    equals the whole sequence through the band, outputs and states, while the window fills
    (p < s - 1) and after, from None and from a state left by a longer piece."""
    layer = noisy(AFTLocal(D_MODEL, 2, window=window, max_len=16, d_bias=4))
    x = x_in(T=13)
    whole, final = layer(x)
    for start in (0, 6):
        ys, state = steps_from(layer, x, start)
        assert_close64(ys, whole[:, start:], what=f"from {start}")
        assert state.pos == final.pos == 13
        # (a, n, m) stand for e^a n and e^a m, a being any reference: compare what they mean
        # (nothing has left a window wider than the sequence: both sums are empty).
        if window < 13:
            assert_close64(state.a + state.m.log(), final.a + final.m.log(), what="log-sum")
            assert_close64(state.n / state.m, final.n / final.m, what="ratio")
        else:
            assert (state.m == 0).all() and (final.m == 0).all()
        for a, b in zip(state[3:5], final[3:5]):
            assert_close64(a, b, what="cache")


def test_local_keys_row_is_the_band_row():
    bias = noisy(AFTLocal(D_MODEL, 2, window=5, max_len=16, d_bias=4)).bias
    for p in (0, 2, 4, 9):
        J = min(p + 1, 5)
        assert_close64(bias.keys_row(p, 5), bias.band(p, p + 1, 5, 4)[0, :J].flip(0))
    with pytest.raises(ValueError, match="exceeds max_len=16"):
        bias.keys_row(16, 5)


@pytest.mark.parametrize("cls", [AFTFull, AFTLocal], ids=lambda c: c.__name__)
def test_max_len_is_enforced_including_the_streamed_past(cls):
    layer = cls(D_MODEL, 2, max_len=8, d_bias=4).double()
    with pytest.raises(ValueError, match="exceeds max_len=8"):
        layer(x_in(T=9))
    _, state = layer(x_in(T=5))
    layer(x_in(T=3), state)  # 8 tokens in total: fine
    with pytest.raises(ValueError, match=r"sequence length 9 .* exceeds max_len=8"):
        layer(x_in(T=4), state)
    _, state = layer(x_in(T=3), state)
    with pytest.raises(ValueError, match=r"sequence length 9 .* exceeds max_len=8"):
        layer(x_in(T=1), state)  # a decoding step


@pytest.mark.parametrize("cls,opts", [(AFTSimple, {}), (AFTLocal, {"window": 4}), (AFTConv, {"window": 4})],
                         ids=["simple", "local", "conv"])
@pytest.mark.parametrize("mode", ["recurrent", "naive"])
def test_other_modes_match_chunk_mode(cls, opts, mode):
    chunk = noisy(cls(D_MODEL, 2, mode="chunk", **opts))
    rec = cls(D_MODEL, 2, mode=mode, **opts).double()
    rec.load_state_dict(chunk.state_dict())
    y, state = chunk(x_in())
    y_rec, state_rec = rec(x_in())
    assert_close64(y_rec, y)
    # Either mode continues from the other's state.
    assert_close64(rec(x_in(seed=2), state)[0], chunk(x_in(seed=2), state_rec)[0])


@pytest.mark.parametrize("reparam", [True, False])
def test_conv_starts_as_simple_and_reparameterises(reparam):
    layer = AFTConv(D_MODEL, 2, window=5, reparam=reparam)
    assert torch.equal(layer.kernel_weight(), torch.zeros(2, 5))  # AFT-simple at initialisation
    if reparam:
        with torch.no_grad():
            layer.gamma.copy_(torch.tensor([2.0, 0.5]))
            layer.beta.copy_(torch.tensor([-1.0, 3.0]))
        w = layer.kernel_weight().double()
        assert_close64(w.mean(-1), torch.tensor([-1.0, 3.0], dtype=torch.float64), atol=1e-6)
        assert_close64(w.std(-1, unbiased=False), torch.tensor([2.0, 0.5], dtype=torch.float64), atol=1e-4)


def test_conv_with_zero_kernel_matches_heads_of_simple():
    """A zero kernel leaves AFT-simple with one key per head, shared by the head's channels."""
    layer = noisy(AFTConv(D_MODEL, 2, window=3, reparam=False))
    with torch.no_grad():
        layer.kernel.zero_()
    x = x_in()
    q, k, v = layer._qkv(x)
    k_per_channel = k.repeat_interleave(D_MODEL // 2, dim=-1)  # head h's key on its channels
    assert_close64(layer(x)[0], layer.out(aft(q, k_per_channel, v)[0]))


def test_state_sizes():
    d = 12
    assert AFTSimple(D_MODEL, 2, d_hidden=d).state_size() == 3 * d
    assert AFTLocal(D_MODEL, 2, d_hidden=d, window=5).state_size(10**6) == 3 * d + 2 * 4 * d
    assert AFTConv(D_MODEL, 3, d_hidden=d, window=5).state_size() == 2 * 3 + d + 4 * (3 + d)
    assert AFTFull(D_MODEL, 2, d_hidden=d).state_size(7) == 2 * d * 7


def test_state_sizes_count_the_state():
    """state_size equals the floats actually carried once the window is full."""
    x = x_in(B=1, T=9)
    for layer in (AFTSimple(D_MODEL, 2, d_hidden=6), AFTLocal(D_MODEL, 2, d_hidden=6, window=4),
                  AFTConv(D_MODEL, 3, d_hidden=6, window=4), AFTFull(D_MODEL, 2, d_hidden=6)):
        _, state = layer.double()(x)
        floats = sum(s.numel() for s in state if isinstance(s, torch.Tensor))
        assert floats == layer.state_size(9), type(layer).__name__


def test_hidden_width_may_differ_from_model_width():
    for layer in (AFTFull(D_MODEL, 2, d_hidden=6, max_len=16, d_bias=4), AFTLocal(D_MODEL, 2, d_hidden=6),
                  AFTSimple(D_MODEL, 2, d_hidden=6), AFTConv(D_MODEL, 3, d_hidden=6)):
        y, _ = layer.double()(x_in())
        assert y.shape == (2, T, D_MODEL)


def test_bfloat16_forward_is_finite():
    x = x_in().bfloat16()
    for name in ("aft-full", "aft-local", "aft-simple", "aft-conv"):
        layer = build_mixer(name, D_MODEL, 2).bfloat16()
        y, state = layer(x)
        assert y.dtype == torch.bfloat16 and torch.isfinite(y).all(), name
        assert all(s.dtype == torch.float32 for s in state if isinstance(s, torch.Tensor)), name


BAD_OPTIONS = [
    ("aft-local", {"window": 0}, ValueError, "window must be >= 1"),
    ("aft-conv", {"window": -1}, ValueError, "window must be >= 1"),
    ("aft-simple", {"mode": "parallel"}, ValueError, "mode must be one of"),
    ("aft-full", {"max_len": 0}, ValueError, "max_len must be >= 1"),
    ("aft-full", {"d_bias": 0}, ValueError, "d_bias must be >= 1"),
    ("aft-local", {"bias_std": -1.0}, ValueError, "bias_std"),
    ("aft-conv", {"d_hidden": 7}, ValueError, "divisible by n_heads"),
    ("aft-conv", {"reparam": 1}, TypeError, "reparam must be a bool"),
    ("aft-conv", {"nonneg": "no"}, TypeError, "nonneg must be a bool"),
    ("aft-conv", {"global_context": False, "mode": "recurrent"}, ValueError, "no mode='recurrent'"),
    ("aft-conv", {"nonneg": False, "mode": "recurrent"}, ValueError, "no mode='recurrent'"),
    ("aft-full", {"chunk_size": 0}, ValueError, "chunk_size must be >= 1"),
]


@pytest.mark.parametrize("name,opts,exc,words", BAD_OPTIONS,
                         ids=[f"{n}-{next(iter(o))}" for n, o, _, _ in BAD_OPTIONS])
def test_bad_options(name, opts, exc, words):
    with pytest.raises(exc, match=words):
        build_mixer(name, D_MODEL, 2, **opts)


@pytest.mark.parametrize("name", ["aft-full", "aft-local", "aft-simple", "aft-conv"])
def test_foreign_state_is_rejected(name):
    layer = build_mixer(name, D_MODEL, 2).double()
    with pytest.raises(TypeError, match="state"):
        layer(x_in(), torch.zeros(3))


@pytest.mark.parametrize("opts", [{"global_context": False}, {"nonneg": False}, {"gating": False}],
                         ids=["local-only", "signed", "ungated"])
def test_conv_ablations_at_layer_level(opts):
    """Each ablation is the op's flag on the same projections: at initialisation (kernel weight
    1 everywhere) the signed layer equals AFT-conv; pieces with the state carried equal the
    whole sequence; without gating there is no Q projection."""
    ref = noisy(AFTConv(D_MODEL, 2, window=4))
    layer = AFTConv(D_MODEL, 2, window=4, **opts).double()
    x = x_in()
    if opts.get("gating") is False:
        assert layer.qkv.out_features == ref.qkv.out_features - D_MODEL
        with torch.no_grad():
            layer.qkv.weight.copy_(ref.qkv.weight[D_MODEL:])
            layer.qkv.bias.copy_(ref.qkv.bias[D_MODEL:])
            layer.kernel.copy_(ref.kernel), layer.gamma.copy_(ref.gamma), layer.beta.copy_(ref.beta)
            for m in (layer, ref):  # identity output maps: compare the mixed channels
                m.out.weight.copy_(torch.eye(D_MODEL)), m.out.bias.zero_()
        assert_close64(ref(x)[0], torch.sigmoid(ref._qkv(x)[0]) * layer(x)[0])
    else:
        layer.load_state_dict(ref.state_dict())
        if opts.get("nonneg") is False:
            with torch.no_grad():
                layer.gamma.zero_(), layer.beta.zero_(), ref.gamma.zero_(), ref.beta.zero_()
            assert_close64(layer(x)[0], ref(x)[0])  # weight 1 + 0 = e^0
    whole = layer(x)[0]
    y1, st = layer(x[:, :5])
    y2, _ = layer(x[:, 5:], st)
    assert_close64(torch.cat([y1, y2], 1), whole)
    assert f"{next(iter(opts))}=False" in repr(layer)
