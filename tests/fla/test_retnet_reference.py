"""fastweights' fla RetNet equals fla's own model code, in float64, on the same checkpoint.

As for DeltaNet (test_deltanet_reference.py), the reference is fla 0.6's own RetNet model and
MultiScaleRetention layer code with each Triton kernel it calls replaced by a pure-PyTorch
reference: the retention by a float64 transcription of ``fla.ops.retention.naive``'s
``naive_retention`` extended with an initial and final state (checked against that function,
which computes in float32), the rotary embedding by ``fla.modules.rotary.ops.rotary_embedding_ref``
(fla's own cos/sin tables are kept), RMSNorm and the gated RMSNorm by
``fla.modules.norm.layernorm_gated.rms_norm_ref``, SwiGLU by its formula. Weights are drawn in
float32 and both models run in float64.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed")
with warnings.catch_warnings():  # fla warns that Triton has no CPU driver here
    warnings.simplefilter("ignore")
    pytest.importorskip("fla", reason="flash-linear-attention is not installed "
                                      "(pip install 'fastweights[dev]')")
    import fla.layers.multiscale_retention as fla_layer
    import fla.modules.rotary.ops as fla_rotary
    from fla.models import RetNetConfig
    from fla.modules.rotary.ops import rotary_embedding_ref
    from fla.ops.retention.naive import naive_retention

    from tests.fla import common as fla_common

from fastweights.fla import FLA_RETNET_OPTIONS
from fastweights.layers.fla_retnet import FEATURE_MAPS, retention_decay
from tests.helpers import assert_close64

V, T = 53, 70  # T > 64: fastweights' chunk form crosses a chunk border, fla takes its chunk mode


# ---------------------------------------------------------------------------------------------
# fla's kernels -> references


def retention_ref64(q, k, v, initial_state=None):
    """fla's ``naive_retention`` as a recurrence in the inputs' dtype, with a state: per head
    gamma_h = 1 - 2^(-5 - h) (computed in float32, as fla does), S_t = gamma S_{t-1} + k_t^T v_t,
    o_t = Dk^-0.5 q_t S_t. Layout [B, T, H, D]; returns (o, S [B, H, Dk, Dv])."""
    B, T_, H, Dk = q.shape
    gamma = (1 - torch.tensor(2.0).pow(-5.0 - torch.arange(H, dtype=torch.float32))).to(q.dtype)
    S = q.new_zeros(B, H, Dk, v.shape[-1]) if initial_state is None else initial_state.to(q.dtype)
    o = torch.empty_like(v)
    for t in range(T_):
        S = gamma.view(1, H, 1, 1) * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        o[:, t] = torch.einsum("bhd,bhde->bhe", q[:, t] * Dk ** -0.5, S)
    return o, S


def fla_retention_ref(q, k, v, scale=None, initial_state=None, output_final_state=False,
                      cu_seqlens=None, **kwargs):
    """Stand-in for fla's chunk/fused_chunk/fused_recurrent/parallel_retention."""
    assert scale is None and cu_seqlens is None and not kwargs.get("reverse")
    o, S = retention_ref64(q, k, v, initial_state)
    return o, (S if output_final_state else None)


def rotary_ref(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
               chunk_indices=None):
    assert isinstance(seqlen_offsets, int) and cu_seqlens is None
    T_ = x.shape[1]
    return rotary_embedding_ref(x, cos[seqlen_offsets:seqlen_offsets + T_],
                                sin[seqlen_offsets:seqlen_offsets + T_], interleaved)


@pytest.fixture
def fla_on_pytorch(monkeypatch):
    """fla's RetNet code with every kernel it calls replaced by a PyTorch reference."""
    for name in ("chunk_retention", "fused_chunk_retention", "fused_recurrent_retention",
                 "parallel_retention"):
        monkeypatch.setattr(fla_layer, name, fla_retention_ref)
    monkeypatch.setattr(fla_rotary, "rotary_embedding", rotary_ref)
    fla_common.patch_norms_and_mlp(monkeypatch)


def test_float64_retention_reference_is_flas_naive_retention():
    g = torch.Generator().manual_seed(0)
    b, h, t, dk, dv = 2, 3, 11, 6, 5
    q, k, v = (torch.randn(b, h, t, d, generator=g) for d in (dk, dk, dv))
    o32 = naive_retention(q, k, v)  # [b, h, t, dv], float32

    def tr(x):
        return x.transpose(1, 2).double()

    o64, _ = retention_ref64(tr(q), tr(k), tr(v))
    assert_close64(o64.transpose(1, 2), o32.double(), atol=1e-5, what="o")


def test_decays_are_flas():
    """fla's kernels take g_gamma = log(1 - 2^(-5 - h)) in float32: heads from 20 on have
    gamma = 1 there (float32 rounding), as here."""
    H = 24
    fla_gamma = (1 - 2.0 ** (-5.0 - torch.arange(H, dtype=torch.float))).log().exp()
    gamma = retention_decay(H)
    assert gamma.dtype == torch.float32
    assert torch.equal(gamma, 1 - 2.0 ** (-5.0 - torch.arange(H, dtype=torch.float)))
    assert_close64(gamma.double(), fla_gamma.double(), atol=1e-7, what="gamma")
    assert (gamma[20:] == 1).all() and (gamma[:20] < 1).all()


def test_feature_maps_are_transformers_activations():
    from transformers.activations import ACT2FN

    x = torch.linspace(-6, 6, 97, dtype=torch.float64)
    for name, fn in FEATURE_MAPS.items():
        assert_close64(fn(x), ACT2FN[name](x), atol=1e-15, what=name)


# ---------------------------------------------------------------------------------------------
# Checkpoints made by fla


CONFIGS = {
    "base": {},
    "heads1": {"num_heads": 1},
    "gqa-4q-2kv": {"num_kv_heads": 2},
    "mqa-expand-k0.5-v1": {"num_kv_heads": 1, "expand_k": 0.5, "expand_v": 1.0},
    "no-gate": {"use_output_gate": False},
    "unfused-norm-mlp": {"fuse_norm": False, "fuse_swiglu": False, "intermediate_size": 40},
    "no-affine-unfused": {"elementwise_affine": False, "fuse_norm": False},
    "no-affine-tied": {"elementwise_affine": False, "tie_word_embeddings": True},
    "relu-map": {"feature_map": "relu"},
    "silu-map-gqa": {"feature_map": "swish", "num_kv_heads": 2, "use_output_gate": False},
    "heads24": {"hidden_size": 48, "num_heads": 24},
}


FAMILY = fla_common.Family(RetNetConfig, V, T)
fla_config, make_fla_checkpoint, ids = FAMILY.config, FAMILY.checkpoint, FAMILY.ids


@pytest.mark.parametrize("overrides", CONFIGS.values(), ids=CONFIGS.keys())
def test_float64_logits_equal_flas_model(tmp_path, fla_on_pytorch, overrides):
    ref = make_fla_checkpoint(tmp_path, **overrides)
    ours = fla_common.assert_float64_logits_equal(ref, tmp_path, ids())
    assert type(ours).__name__ == "FlaRetNetForCausalLM"


@pytest.mark.parametrize("overrides", [CONFIGS["base"], CONFIGS["gqa-4q-2kv"]],
                         ids=["base", "gqa-4q-2kv"])
def test_float32_logits_match_flas_model_with_its_float32_naive_retention(
        tmp_path, fla_on_pytorch, monkeypatch, overrides):
    """The same comparison with fla's own naive function (float32) in place of the transcription."""
    def naive(q, k, v, scale=None, initial_state=None, output_final_state=False, **kwargs):
        assert initial_state is None and not output_final_state
        return naive_retention(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2), None

    for name in ("chunk_retention", "fused_recurrent_retention"):
        monkeypatch.setattr(fla_layer, name, naive)
    ref = make_fla_checkpoint(tmp_path, **overrides)
    fla_common.assert_float32_logits_match(ref, tmp_path, ids())


@pytest.mark.parametrize("overrides", [CONFIGS["base"], CONFIGS["gqa-4q-2kv"],
                                       CONFIGS["no-affine-unfused"]],
                         ids=["base", "gqa-4q-2kv", "no-affine-unfused"])
def test_decoding_from_the_cache_equals_flas_full_forward(tmp_path, fla_on_pytorch, overrides):
    ref = make_fla_checkpoint(tmp_path, **overrides)
    fla_common.assert_decoding_equals_full_forward(ref, tmp_path, ids(length=12))


def test_sharded_bfloat16_tied_checkpoint_loads_unchanged(tmp_path):
    ref = make_fla_checkpoint(tmp_path, dtype=torch.bfloat16, max_shard_size="20KB",
                              tie_word_embeddings=True, num_kv_heads=2)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    fla_common.assert_loads_unchanged(ref, tmp_path, torch.bfloat16)


def test_every_retnet_config_option_is_classified():
    fla_common.assert_every_option_classified(RetNetConfig, FLA_RETNET_OPTIONS)


def test_our_save_pretrained_is_an_fla_checkpoint(tmp_path, fla_on_pytorch):
    """A folder written by fastweights loads in fla with the same logits."""
    make_fla_checkpoint(tmp_path / "a", num_kv_heads=2)
    fla_common.assert_fla_reads_our_save(tmp_path / "a", tmp_path / "b", ids())
