"""The gated-delta layer (Gated DeltaNet): its maths against a literal transcription of the
published layer, its options (grouped heads, negative eigenvalues, gates, convolutions), state
and refusals. The contract tests (pieces, steps, packing, context parallelism, export,
multistream) cover it as a registered mixer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastweights import build_mixer
from fastweights.layers import GatedDeltaNet
from tests.helpers import assert_close64, assert_pieces_and_steps_equal_whole

D = 24


def layer(seed: int = 0, **options) -> GatedDeltaNet:
    torch.manual_seed(seed)
    m = GatedDeltaNet(D, 2, chunk_size=4, **options).double()
    with torch.no_grad():  # order-one gains, convolutions and gates (fresh: ones, small)
        for name, p in m.named_parameters():
            if "norm" in name or "conv" in name or name in ("A_log", "dt_bias"):
                p.copy_(0.5 * torch.randn_like(p))
    return m


def inputs(B: int = 2, T: int = 11, seed: int = 1) -> torch.Tensor:
    return torch.randn(B, T, D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def reference(m: GatedDeltaNet, x: torch.Tensor) -> torch.Tensor:
    """The layer written out token by token from the paper / fla's layer (module docstring)."""
    B, T, _ = x.shape
    Hk, H, Dk, Dv = m.n_heads, m.num_v_heads, m.head_dim, m.head_v_dim

    def conv(proj, c):
        y = proj(x)
        if not m.use_short_conv:
            return F.silu(y)
        W = m.conv_size
        y = F.conv1d(y.transpose(1, 2), c.weight, c.bias, padding=W - 1, groups=y.shape[-1])
        return F.silu(y[..., :T].transpose(1, 2))

    q = conv(m.q_proj, getattr(m, "q_conv1d", None)).view(B, T, Hk, Dk)
    k = conv(m.k_proj, getattr(m, "k_conv1d", None)).view(B, T, Hk, Dk)
    v = conv(m.v_proj, getattr(m, "v_conv1d", None)).view(B, T, H, Dv)
    q, k = (z / torch.sqrt((z * z).sum(-1, keepdim=True) + 1e-6) for z in (q, k))
    beta = torch.sigmoid(m.b_proj(x)) * (2.0 if m.allow_neg_eigval else 1.0)
    alpha = torch.exp(-m.A_log.exp() * F.softplus(m.a_proj(x) + m.dt_bias))
    S = x.new_zeros(B, H, Dk, Dv)
    eye = torch.eye(Dk, dtype=x.dtype)
    out = []
    for t in range(T):
        kt = k[:, t].repeat_interleave(H // Hk, dim=1)  # value head h reads key head h // (H/Hk)
        qt = q[:, t].repeat_interleave(H // Hk, dim=1) * Dk ** -0.5
        kk = kt[..., :, None] * kt[..., None, :]
        b, a = beta[:, t, :, None, None], alpha[:, t, :, None, None]
        S = a * (eye - b * kk) @ S + b * kt[..., :, None] * v[:, t, :, None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", qt, S))
    o = torch.stack(out, 1)  # [B, T, H, Dv]
    o = o / torch.sqrt(o.square().mean(-1, keepdim=True) + m.norm_eps) * m.o_norm.weight
    if m.use_gate:
        gate = m.g_proj(x).view(B, T, H, Dv)
        o = o * (torch.sigmoid(gate) if m.gate_activation == "sigmoid" else F.silu(gate))
    return m.o_proj(o.reshape(B, T, H * Dv))


OPTIONS = {
    "defaults": {},
    "grouped-heads": {"num_v_heads": 4, "expand_v": 1.0},
    "negeig-sigmoid-gate": {"allow_neg_eigval": True, "gate_activation": "sigmoid"},
    "no-gate-no-conv": {"use_gate": False, "use_short_conv": False},
    "conv-bias-w2-headdim": {"conv_bias": True, "conv_size": 2, "head_dim": 5, "expand_v": 1.4},
}


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_layer_equals_the_written_out_recurrence(options):
    m, x = layer(**options), inputs()
    with torch.no_grad():
        assert_close64(m(x)[0], reference(m, x), what="y")


@pytest.mark.parametrize("options", OPTIONS.values(), ids=OPTIONS.keys())
def test_pieces_and_steps_equal_whole(options):
    assert_pieces_and_steps_equal_whole(layer(**options), inputs(), 5)


@pytest.mark.parametrize("mode", ["naive", "recurrent"])
def test_modes_agree(mode):
    m, x = layer(num_v_heads=4), inputs()
    y = m(x)[0]
    m.mode = mode
    assert_close64(m(x)[0], y, what=mode)


def test_state_parameters_and_sizes():
    m = layer(num_v_heads=4, expand_v=1.5)  # Hk 2, H 4, Dk 12, Dv 18, C = 2*24 + 72
    _, (conv, S) = m(inputs(T=3))
    assert conv.shape == (2, 120, 3) and conv.dtype == torch.float64
    assert S.shape == (2, 4, 12, 18)
    assert m.state_size() == 4 * 12 * 18 + 3 * 120
    assert layer(use_short_conv=False).state_size() == 2 * 12 * 24
    assert set(dict(m.named_parameters())) == {
        "q_proj.weight", "k_proj.weight", "v_proj.weight", "a_proj.weight", "b_proj.weight",
        "A_log", "dt_bias", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight",
        "g_proj.weight", "o_norm.weight", "o_proj.weight"}


def test_bfloat16_keeps_float32_state_and_is_close_to_float64():
    m, x = layer(num_v_heads=4), inputs()
    y64 = m(x)[0]
    y16, (conv, S) = m.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert y16.dtype == conv.dtype == torch.bfloat16 and S.dtype == torch.float32
    assert (y16.double() - y64).abs().max() < 0.05 * y64.abs().max()


def test_registry_builds_qwen35_layout():
    m = build_mixer("gated-delta", 64, 2, num_v_heads=4, head_dim=16, expand_v=1.0)
    assert (m.n_heads, m.num_v_heads, m.head_dim, m.head_v_dim) == (2, 4, 16, 16)


@pytest.mark.parametrize(("options", "match"), [
    ({"num_v_heads": 3}, "multiple of n_heads"),
    ({"expand_v": 0.3}, "head_dim \\* expand_v"),
    ({"gate_activation": "relu"}, "gate_activation"),
    ({"norm_eps": 0.0}, "norm_eps"),
    ({"conv_size": 0}, "conv_size"),
])
def test_bad_options_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        GatedDeltaNet(D, 2, **options)


def test_foreign_state_is_refused():
    m = layer()
    with pytest.raises(TypeError, match="gated-delta"):
        m(inputs(), (torch.zeros(1),))
    _, (conv, S) = m(inputs())
    with pytest.raises(ValueError, match="conv"):
        m(inputs(), (conv[:, :, :2], S))
