"""fastweights' fla GatedDeltaNet equals fla's own model code, in float64, on the same checkpoint.

As for DeltaNet (test_deltanet_reference.py): fla 0.6's ``GatedDeltaNetForCausalLM`` and its
``GatedDeltaNet`` layer code run with each Triton kernel they call replaced by a PyTorch
reference: the gated delta rule (with its in-kernel L2 norm, beta sigmoid, negative
eigenvalues, gate ``-exp(A_log) softplus(a + dt_bias)``, grouped value heads and V-first state
layout) by a float64 transcription of ``fla.ops.gated_delta_rule.naive``'s recurrence (checked
against that function, which computes in float32), the short convolutions (fused q/k/v or
separate) by a plain causal depthwise ``conv1d``, the norms and SwiGLU as in tests/fla/common.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed")
with warnings.catch_warnings():  # fla warns that Triton has no CPU driver here
    warnings.simplefilter("ignore")
    fla = pytest.importorskip("fla", reason="flash-linear-attention is not installed "
                                            "(pip install 'fastweights[dev]')")
    import fla.layers.gated_deltanet as fla_layer
    from fla.models import GatedDeltaNetConfig
    from fla.modules import ShortConvolution
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

    from tests.fla import common as fla_common

from fastweights.fla import FLA_GATED_DELTANET_OPTIONS, FlaGatedDeltaNetConfig, from_fla
from tests.helpers import assert_close64

V, T = 53, 37  # T > 32, fastweights' CPU chunk


def gated_delta_ref64(q, k, v, beta, g, scale, initial_state=None):
    """fla's ``naive_recurrent_gated_delta_rule`` written out in the inputs' dtype (fla's
    function casts to float32). Layout [B, T, H, D], heads already expanded; returns (o, S)."""
    B, T_, H, K = k.shape
    S = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.clone()
    o = torch.zeros_like(v)
    for i in range(T_):
        S = S * g[:, i].exp()[..., None, None]
        u = (v[:, i] - (S * k[:, i, ..., None]).sum(-2)) * beta[:, i, :, None]
        S = S + k[:, i, ..., None] * u[..., None, :]
        o[:, i] = torch.einsum("bhd,bhdm->bhm", q[:, i] * scale, S)
    return o, S


def fla_gated_delta_rule_ref(q, k, v, g, beta, scale=None, initial_state=None,
                             output_final_state=False, use_qk_l2norm_in_kernel=False,
                             use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False,
                             state_v_first=False, cu_seqlens=None, use_gate_in_kernel=False,
                             A_log=None, dt_bias=None, **kwargs):
    """Stand-in for fla's chunk/fused_recurrent_gated_delta_rule, every option the layer uses."""
    assert cu_seqlens is None and not kwargs
    if use_gate_in_kernel:  # fla's naive_gdn_gate, in the inputs' dtype
        g = -A_log.to(g.dtype).exp() * F.softplus(g + dt_bias.to(g.dtype))
    if use_beta_sigmoid_in_kernel:
        beta = beta.sigmoid() * (2.0 if allow_neg_eigval else 1.0)
    if use_qk_l2norm_in_kernel:
        q, k = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    rep = v.shape[2] // q.shape[2]  # GVA: value head i_hv reads key head i_hv // rep
    q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    if initial_state is not None and state_v_first:
        initial_state = initial_state.transpose(-1, -2)
    o, S = gated_delta_ref64(q, k, v, beta, g, q.shape[-1] ** -0.5 if scale is None else scale,
                             initial_state)
    if state_v_first:
        S = S.transpose(-1, -2)
    return o, (S if output_final_state else None)


def _conv(x, weight, bias, activation):
    W = weight.shape[-1]
    y = F.conv1d(x.transpose(1, 2), weight.view(weight.shape[0], 1, W), bias, padding=W - 1,
                 groups=weight.shape[0])[..., :x.shape[1]].transpose(1, 2)
    return F.silu(y) if activation in ("silu", "swish") else y


def short_conv_ref(self, x, residual=None, mask=None, cache=None, output_final_state=False,
                   cu_seqlens=None, **kwargs):
    assert residual is None and mask is None and cache is None and cu_seqlens is None
    return _conv(x, self.weight, self.bias, self.activation), None


def fused_conv_ref(x, weight=None, bias=None, activation=None, backend=None, **kwargs):
    """fla's causal_conv1d as the layer's fused q/k/v path calls it (no state)."""
    return _conv(x, weight, bias, activation), None


@pytest.fixture
def fla_on_pytorch(monkeypatch):
    """fla's model code with every kernel it calls replaced by a PyTorch reference."""
    monkeypatch.setattr(fla_layer, "chunk_gated_delta_rule", fla_gated_delta_rule_ref)
    monkeypatch.setattr(fla_layer, "fused_recurrent_gated_delta_rule", fla_gated_delta_rule_ref)
    monkeypatch.setattr(fla_layer, "causal_conv1d", fused_conv_ref)
    monkeypatch.setattr(ShortConvolution, "forward", short_conv_ref)
    fla_common.patch_norms_and_mlp(monkeypatch)


def test_float64_gated_delta_reference_is_flas_naive_recurrence():
    gen = torch.Generator().manual_seed(0)
    B, T_, H, K, Vd = 2, 11, 3, 5, 7
    q, v = torch.randn(B, T_, H, K, generator=gen), torch.randn(B, T_, H, Vd, generator=gen)
    k = F.normalize(torch.randn(B, T_, H, K, generator=gen), dim=-1)
    beta, g = torch.rand(B, T_, H, generator=gen), -torch.rand(B, T_, H, generator=gen)
    S0 = torch.randn(B, H, K, Vd, generator=gen)
    o32, S32 = naive_recurrent_gated_delta_rule(q, k, v, beta, g, initial_state=S0.clone(),
                                                output_final_state=True)
    o64, S64 = gated_delta_ref64(*(x.double() for x in (q, k, v, beta, g)), K ** -0.5, S0.double())
    assert_close64(o64, o32.double(), atol=1e-5, what="o")
    assert_close64(S64, S32.double(), atol=1e-5, what="S")


CONFIGS = {
    "base": {},
    "grouped-heads": {"num_v_heads": 4, "expand_v": 1.0},
    "no-gate": {"use_gate": False},
    "sigmoid-gate-negeig": {"output_gate_activation": "sigmoid", "allow_neg_eigval": True},
    "no-conv": {"use_short_conv": False},
    "conv2-tied": {"conv_size": 2, "tie_word_embeddings": True},
    "unfused-norm-mlp": {"fuse_norm": False, "fuse_swiglu": False, "intermediate_size": 40},
}


FAMILY = fla_common.Family(GatedDeltaNetConfig, V, T, num_heads=2, head_dim=8)
fla_config, make_fla_checkpoint, ids = FAMILY.config, FAMILY.checkpoint, FAMILY.ids


@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_float64_logits_equal_flas_model(tmp_path, fla_on_pytorch, overrides):
    fla_common.assert_float64_logits_equal(make_fla_checkpoint(tmp_path, **overrides), tmp_path,
                                           ids())


@pytest.mark.parametrize("overrides", [CONFIGS["base"], CONFIGS["grouped-heads"]],
                         ids=["base", "grouped-heads"])
def test_decoding_from_the_cache_equals_flas_full_forward(tmp_path, fla_on_pytorch, overrides):
    ref = make_fla_checkpoint(tmp_path, **overrides)
    fla_common.assert_decoding_equals_full_forward(ref, tmp_path, ids(length=12))


def test_generate_greedy_equals_flas_full_forward_argmax(tmp_path, fla_on_pytorch):
    ref = make_fla_checkpoint(tmp_path, num_v_heads=4, expand_v=1.0).double()
    ours = from_fla(tmp_path, dtype=torch.float64)
    x = ids(length=6)
    out = ours.generate(x, max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = x
    with torch.no_grad():
        for _ in range(6):
            nxt = ref(expected, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            expected = torch.cat([expected, nxt], dim=1)
    assert torch.equal(out, expected)


def test_sharded_bfloat16_tied_checkpoint_loads_unchanged(tmp_path):
    ref = make_fla_checkpoint(tmp_path, dtype=torch.bfloat16, max_shard_size="20KB",
                              tie_word_embeddings=True, num_v_heads=4)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    fla_common.assert_loads_unchanged(ref, tmp_path, torch.bfloat16)


def test_every_gated_deltanet_config_option_is_classified():
    fla_common.assert_every_option_classified(GatedDeltaNetConfig, FLA_GATED_DELTANET_OPTIONS)


def test_our_save_pretrained_is_an_fla_checkpoint(tmp_path, fla_on_pytorch):
    make_fla_checkpoint(tmp_path / "a", num_v_heads=4)
    fla_common.assert_fla_reads_our_save(tmp_path / "a", tmp_path / "b", ids())


@pytest.mark.parametrize(("overrides", "match"), [
    ({"num_v_heads": 3}, "num_v_heads"),
    ({"attn_mode": "fused_chunk"}, "attn_mode"),
    ({"attn": {"layers": [0], "num_heads": 2}}, "attn"),
    ({"output_gate_activation": "relu"}, "gate_activation"),
    ({"expand_v": 0.3}, "expand_v"),
])
def test_refused_options_name_the_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        FlaGatedDeltaNetConfig(**{"hidden_size": 32, "num_heads": 2, "head_dim": 8, **overrides})
