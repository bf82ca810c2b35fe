"""fastweights' fla DeltaNet equals fla's own model code, in float64, on the same checkpoint.

fla's kernels are Triton only (its forward fails on a CPU-only machine), so the reference is
fla 0.6's own model and layer code with each kernel it calls replaced by a pure-PyTorch
reference: the delta rule by a float64 transcription of ``fla.ops.delta_rule.naive``'s
recurrence (itself checked against that function, which computes in float32), RMSNorm and the
gated RMSNorm by ``fla.modules.norm.layernorm_gated.rms_norm_ref``, the short convolution by a
plain causal depthwise ``conv1d``, SwiGLU and ELU+1 by their formulas. Weights are drawn in
float32 (``rms_norm_ref`` rounds weights to float32) and both models run in float64.
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
    import fla.layers.delta_net as fla_layer
    from fla.models import DeltaNetConfig
    from fla.modules import ShortConvolution
    from fla.ops.delta_rule.naive import delta_rule_recurrence

    from tests.fla import common as fla_common

from fastweights.fla import FLA_OPTIONS
from tests.helpers import assert_close64

V, T = 53, 37  # T > 32 (fastweights' CPU chunk) and > 64 is not needed: fla's modes are patched


# ---------------------------------------------------------------------------------------------
# fla's kernels -> references


def delta_rule_ref64(q, k, v, beta, initial_state=None):
    """fla's naive ``delta_rule_recurrence`` written out in the inputs' dtype (fla's function
    casts to float32). Layout [b, h, t, d]; q scaled by d_k ** -0.5; returns (o, S)."""
    b, h, t, d_k = q.shape
    S = q.new_zeros(b, h, d_k, v.shape[-1])
    if initial_state is not None:
        S = S + initial_state
    q = q * d_k ** -0.5
    o = torch.zeros_like(v)
    for i in range(t):
        k_i, v_i = k[:, :, i], v[:, :, i]
        u = (v_i - (S * k_i[..., None]).sum(-2)) * beta[:, :, i, None]
        S = S + k_i[..., None] * u[..., None, :]
        o[:, :, i] = torch.einsum("bhd,bhdm->bhm", q[:, :, i], S)
    return o, S


def l2norm_ref(x, eps=1e-6):
    """fla's L2-norm kernel: x / sqrt(sum x^2 + eps) over the last dim."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def fla_delta_rule_ref(q, k, v, beta, scale=None, initial_state=None, output_final_state=False,
                       use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    """Stand-in for fla's chunk/fused_recurrent_delta_rule ([B, T, H, D] layout)."""
    assert scale is None and cu_seqlens is None and not kwargs
    if use_qk_l2norm_in_kernel:
        q, k = l2norm_ref(q), l2norm_ref(k)
    def tr(x):
        return x.transpose(1, 2)  # [B, T, H, ...] <-> [B, H, T, ...]
    o, S = delta_rule_ref64(tr(q), tr(k), tr(v), tr(beta), initial_state)
    return tr(o), (S if output_final_state else None)


def short_conv_ref(self, x, residual=None, mask=None, cache=None, output_final_state=False,
                   cu_seqlens=None, **kwargs):
    assert residual is None and mask is None and cache is None and cu_seqlens is None
    W = self.kernel_size[0]
    y = F.conv1d(x.transpose(1, 2), self.weight, self.bias, padding=W - 1,
                 groups=self.hidden_size)[..., :x.shape[1]].transpose(1, 2)
    return (F.silu(y) if self.activation is not None else y), None


@pytest.fixture
def fla_on_pytorch(monkeypatch):
    """fla's model code with every kernel it calls replaced by a PyTorch reference."""
    monkeypatch.setattr(fla_layer, "chunk_delta_rule", fla_delta_rule_ref)
    monkeypatch.setattr(fla_layer, "fused_recurrent_delta_rule", fla_delta_rule_ref)
    monkeypatch.setattr(fla_layer, "elu_p1", lambda x: torch.where(x >= 0, x + 1, torch.exp(x)))
    monkeypatch.setattr(ShortConvolution, "forward", short_conv_ref)
    fla_common.patch_norms_and_mlp(monkeypatch)


def test_float64_delta_rule_reference_is_flas_naive_recurrence():
    g = torch.Generator().manual_seed(0)
    b, h, t, dk, dv = 2, 3, 11, 5, 7
    q, k = torch.randn(b, h, t, dk, generator=g), F.normalize(torch.randn(b, h, t, dk, generator=g), dim=-1)
    v, beta = torch.randn(b, h, t, dv, generator=g), torch.rand(b, h, t, generator=g)
    S0 = torch.randn(b, h, dk, dv, generator=g)
    o32, S32 = delta_rule_recurrence(q, k, v, beta, S0.clone(), output_final_state=True)
    o64, S64 = delta_rule_ref64(q.double(), k.double(), v.double(), beta.double(), S0.double())
    assert_close64(o64, o32.double(), atol=1e-5, what="o")
    assert_close64(S64, S32.double(), atol=1e-5, what="S")


# ---------------------------------------------------------------------------------------------
# Checkpoints made by fla


CONFIGS = {
    "base": {},
    "no-conv": {"use_short_conv": False},
    "sum-norm": {"qk_norm": "sum"},
    "relu-sum": {"qk_activation": "relu", "qk_norm": "sum"},
    "elu-l2": {"qk_activation": "elu"},
    "identity-l2": {"qk_activation": "identity"},
    "identity-sum-no-conv": {"qk_activation": "identity", "qk_norm": "sum", "use_short_conv": False},
    "heads1": {"num_heads": 1},
    "tied": {"tie_word_embeddings": True},
    "gate": {"use_gate": True},
    "gate-tied-heads1": {"use_gate": True, "tie_word_embeddings": True, "num_heads": 1},
    "no-beta-negeig": {"use_beta": False, "allow_neg_eigval": True},
    "negeig-conv3": {"allow_neg_eigval": True, "conv_size": 3},
    "expand-k0.5-v2": {"expand_k": 0.5, "expand_v": 2.0},
    "unfused-norm-mlp": {"fuse_norm": False, "fuse_swiglu": False, "intermediate_size": 40},
}


FAMILY = fla_common.Family(DeltaNetConfig, V, T)
fla_config, make_fla_checkpoint, ids = FAMILY.config, FAMILY.checkpoint, FAMILY.ids


@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_float64_logits_equal_flas_model(tmp_path, fla_on_pytorch, overrides):
    ref = make_fla_checkpoint(tmp_path, **overrides)
    fla_common.assert_float64_logits_equal(ref, tmp_path, ids())


@pytest.mark.parametrize("overrides", [CONFIGS["base"], CONFIGS["gate-tied-heads1"]],
                         ids=["base", "gate-tied-heads1"])
def test_float32_logits_match_flas_model_with_its_float32_naive_recurrence(
        tmp_path, fla_on_pytorch, monkeypatch, overrides):
    """The same comparison with fla's own naive function (float32) in place of the transcription."""
    def naive(q, k, v, beta, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, **kwargs):
        if use_qk_l2norm_in_kernel:
            q, k = l2norm_ref(q), l2norm_ref(k)
        def tr(x):
            return x.transpose(1, 2)
        o, S = delta_rule_recurrence(tr(q), tr(k), tr(v), tr(beta), initial_state, output_final_state)
        return tr(o), S

    monkeypatch.setattr(fla_layer, "chunk_delta_rule", naive)
    monkeypatch.setattr(fla_layer, "fused_recurrent_delta_rule", naive)
    ref = make_fla_checkpoint(tmp_path, **overrides)
    fla_common.assert_float32_logits_match(ref, tmp_path, ids())


@pytest.mark.parametrize("overrides", [CONFIGS["base"], CONFIGS["no-conv"], CONFIGS["gate"]],
                         ids=["base", "no-conv", "gate"])
def test_decoding_from_the_cache_equals_flas_full_forward(tmp_path, fla_on_pytorch, overrides):
    ref = make_fla_checkpoint(tmp_path, **overrides)
    fla_common.assert_decoding_equals_full_forward(ref, tmp_path, ids(length=12))


def test_sharded_bfloat16_tied_checkpoint_loads_unchanged(tmp_path):
    ref = make_fla_checkpoint(tmp_path, dtype=torch.bfloat16, max_shard_size="20KB",
                              tie_word_embeddings=True, use_gate=True)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    fla_common.assert_loads_unchanged(ref, tmp_path, torch.bfloat16)


def test_every_deltanet_config_option_is_classified():
    fla_common.assert_every_option_classified(DeltaNetConfig, FLA_OPTIONS)


def test_our_save_pretrained_is_an_fla_checkpoint(tmp_path, fla_on_pytorch):
    """A folder written by fastweights loads in fla with the same logits."""
    make_fla_checkpoint(tmp_path / "a", use_gate=True)
    fla_common.assert_fla_reads_our_save(tmp_path / "a", tmp_path / "b", ids())
