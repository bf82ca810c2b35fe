"""softmax_attention against an explicit softmax."""

from __future__ import annotations

import pytest
import torch

from fastweights.ops import softmax_attention
from tests.helpers import assert_close64


def explicit(q, k, v, causal, scale):
    s = torch.einsum("bthd,bshd->bhts", q, k) * scale
    if causal:
        Tq, Tk = q.shape[1], k.shape[1]
        mask = torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq)
        s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("bhts,bshe->bthe", s.softmax(-1), v)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("Tq,Tk", [(9, 9), (1, 9), (4, 9)])
def test_softmax_attention(causal, Tq, Tk):
    q = torch.randn(2, Tq, 3, 5, dtype=torch.float64)
    k = torch.randn(2, Tk, 3, 5, dtype=torch.float64)
    v = torch.randn(2, Tk, 3, 7, dtype=torch.float64)
    assert_close64(softmax_attention(q, k, v, causal=causal), explicit(q, k, v, causal, 5 ** -0.5))
    assert_close64(softmax_attention(q, k, v, causal=causal, scale=1.0), explicit(q, k, v, causal, 1.0))
