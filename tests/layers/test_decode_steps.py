"""The one-token steps that NormAttention, DiagAttention, InfiniAttention and AFT-local serve by
their own lean path (``layers.base.is_step``): token by token they give the whole sequence's
outputs and gradients (input and every parameter), in float64."""

from __future__ import annotations

import pytest
import torch

from fastweights import build_mixer
from fastweights.layers.base import is_step
from tests.helpers import assert_close64, steps_from

CASES = {
    "norm": {}, "norm-decay": {"decay": True, "decay_scale": 0.5},
    "diag": {"block_size": 3}, "diag-relu": {"block_size": 3, "kernel": "relu"},
    "infini": {"segment_len": 3}, "infini-delta": {"segment_len": 3, "update": "delta"},
    "aft-local": {"window": 3, "max_len": 16},
}


def _layer(case: str) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = build_mixer(case.split("-")[0] if case != "aft-local" else case, 12, 2,
                        **CASES[case]).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return layer


@pytest.mark.parametrize("case", list(CASES))
def test_steps_give_the_whole_sequence_outputs_and_gradients(case):
    layer = _layer(case)
    x = torch.randn(2, 7, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    w = torch.randn(2, 7, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def grads(run):
        xg = x.clone().requires_grad_()
        y = run(xg)
        params = list(layer.parameters())
        return y, torch.autograd.grad((y * w).sum(), [xg, *params])

    y_whole, g_whole = grads(lambda xg: layer(xg)[0])
    y_steps, g_steps = grads(lambda xg: steps_from(layer, xg)[0])
    assert_close64(y_steps, y_whole, atol=1e-9, what="outputs")
    for i, (a, b) in enumerate(zip(g_steps, g_whole)):
        assert_close64(a, b, atol=1e-8, what=f"gradient {i}")


def test_is_step():
    x = torch.zeros(2, 1, 4)
    assert is_step(x, None)
    assert not is_step(torch.zeros(2, 3, 4), None)
    assert not is_step(torch.zeros(1, 1, 4), torch.tensor([0, 1]))
    assert not is_step(torch.zeros(1, 4), None) and not is_step([0.0], None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not is_step(x, None)
