"""The one RMSNorm (layers/norms.py): the maths in float64, the gate's activations, the gain-free
form, one rounding in half precision, and the parameter name every checkpoint uses."""

from __future__ import annotations

import pytest
import torch

from fastweights.layers import GatedDeltaNet, RMSNorm
from fastweights.models import LanguageModel, LMConfig
from tests.helpers import assert_close64


def _norm(**options) -> RMSNorm:
    norm = RMSNorm(7, 1e-5, **options).double()
    if norm.weight is not None:
        with torch.no_grad():
            norm.weight.copy_(torch.randn(7, generator=torch.Generator().manual_seed(0)))
    return norm


def _xg() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(3, 4, 7, generator=g, dtype=torch.float64),
            torch.randn(3, 4, 7, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("activation", ["swish", "silu", "sigmoid"])
def test_rmsnorm_and_its_gate_in_float64(activation):
    norm = _norm(gate_activation=activation)
    x, gate = _xg()
    plain = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    act = torch.sigmoid(gate) if activation == "sigmoid" else gate * torch.sigmoid(gate)
    assert_close64(norm(x), plain)
    assert_close64(norm(x, gate), plain * act)


def test_without_gain():
    norm = _norm(elementwise_affine=False)
    assert list(norm.parameters()) == [] and "weight" not in norm.state_dict()
    x, _ = _xg()
    assert_close64(norm(x), x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rounds_once(dtype):
    """Computed in float32, gain and gate included, and rounded to x's dtype once: a bfloat16
    model's norms equal the float32 computation on the same (half) inputs, rounded."""
    norm = _norm().to(dtype)
    x, gate = (t.to(dtype) for t in _xg())
    want = norm.float()(x.float(), gate.float()).to(dtype)
    got = norm.to(dtype)(x, gate)
    assert got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize(("bad", "match"), [({"dim": 0}, "dim"), ({"eps": 0.0}, "eps"),
                                           ({"gate_activation": "relu"}, "gate_activation")])
def test_bad_options(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        RMSNorm(**{"dim": 4, "eps": 1e-6, **bad})


def test_every_user_keeps_the_parameter_name_weight():
    """The language model's norms, the gated-delta layer's output norm (fla's ``o_norm``) and
    fla's models all hold one ``weight`` per norm: checkpoints load unchanged."""
    lm = LanguageModel(LMConfig(vocab_size=11, d_model=8, n_layers=1, n_heads=2))
    assert {"blocks.0.norm1.weight", "blocks.0.norm2.weight", "norm.weight"} <= set(lm.state_dict())
    assert isinstance(lm.norm, RMSNorm)
    layer = GatedDeltaNet(8, 2, gate_activation="sigmoid")
    assert isinstance(layer.o_norm, RMSNorm) and layer.o_norm.gate_activation == "sigmoid"
    assert "o_norm.weight" in layer.state_dict()
