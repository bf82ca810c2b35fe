"""Bad arguments to the fast-weight ops raise clear errors naming the argument."""

from __future__ import annotations

import pytest
import torch

from fastweights.ops import (
    delta_rule,
    dpfp,
    draw_favor_projection,
    favor_features,
    linear_attn,
    softmax_attention,
)

q = torch.randn(2, 5, 3, 4)
v = torch.randn(2, 5, 3, 6)
beta = torch.rand(2, 5, 3)

CASES = [
    ("q rank", lambda: linear_attn(q[0], q[0], v[0]), ValueError, "q must be a 4-D"),
    ("k shape", lambda: linear_attn(q, q[:, :4], v), ValueError, "k must have the same shape"),
    ("v shape", lambda: linear_attn(q, q, v[:1]), ValueError, "v must have shape"),
    ("dtype mix", lambda: linear_attn(q, q.double(), v), TypeError, "dtype"),
    ("int tensor", lambda: linear_attn(q.long(), q.long(), v.long()), TypeError, "floating-point"),
    ("not tensor", lambda: linear_attn([1.0], q, v), TypeError, "q must be a torch.Tensor"),
    ("mode", lambda: linear_attn(q, q, v, mode="fast"), ValueError, "mode must be one of"),
    ("chunk 0", lambda: linear_attn(q, q, v, chunk_size=0), ValueError, "chunk_size must be >= 1"),
    ("chunk float", lambda: linear_attn(q, q, v, chunk_size=2.5), TypeError, "chunk_size"),
    ("eps negative", lambda: linear_attn(q, q, v, eps=-1.0), ValueError, "eps"),
    ("state shape", lambda: linear_attn(q, q, v, initial_state=(torch.zeros(2, 3, 4, 5), torch.zeros(2, 3, 4))), ValueError, "initial_state[0]"),
    ("state type", lambda: linear_attn(q, q, v, initial_state=torch.zeros(2, 3, 4, 6)), TypeError, "initial_state"),
    ("beta shape", lambda: delta_rule(q, q, v, beta[..., :2]), ValueError, "beta must have shape"),
    ("beta rank", lambda: delta_rule(q, q, v, beta[..., None]), ValueError, "beta must have shape"),
    ("delta state", lambda: delta_rule(q, q, v, beta, initial_state=torch.zeros(2, 3, 6, 4)), ValueError, "initial_state"),
    ("delta mode", lambda: delta_rule(q, q, v, beta, mode="parallel"), ValueError, "mode"),
    ("nu 0", lambda: dpfp(q, 0), ValueError, "nu must be >= 1"),
    ("nu float", lambda: dpfp(q, 1.5), TypeError, "nu"),
    ("favor proj", lambda: favor_features(q, torch.randn(8, 5)), ValueError, "projection"),
    ("favor m", lambda: draw_favor_projection(0, 4), ValueError, "m must be >= 1"),
    ("softmax k", lambda: softmax_attention(q, q[..., :2], v), ValueError, "k must have shape"),
    ("softmax causal Tq>Tk", lambda: softmax_attention(q, q[:, :2], v[:, :2]), ValueError, "Tq <= Tk"),
]


@pytest.mark.parametrize("call,exc,words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    assert words in str(info.value)
