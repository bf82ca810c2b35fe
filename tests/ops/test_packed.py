"""Packed variable-length sequences (cu_seqlens): packed == each document on its own, for every
state-carrying op, with per-document initial and final states."""

from __future__ import annotations

import pytest
import torch

from fastweights.ops import (
    decay_linear_attn,
    delta_rule,
    infini_attention,
    linear_attn,
    sum_norm,
    ttt_linear,
    ttt_mlp,
)
from fastweights.ops.aft import aft, aft_conv, aft_local
from tests.helpers import assert_close64

CU = torch.tensor([0, 5, 6, 17, 23])
BOUNDS = [(0, 5), (5, 6), (6, 17), (17, 23)]
T, H, D = 23, 2, 4
g = torch.Generator().manual_seed(0)
Q, K, V = (torch.rand(1, T, H, D, generator=g, dtype=torch.float64) for _ in range(3))
BETA = torch.rand(1, T, H, generator=g, dtype=torch.float64)
X3 = torch.randn(1, T, H * D, generator=g, dtype=torch.float64)


def _ttt_init(kind):
    if kind == "linear":
        return (0.1 * torch.randn(1, H, D, D, generator=g, dtype=torch.float64),
                torch.zeros(1, H, D, dtype=torch.float64))
    return (0.1 * torch.randn(1, H, D, 4 * D, generator=g, dtype=torch.float64),
            torch.zeros(1, H, 4 * D, dtype=torch.float64),
            0.1 * torch.randn(1, H, 4 * D, D, generator=g, dtype=torch.float64),
            torch.zeros(1, H, D, dtype=torch.float64))


TTT_LIN, TTT_MLP = _ttt_init("linear"), _ttt_init("mlp")
W_LOCAL = torch.randn(T, 3, generator=g, dtype=torch.float64)
W_CONV = torch.randn(H, 3, generator=g, dtype=torch.float64)
W_FULL = torch.randn(T, 2 * T, generator=g, dtype=torch.float64)  # rows: packed tokens

OPS = {
    "linear_attn": (lambda sl, **kw: linear_attn(Q[:, sl], K[:, sl], V[:, sl], normalize=True, chunk_size=4, **kw), None),
    "delta_rule": (lambda sl, **kw: delta_rule(Q[:, sl], sum_norm(K[:, sl]), V[:, sl], BETA[:, sl], chunk_size=4, **kw), None),
    "decay_linear_attn": (lambda sl, **kw: decay_linear_attn(Q[:, sl], K[:, sl], V[:, sl], torch.tensor([0.9, 0.5], dtype=torch.float64), chunk_size=4, **kw), None),
    "ttt_linear": (lambda sl, **kw: ttt_linear(Q[:, sl], K[:, sl], V[:, sl], 0.1 * BETA[:, sl], mini_batch_size=4, **kw), TTT_LIN),
    "ttt_mlp": (lambda sl, **kw: ttt_mlp(Q[:, sl], K[:, sl], V[:, sl], 0.1 * BETA[:, sl], mini_batch_size=4, **kw), TTT_MLP),
    "infini_attention": (lambda sl, **kw: infini_attention(Q[:, sl], K[:, sl], V[:, sl], torch.tensor([0.3, -1.0], dtype=torch.float64), segment_len=3, q_mem=V[:, sl], **kw), None),
    "infini_attention_delta": (lambda sl, **kw: infini_attention(Q[:, sl], K[:, sl], V[:, sl], torch.tensor([0.3, -1.0], dtype=torch.float64), segment_len=4, update="delta", **kw), None),
    "aft_simple": (lambda sl, **kw: aft(X3[:, sl], X3[:, sl] * 0.5, X3[:, sl] - 1, **kw), None),
    "aft_full": (lambda sl, **kw: aft(X3[:, sl], X3[:, sl] * 0.5, X3[:, sl] - 1, W_FULL[sl], chunk_size=4, **kw), None),
    "aft_local": (lambda sl, **kw: aft_local(X3[:, sl], X3[:, sl] * 0.5, X3[:, sl] - 1, W_LOCAL[sl], window=3, chunk_size=4, **kw), None),
    "aft_conv": (lambda sl, **kw: aft_conv(Q[:, sl], K[:, sl, :, 0], V[:, sl], W_CONV, chunk_size=4, **kw), None),
}


def _flat(state):
    if isinstance(state, torch.Tensor):
        return [state]
    return [x for x in state if isinstance(x, torch.Tensor)]


@pytest.mark.parametrize("name", list(OPS))
def test_packed_equals_separate(name):
    op, init = OPS[name]
    kw = {} if init is None else {"initial_state": init}
    o, states = op(slice(None), cu_seqlens=CU, output_final_state=True, **kw)
    assert isinstance(states, list) and len(states) == len(BOUNDS)
    for (a, b), st in zip(BOUNDS, states):
        o_doc, st_doc = op(slice(a, b), output_final_state=True, **kw)
        assert_close64(o[:, a:b], o_doc, what=f"{name} doc {a}:{b}")
        for x, y in zip(_flat(st), _flat(st_doc)):
            # States may hold -inf (an empty AFT log-sum-exp reference): compare exactly there.
            torch.testing.assert_close(x, y, atol=1e-10, rtol=0, msg=f"{name} state")
    # The per-document final states continue each document.
    if name not in ("ttt_linear", "ttt_mlp"):
        o2, _ = op(slice(None), cu_seqlens=CU, initial_state=states)
        o_ref, _ = op(slice(0, 5), initial_state=states[0])
        assert_close64(o2[:, :5], o_ref)


def test_bad_cu_seqlens():
    with pytest.raises(ValueError, match="cu_seqlens must start at 0 and end at T"):
        linear_attn(Q, K, V, cu_seqlens=torch.tensor([0, 5, 22]))
    with pytest.raises(ValueError, match="strictly increasing"):
        linear_attn(Q, K, V, cu_seqlens=torch.tensor([0, 5, 5, 23]))
    with pytest.raises(TypeError, match="integer dtype"):
        linear_attn(Q, K, V, cu_seqlens=torch.tensor([0.0, 23.0]))
    with pytest.raises(ValueError, match="batch size B = 1"):
        linear_attn(Q.expand(2, -1, -1, -1), K.expand(2, -1, -1, -1), V.expand(2, -1, -1, -1),
                    cu_seqlens=torch.tensor([0, 23]))
    with pytest.raises(ValueError, match="one state per document"):
        delta_rule(Q, K, V, BETA, cu_seqlens=CU, initial_state=torch.zeros(1, H, D, D))
