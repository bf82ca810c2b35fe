"""fla's DeltaNet on fastweights' ops, without fla installed: the layer's state contract, the
config's supported/refused options, and the transformers model (loading, decoding, generate).
Equality with fla's own code is tests/fla/test_deltanet_reference.py."""

from __future__ import annotations

import json

import pytest
import torch

from fastweights.fla import FLA_OPTIONS, FlaDeltaNetConfig, FlaDeltaNetLM
from fastweights.layers import FlaDeltaNet, RMSNorm
from fastweights.layers.fla_deltanet import ShortConvolution
from tests.helpers import assert_close64, assert_pieces_and_steps_equal_whole

V = 41
LAYER_OPTIONS = {
    "silu-l2-conv": {},
    "no-conv": {"use_short_conv": False},
    "relu-sum": {"qk_activation": "relu", "qk_norm": "sum"},
    "elu-gate": {"qk_activation": "elu", "use_gate": True},
    "identity-nobeta-negeig": {"qk_activation": "identity", "use_beta": False,
                               "allow_neg_eigval": True, "conv_size": 2},
    "expand-conv-bias": {"expand_k": 0.5, "expand_v": 1.5, "conv_bias": True},
}


def layer(seed: int = 0, **options) -> FlaDeltaNet:
    torch.manual_seed(seed)
    m = FlaDeltaNet(24, 3, norm_eps=1e-5, chunk_size=4, **options).double()
    with torch.no_grad():  # order-one norm gains and convolutions (fresh: ones, small)
        for name, p in m.named_parameters():
            if "norm" in name or "conv" in name:
                p.copy_(torch.randn_like(p))
    return m


@pytest.mark.parametrize("options", LAYER_OPTIONS.values(), ids=LAYER_OPTIONS.keys())
def test_layer_pieces_and_steps_equal_whole(options):
    assert_pieces_and_steps_equal_whole(layer(**options),
                                        torch.randn(2, 11, 24, dtype=torch.float64), 5)


@pytest.mark.parametrize("mode", ["naive", "recurrent"])
def test_layer_modes_agree(mode):
    m = layer(use_gate=True)
    x = torch.randn(2, 9, 24, dtype=torch.float64)
    y = m(x)[0]
    m.mode = mode
    assert_close64(m(x)[0], y, what=mode)


def test_layer_state_and_sizes():
    m = layer()
    _, (cq, ck, cv, S) = m(torch.randn(2, 6, 24, dtype=torch.float64))
    assert cq.shape == ck.shape == cv.shape == (2, 24, 3) and S.shape == (2, 3, 8, 8)
    assert m.state_size() == 3 * 8 * 8 + 3 * 3 * 24
    assert layer(use_short_conv=False).state_size() == 3 * 8 * 8
    assert set(dict(m.named_parameters())) == {
        "q_proj.weight", "k_proj.weight", "v_proj.weight", "b_proj.weight", "q_conv1d.weight",
        "k_conv1d.weight", "v_conv1d.weight", "o_norm.weight", "o_proj.weight"}


def test_short_convolution_is_a_causal_depthwise_conv():
    conv = ShortConvolution(3, 4, bias=True, activation=False).double()
    x = torch.randn(1, 7, 3, dtype=torch.float64)
    y, state = conv(x)
    w, b = conv.weight[:, 0], conv.bias  # [C, W]
    for t in range(7):
        expect = b + sum(w[:, j] * x[0, t - 3 + j] for j in range(4) if t - 3 + j >= 0)
        assert_close64(y[0, t], expect, what=f"t={t}")
    assert_close64(state[0], x[0, -3:].T, what="state = last W - 1 inputs")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_short_convolution_half_precision_rounds_once_like_conv1d(dtype):
    """The taps accumulate in float32 and round once: equal to conv1d on the same inputs in
    float64 rounded to the dtype (to one rounding), as a kernel with float32 accumulation gives."""
    torch.manual_seed(0)
    conv = ShortConvolution(5, 4, bias=True, activation=True).to(dtype)
    x, past = torch.randn(2, 9, 5).to(dtype), torch.randn(2, 5, 3).to(dtype)
    y, state = conv(x, past)
    full = torch.cat([past, x.transpose(1, 2)], 2).double()
    exact = torch.nn.functional.conv1d(full, conv.weight.double(), conv.bias.double(), groups=5)
    expect = torch.nn.functional.silu(exact.to(dtype)).transpose(1, 2)
    assert y.dtype == dtype and state.dtype == dtype
    torch.testing.assert_close(y, expect, rtol=torch.finfo(dtype).eps, atol=torch.finfo(dtype).eps)
    assert torch.equal(state, x[:, -3:].transpose(1, 2))


def test_rmsnorm_gate():
    norm = RMSNorm(5, eps=1e-5).double()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(5))
    x, g = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    expect = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    assert_close64(norm(x), expect)
    assert_close64(norm(x, g), expect * g * torch.sigmoid(g))
    assert norm(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("bad, match", [
    ({"qk_norm": "l1"}, "qk_norm"), ({"qk_activation": "gelu"}, "qk_activation"),
    ({"expand_k": 0.3}, "expand_k"), ({"expand_v": 0.5}, "divisible by num_heads"),
    ({"conv_size": 0}, "conv_size"), ({"use_gate": 1}, "use_gate"),
], ids=["qk_norm", "qk_activation", "expand_k", "expand_v", "conv_size", "use_gate"])
def test_layer_refuses_bad_options(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        FlaDeltaNet(24, 3 if "expand_v" not in bad else 9, **bad)


def test_layer_refuses_foreign_state():
    m = layer()
    with pytest.raises(TypeError, match="conv_q, conv_k, conv_v, S"):
        m(torch.randn(1, 2, 24, dtype=torch.float64), (torch.zeros(1, 3, 8, 8),))


# ---------------------------------------------------------------------------------------------
# Config


@pytest.mark.parametrize("bad, match", [
    ({"attn": {"layers": [0], "num_heads": 2}}, "attn must be None"),
    ({"attnres_block_size": 2}, "attnres_block_size"),
    ({"hidden_act": "powlu"}, "hidden_act"),
    ({"attn_mode": "fused_chunk"}, "attn_mode"),
    ({"qk_norm": "none"}, "qk_norm"),
    ({"fuse_linear_cross_entropy": True}, "fuse_cross_entropy and fuse_linear_cross_entropy"),
    ({"pad_token_id": 99}, "pad_token_id"),
    ({"num_heads": 5}, "divisible by num_heads"),
], ids=["attn", "attnres", "powlu", "fused_chunk", "qk_norm", "fuse_ce", "pad", "heads"])
def test_config_refuses_unsupported_options_naming_them(bad, match):
    with pytest.raises(ValueError, match=match):
        FlaDeltaNetConfig(hidden_size=32, num_hidden_layers=1, vocab_size=V, **bad)


def test_config_defaults_are_flas_and_every_field_is_classified():
    import dataclasses

    assert {f.name for f in dataclasses.fields(FlaDeltaNetConfig)} == set(FLA_OPTIONS)
    c = FlaDeltaNetConfig.from_dict({"model_type": "delta_net", "hidden_size": 1024,
                                     "num_heads": 8})
    assert (c.vocab_size, c.num_hidden_layers, c.norm_eps, c.conv_size) == (32000, 24, 1e-6, 4)
    assert c.mlp_hidden_size() == 2816  # 256-multiple above int(1024 * 4 * 2 / 3) = 2730


def test_config_warns_about_foreign_keys_and_ignored_output_norm():
    with pytest.warns(UserWarning, match="norm_first"):
        FlaDeltaNetConfig.from_dict({"hidden_size": 32, "num_hidden_layers": 1,
                                     "norm_first": True, "transformers_version": "4.40"})
    with pytest.warns(UserWarning, match="use_output_norm"):
        FlaDeltaNetConfig(hidden_size=32, num_hidden_layers=1, use_output_norm=False)
    with pytest.raises(ValueError, match="model_type"):
        FlaDeltaNetConfig.from_dict({"model_type": "gla"})


def test_native_lm_parameter_names_are_flas():
    m = FlaDeltaNetLM(FlaDeltaNetConfig(hidden_size=16, num_heads=2, num_hidden_layers=1,
                                        vocab_size=V, use_gate=True))
    names = set(m.state_dict())
    assert {"model.embeddings.weight", "model.layers.0.attn_norm.weight",
            "model.layers.0.attn.q_conv1d.weight", "model.layers.0.attn.g_proj.weight",
            "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp_norm.weight",
            "model.norm.weight", "lm_head.weight"} <= names


# ---------------------------------------------------------------------------------------------
# transformers: from_fla, decoding, generate

transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")

from fastweights.hf import CACHE_FIELD  # noqa: E402  (needs transformers)

# One small fla-format folder per family: the tests below hold for each.
FAMILIES = {
    "delta_net": {"use_gate": True},
    "retnet": {"num_kv_heads": 1, "feature_map": "relu"},  # one key/value head for 3 queries
}


@pytest.fixture(params=list(FAMILIES))
def checkpoint(request, tmp_path):
    """An fla-format folder written by fastweights (untied, odd sizes), float64."""
    from fastweights.fla.hf import fla_model_class

    torch.manual_seed(0)
    cls = fla_model_class(request.param)
    cfg = cls.config_class(hidden_size=24, num_heads=3, num_hidden_layers=2, vocab_size=V,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2,
                           **FAMILIES[request.param])
    model = cls(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 if p.dim() > 1 else 1 + 0.3 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    return tmp_path


def load(folder, dtype=torch.float64):
    from fastweights.fla import from_fla

    return from_fla(folder, dtype=dtype)


def prompt(T: int, B: int = 1, seed: int = 3) -> torch.Tensor:
    return torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(seed))


def test_from_fla_reads_flas_folder_format(checkpoint):
    cfg = json.loads((checkpoint / "config.json").read_text())
    assert cfg["model_type"] in FAMILIES and cfg["num_heads"] == 3
    m = load(checkpoint)
    assert not m.training and m.dtype == torch.float64
    assert m.config.model_type == cfg["model_type"]
    native = type(m).native_class(m.config.to_native()).double()
    native.load_state_dict(m.state_dict())
    x = prompt(9, 2)
    assert_close64(m(x).logits, native(x)[0], what="wrapper == native model")


def test_decoding_from_the_cache_equals_full_forward(checkpoint):
    m = load(checkpoint)
    x = prompt(13, 2)
    with torch.no_grad():
        full = m(x, use_cache=False).logits
        out = m(x[:, :4])
        steps = [out.logits]
        for t in range(4, 13):
            out = m(x[:, t:t + 1], cache=out[CACHE_FIELD])
            steps.append(out.logits)
    assert_close64(torch.cat(steps, 1), full, what="decoding")
    assert out[CACHE_FIELD].get_seq_length() == 13


def test_generate_greedy_beam_and_sampling(checkpoint):
    m = load(checkpoint)
    x = prompt(6)
    greedy = m.generate(x, max_new_tokens=7, do_sample=False, pad_token_id=0)
    ids = x
    with torch.no_grad():
        for _ in range(7):
            ids = torch.cat([ids, m(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(greedy, ids)
    beam = m.generate(x, max_new_tokens=5, num_beams=3, do_sample=False, pad_token_id=0)
    beam_nocache = m.generate(x, max_new_tokens=5, num_beams=3, do_sample=False, pad_token_id=0,
                              use_cache=False)
    assert torch.equal(beam, beam_nocache)
    torch.manual_seed(5)
    s1 = m.generate(x, max_new_tokens=6, do_sample=True, top_k=10, pad_token_id=0)
    torch.manual_seed(5)
    s2 = m.generate(x, max_new_tokens=6, do_sample=True, top_k=10, pad_token_id=0)
    assert torch.equal(s1, s2) and s1.shape == (1, 12)


@pytest.mark.parametrize("setting", ["greedy", "beam", "dict"])
def test_generate_passes_only_declared_keywords(checkpoint, setting):
    from tests.helpers import GENERATE_SETTINGS, assert_generate_passes_declared_keywords

    batch = torch.cat([prompt(6, seed=1), torch.cat([torch.zeros(1, 2, dtype=torch.long),
                                                     prompt(4, seed=2)], 1)])
    assert_generate_passes_declared_keywords(load(checkpoint), batch, pad_token_id=0,
                                             attention_mask=(batch != 0).long(),
                                             **GENERATE_SETTINGS[setting])


def test_left_padded_batch_generates_like_single_rows(checkpoint):
    m = load(checkpoint)
    a, b = prompt(7, seed=1), prompt(4, seed=2)
    batch = torch.cat([a, torch.cat([torch.zeros(1, 3, dtype=torch.long), b], 1)])
    mask = (batch != 0).long()
    out = m.generate(batch, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    for row, p in zip(out, (a, b)):
        single = m.generate(p, max_new_tokens=5, do_sample=False, pad_token_id=0)[0]
        # a row that met eos (id 2) alone stops; in the batch it is continued with pads
        new, alone = row[7:], single[p.shape[1]:]
        assert torch.equal(new[:len(alone)], alone) and (new[len(alone):] == 0).all()
        assert len(alone) == 5 or alone[-1] == 2


def test_bfloat16_and_float32_loads_run(checkpoint):
    for dtype in (torch.float32, torch.bfloat16):
        m = load(checkpoint, dtype)
        assert m.dtype == dtype
        assert m.generate(prompt(5), max_new_tokens=3, do_sample=False, pad_token_id=0).shape == (1, 8)


def test_from_fla_refuses_bad_folders(tmp_path, checkpoint):
    with pytest.raises(ValueError, match="does not exist"):
        load(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no config.json"):
        load(tmp_path / "empty")
    cfg = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**cfg, "attn": {"layers": [0], "num_heads": 3}}))
    with pytest.raises(ValueError, match="attn must be None"):
        load(checkpoint)


def test_l2warp_training_is_refused(checkpoint):
    m = load(checkpoint)
    m.config.use_l2warp = True
    x = prompt(5)
    assert m(x).logits.shape == (1, 5, V)  # inference: no effect
    with pytest.raises(ValueError, match="use_l2warp"):
        m(x, labels=x)



def test_readme_example_runs(tmp_path, monkeypatch):
    """docs/integrations.md's "Released fla checkpoints on CPU" example, on a small fla-format folder with
    the released models' vocabulary."""
    from fastweights.fla.hf import FlaDeltaNetForCausalLM, FlaDeltaNetHFConfig
    from tests.test_readme import section_blocks

    (block,) = section_blocks("## Released fla checkpoints on CPU", "docs/integrations.md")
    cfg = FlaDeltaNetHFConfig(hidden_size=16, num_heads=2, num_hidden_layers=2, vocab_size=32000)
    FlaDeltaNetForCausalLM(cfg).save_pretrained(tmp_path / "checkpoints" / "delta_net")
    monkeypatch.chdir(tmp_path)
    scope = {"__name__": "__readme__"}
    exec(compile(block, "README.md", "exec"), scope)
    assert scope["greedy"].shape == scope["sampled"].shape == scope["beam"].shape == (1, 24)


def test_packed_documents_and_hidden_states_are_refused_right_padding_works(checkpoint):
    m = load(checkpoint)
    x = prompt(6)
    with pytest.raises(ValueError, match="packed documents"):
        m(x, cu_seqlens=torch.tensor([0, 2, 6]), use_cache=False)
    with pytest.raises(ValueError, match="output_hidden_states"):
        m(x, output_hidden_states=True)
    with pytest.raises(TypeError, match="foo"):
        m(x, foo=1)
    # a right-padded row equals its unpadded self (no cache in a training forward)
    ids = torch.cat([x, torch.cat([x[:, :4], torch.zeros(1, 2, dtype=torch.long)], 1)])
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    out = m(ids, attention_mask=mask, use_cache=False).logits
    assert torch.allclose(out[1, :4], m(x[:, :4]).logits[0], atol=1e-10)
    assert torch.allclose(out[0], m(x).logits[0], atol=1e-10)
