"""delta_rule_attn_norm (the delta rule with attention normalisation, the fast weight paper's
Table 3 ablation): the rescaled delta rule of "recurrent"/"chunk" against the literal loop."""

from __future__ import annotations

import pytest
import torch

from fastweights.ops import delta_rule_attn_norm, elu_plus_one, sum_norm
from fastweights.ops.linear_attn import LinearAttnState
from tests.helpers import assert_close64

SHAPES = [(2, 37, 3, 5, 7), (1, 1, 1, 4, 4), (1, 65, 2, 6, 6)]
IDS = [f"B{b}-T{t}-H{h}-Dk{dk}-Dv{dv}" for b, t, h, dk, dv in SHAPES]


def make(B, T, H, Dk, Dv, seed=0, dtype=torch.float64, normalise=True):
    g = torch.Generator().manual_seed(seed)
    q, k = (elu_plus_one(torch.randn(B, T, H, Dk, generator=g, dtype=dtype)) for _ in range(2))
    if normalise:
        q, k = sum_norm(q), sum_norm(k)
    v = torch.randn(B, T, H, Dv, generator=g, dtype=dtype)
    beta = torch.rand(B, T, H, generator=g, dtype=dtype)
    return q, k, v, beta


def state(B, H, Dk, Dv, seed=3):
    """A state this recurrence can reach: the one left by a random prefix."""
    q, k, v, beta = make(B, 9, H, Dk, Dv, seed=seed)
    return delta_rule_attn_norm(q, k, v, beta, output_final_state=True, mode="naive")[1]


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
@pytest.mark.parametrize("mode,chunk", [("recurrent", 64), ("chunk", 1), ("chunk", 8), ("chunk", 64)])
@pytest.mark.parametrize("carried", [False, True], ids=["fresh", "carried"])
def test_forms_agree_with_the_loop(shape, mode, chunk, carried):
    B, _, H, Dk, Dv = shape
    q, k, v, beta = make(*shape)
    init = state(B, H, Dk, Dv) if carried else None
    o0, (S0, z0) = delta_rule_attn_norm(q, k, v, beta, initial_state=init, output_final_state=True,
                                        mode="naive")
    o1, (S1, z1) = delta_rule_attn_norm(q, k, v, beta, initial_state=init, output_final_state=True,
                                        mode=mode, chunk_size=chunk)
    assert_close64(o1, o0)
    assert_close64(S1, S0)
    assert_close64(z1, z0)


def test_gradients_of_the_chunked_form_match_the_loop():
    q, k, v, beta = make(2, 21, 2, 4, 3, normalise=False)
    grads = []
    for mode in ("naive", "chunk"):
        inputs = [t.clone().requires_grad_() for t in (q, k, v, beta)]
        qs, ks = sum_norm(inputs[0]), sum_norm(inputs[1])
        o, (S, z) = delta_rule_attn_norm(qs, ks, inputs[2], inputs[3], output_final_state=True,
                                         mode=mode, chunk_size=8)
        (o.square().sum() + S.sum() + z.sum()).backward()
        grads.append([t.grad for t in inputs])
    for a, b in zip(*grads):
        assert_close64(b, a)


def test_pieces_equal_whole():
    q, k, v, beta = make(2, 30, 2, 4, 5)
    whole, final = delta_rule_attn_norm(q, k, v, beta, output_final_state=True, chunk_size=8)
    st, outs = None, []
    for a, b in ((0, 7), (7, 8), (8, 30)):
        o, st = delta_rule_attn_norm(q[:, a:b], k[:, a:b], v[:, a:b], beta[:, a:b], initial_state=st,
                                     output_final_state=True, chunk_size=8)
        outs.append(o)
    assert isinstance(st, LinearAttnState)
    assert_close64(torch.cat(outs, 1), whole)
    assert_close64(st.S, final.S)
    assert_close64(st.z, final.z)


def test_the_first_token_writes_without_erasing_and_beta_zero_keeps_the_memory():
    q, k, v, beta = make(1, 6, 1, 3, 2)
    _, (S, z) = delta_rule_attn_norm(q[:, :1], k[:, :1], v[:, :1], beta[:, :1], output_final_state=True,
                                     mode="chunk")
    assert_close64(z[0, 0], k[0, 0, 0])
    expect = beta[0, 0, 0] * k[0, 0, 0, :, None] * v[0, 0, 0, None, :]
    assert_close64(S[0, 0], expect)
    init = state(1, 1, 3, 2)
    o, (S, _) = delta_rule_attn_norm(q, k, v, torch.zeros_like(beta), initial_state=init,
                                     output_final_state=True)
    assert_close64(S, init.S)
    zt = init.z[:, None] + k.cumsum(1)
    assert_close64(o, torch.einsum("bthd,bhde->bthe", q, init.S) / ((q * zt).sum(-1, keepdim=True) + 1e-6))


def test_bad_arguments_name_themselves():
    q, k, v, beta = make(1, 4, 1, 3, 2)
    with pytest.raises(ValueError, match="beta"):
        delta_rule_attn_norm(q, k, v, beta[:, :2])
    with pytest.raises(ValueError, match="eps"):
        delta_rule_attn_norm(q, k, v, beta, eps=float("nan"))
    with pytest.raises(ValueError, match="mode"):
        delta_rule_attn_norm(q, k, v, beta, mode="fast")
