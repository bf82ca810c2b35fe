"""fla's RetNet on fastweights' ops, without fla installed: the retention layer's state contract,
its rotary positions and decays, the config's supported/refused options. Loading, decoding and
generate() are tests/fla/test_deltanet.py's (parametrised over families); equality with fla's own
code is tests/fla/test_retnet_reference.py."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from fastweights.fla import FLA_RETNET_OPTIONS, FlaRetNetConfig, FlaRetNetLM
from fastweights.layers.fla_retnet import FlaMultiScaleRetention, fla_rotary_tables
from fastweights.layers.positional import rotate_halves
from fastweights.ops.transnormer import decay_linear_attn
from tests.helpers import assert_close64, assert_pieces_and_steps_equal_whole

LAYER_OPTIONS = {
    "base": {},
    "gqa-no-gate": {"num_kv_heads": 1, "use_output_gate": False},
    "map-no-affine-unfused": {"feature_map": "gelu", "elementwise_affine": False,
                              "fuse_norm": False},
    "expand": {"expand_k": 0.5, "expand_v": 1.0},
}


def layer(seed: int = 0, **options) -> FlaMultiScaleRetention:
    torch.manual_seed(seed)
    m = FlaMultiScaleRetention(24, 3, norm_eps=1e-5, chunk_size=4, **options).double()
    with torch.no_grad():  # order-one norm gains (fresh: ones)
        for name, p in m.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return m


@pytest.mark.parametrize("options", LAYER_OPTIONS.values(), ids=LAYER_OPTIONS.keys())
def test_layer_pieces_and_steps_equal_whole(options):
    m = layer(**options)
    x = torch.randn(2, 11, 24, dtype=torch.float64)
    assert m(x)[1][1].tolist() == [11, 11]  # the offset: tokens consumed per row
    assert_pieces_and_steps_equal_whole(m, x, 5)


@pytest.mark.parametrize("mode", ["naive", "recurrent"])
def test_layer_modes_agree(mode):
    m = layer(num_kv_heads=1)
    x = torch.randn(2, 9, 24, dtype=torch.float64)
    y = m(x)[0]
    m.mode = mode
    assert_close64(m(x)[0], y, what=mode)


def test_layer_is_rotary_then_decayed_linear_attention():
    """The layer's maths written out: projections, rotary on halves at positions 0..T-1 (angles
    of fla's float32 tables), gamma_h = 1 - 2^(-5-h), scale Dk^-0.5, per-head RMSNorm * silu(g)."""
    m = layer()
    x = torch.randn(1, 7, 24, dtype=torch.float64)
    H, Dk = 3, 8
    q, k, v = (p(x).unflatten(-1, (H, -1)) for p in (m.q_proj, m.k_proj, m.v_proj))
    angles = torch.arange(7, dtype=torch.float32)[:, None] * (
        1 / 10000 ** (torch.arange(0, Dk, 2, dtype=torch.float32) / Dk))
    c, s = angles.cos().double()[:, None], angles.sin().double()[:, None]  # [T, 1, Dk/2]

    def rope(z):
        a, b = z[..., :Dk // 2], z[..., Dk // 2:]
        return torch.cat([a * c - b * s, b * c + a * s], -1)

    q, k = rope(q), rope(k)
    gamma = torch.tensor([1 - 2.0 ** -5, 1 - 2.0 ** -6, 1 - 2.0 ** -7], dtype=torch.float64)
    o = torch.zeros_like(v)
    for t in range(7):
        for j in range(t + 1):
            w = gamma ** (t - j) * (q[0, t] * k[0, j]).sum(-1) * Dk ** -0.5  # [H]
            o[0, t] += w[:, None] * v[0, j]
    normed = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + 1e-5) * m.g_norm_swish_gate.weight
    gate = torch.nn.functional.silu(m.g_proj(x)).unflatten(-1, (H, -1))
    assert_close64(m(x)[0], m.o_proj((normed * gate).flatten(-2)), what="layer")


def test_rotate_halves_is_a_rotation_of_pairs_i_and_i_plus_half():
    x = torch.randn(2, 5, 3, 6, dtype=torch.float64)
    cos, sin = fla_rotary_tables(torch.arange(5), 6, torch.float64)
    y = rotate_halves(x, cos, sin)
    assert_close64(y.norm(dim=-1), x.norm(dim=-1), atol=1e-6, what="norm kept (float32 tables)")
    assert_close64(y[:, 0], x[:, 0], what="position 0")
    # relative positions: <rot(q, t), rot(k, s)> depends on t - s only
    q, k = torch.randn(6, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    c, s = fla_rotary_tables(torch.arange(8), 6, torch.float64)
    rq = rotate_halves(q.expand(1, 8, 1, 6), c, s)[0, :, 0]
    rk = rotate_halves(k.expand(1, 8, 1, 6), c, s)[0, :, 0]
    assert abs(float(rq[5] @ rk[2] - rq[7] @ rk[4])) < 1e-6  # float32 angles
    assert rotate_halves(x.bfloat16(), cos, sin).dtype == torch.bfloat16


def test_layer_state_and_parameter_names():
    m = layer(num_kv_heads=1)
    _, (S, offset) = m(torch.randn(2, 6, 24, dtype=torch.float64))
    assert S.shape == (2, 3, 8, 16) and offset.dtype == torch.long
    assert m.state_size() == 3 * 8 * 16
    assert set(dict(m.named_parameters())) == {
        "q_proj.weight", "k_proj.weight", "v_proj.weight", "g_proj.weight",
        "g_norm_swish_gate.weight", "o_proj.weight"}
    assert m.k_proj.out_features == 8 and m.v_proj.out_features == 16
    assert set(dict(layer(fuse_norm=False, elementwise_affine=False).named_parameters())) == {
        "q_proj.weight", "k_proj.weight", "v_proj.weight", "g_proj.weight", "o_proj.weight"}
    assert "g_norm.weight" in dict(layer(use_output_gate=False).named_parameters())


def test_layer_decay_is_the_op_with_rotary_inputs():
    """Feeding T tokens after a state equals decay_linear_attn's own carried state."""
    m = layer()
    x = torch.randn(1, 6, 24, dtype=torch.float64)
    _, (S, _) = m(x)
    q, k, v = (p(x).unflatten(-1, (3, -1)) for p in (m.q_proj, m.k_proj, m.v_proj))
    cos, sin = fla_rotary_tables(torch.arange(6), 8, torch.float64)
    gamma = 1 - 2.0 ** (-5.0 - torch.arange(3, dtype=torch.float64))
    _, S_op = decay_linear_attn(rotate_halves(q, cos, sin), rotate_halves(k, cos, sin), v, gamma,
                                output_final_state=True, mode="naive")
    assert_close64(S, S_op, what="state")


@pytest.mark.parametrize("bad, match", [
    ({"feature_map": "prelu"}, "feature_map"), ({"num_kv_heads": 2}, "divisible by num_kv_heads"),
    ({"expand_k": 0.125}, "even"), ({"use_output_gate": 1}, "use_output_gate"),
    ({"elementwise_affine": None}, "elementwise_affine"),
], ids=["feature_map", "kv_heads", "odd-head", "gate-bool", "affine-bool"])
def test_layer_refuses_bad_options(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        FlaMultiScaleRetention(24, 3, **bad)


def test_layer_refuses_foreign_state():
    m = layer()
    x = torch.randn(1, 2, 24, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"\(S, offset\)"):
        m(x, (torch.zeros(1, 3, 8, 16),))
    with pytest.raises(ValueError, match="offset"):
        m(x, (torch.zeros(1, 3, 8, 16), torch.zeros(1)))


# ---------------------------------------------------------------------------------------------
# Config


@pytest.mark.parametrize("bad, match", [
    ({"attn": {"layers": [0], "num_heads": 2}}, "attn must be None"),
    ({"attnres_block_size": 2}, "attnres_block_size"),
    ({"hidden_act": "powlu"}, "hidden_act"),
    ({"attn_mode": "naive"}, "attn_mode"),
    ({"feature_map": "gelu_new"}, "feature_map"),
    ({"elementwise_affine": "yes"}, "elementwise_affine"),
    ({"num_kv_heads": 3}, "divisible by num_kv_heads"),
    ({"expand_k": 0.375}, "even"),
    ({"fuse_linear_cross_entropy": True}, "fuse_cross_entropy and fuse_linear_cross_entropy"),
    ({"pad_token_id": 99}, "pad_token_id"),
], ids=["attn", "attnres", "powlu", "attn_mode", "feature_map", "affine", "kv_heads",
        "odd-head", "fuse_ce", "pad"])
def test_config_refuses_unsupported_options_naming_them(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        FlaRetNetConfig(hidden_size=32, num_heads=4, num_hidden_layers=1, vocab_size=41, **bad)


def test_config_defaults_are_flas_and_every_field_is_classified():
    assert {f.name for f in dataclasses.fields(FlaRetNetConfig)} == set(FLA_RETNET_OPTIONS)
    c = FlaRetNetConfig.from_dict({"model_type": "retnet", "hidden_size": 1024})
    assert (c.num_heads, c.expand_v, c.hidden_ratio, c.norm_eps) == (8, 2.0, 2, 1e-6)
    assert c.mlp_hidden_size() == 1536  # 256-multiple above int(1024 * 2 * 2 / 3) = 1365
    for mode in ("chunk", "fused_chunk", "parallel", "fused_recurrent"):
        FlaRetNetConfig(hidden_size=32, num_heads=4, num_hidden_layers=1, attn_mode=mode)
    none_affine = FlaRetNetConfig(hidden_size=32, num_heads=4, num_hidden_layers=1,
                                  elementwise_affine=None)
    assert none_affine.layer().g_norm_swish_gate.weight is None  # fla: None means no weight


def test_config_warns_about_ignored_short_conv_and_refuses_other_model_types():
    with pytest.warns(UserWarning, match="use_short_conv"):
        c = FlaRetNetConfig(hidden_size=32, num_heads=4, num_hidden_layers=1, use_short_conv=True)
    assert not any("conv" in n for n, _ in FlaRetNetLM(c).named_parameters())
    with pytest.raises(ValueError, match="model_type"):
        FlaRetNetConfig.from_dict({"model_type": "delta_net"})


def test_from_fla_names_the_supported_families(tmp_path):
    pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    from fastweights.fla import from_fla

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gla", "hidden_size": 32}))
    with pytest.raises(ValueError, match=r"'gla'.*\['delta_net', 'gated_deltanet', 'retnet'\]"):
        from_fla(tmp_path)
