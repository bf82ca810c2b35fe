"""Bad arguments to ttt_linear / ttt_mlp raise clear errors naming the argument, before any work."""

from __future__ import annotations

import pytest
import torch

from fastweights.ops import ttt_linear, ttt_mlp

B, T, H, Dk, Dv = 2, 5, 3, 4, 4
q = torch.randn(B, T, H, Dk)
v6 = torch.randn(B, T, H, 6)
eta = torch.rand(B, T, H)
W, b = torch.zeros(1, H, Dk, Dv), torch.zeros(1, H, Dv)
mlp_state = (torch.zeros(1, H, Dk, 4 * Dk), None, torch.zeros(1, H, 4 * Dk, Dv), None)
ones_hd = torch.ones(H, Dv)
_, mid_state = ttt_linear(q[:, :3], q[:, :3], q[:, :3], eta[:, :3], initial_state=(W, b),
                          mini_batch_size=4, output_final_state=True)  # 3 of 4 tokens consumed


def lin(**kw):
    args = {"initial_state": (W, b)}
    args.update(kw)
    return lambda: ttt_linear(args.pop("q", q), args.pop("k", q), args.pop("v", q),
                              args.pop("eta", eta), **args)


CASES = [
    ("mini-batch 0", lin(mini_batch_size=0), ValueError, "mini_batch_size must be >= 1"),
    ("mini-batch float", lin(mini_batch_size=2.0), TypeError, "mini_batch_size"),
    ("eta shape", lin(eta=eta[..., :2]), ValueError, "eta must have shape [B, T, H]"),
    ("eta rank", lin(eta=eta[..., None]), ValueError, "eta must have shape"),
    ("eta not tensor", lin(eta=0.1), TypeError, "eta must be a torch.Tensor"),
    ("residual Dk != Dv", lin(v=v6, residual=True, initial_state=(torch.zeros(1, H, Dk, 6), None)),
     ValueError, "residual=True"),
    ("ln_weight size", lin(ln_weight=torch.ones(H, Dv + 1)), ValueError, "ln_weight must have shape [H, Dv]"),
    ("ln_weight heads", lin(ln_weight=torch.ones(H + 1, Dv)), ValueError, "ln_weight"),
    ("ln_bias size", lin(ln_weight=ones_hd, ln_bias=torch.zeros(Dv)), ValueError, "ln_bias must have shape"),
    ("ln_bias alone", lin(ln_bias=torch.zeros(H, Dv)), ValueError, "ln_bias was given without ln_weight"),
    ("missing initial_state", lin(initial_state=None), ValueError, "initial_state is required"),
    ("initial_state not tuple", lin(initial_state=W), TypeError, "initial_state must be a tuple"),
    ("initial_state length", lin(initial_state=(W, b, W)), TypeError, "initial_state must be a tuple"),
    ("W shape", lin(initial_state=(torch.zeros(1, H, Dk, Dv + 1), b)), ValueError, "initial_state[0] (W)"),
    ("W batch", lin(initial_state=(torch.zeros(3, H, Dk, Dv), b)), ValueError, "batch size 1 or B=2"),
    ("W None", lin(initial_state=(None, b)), ValueError, "initial_state[0] (W) must be a tensor"),
    ("b shape", lin(initial_state=(W, torch.zeros(1, H, Dk + 1))), ValueError, "initial_state[1] (b)"),
    ("W int", lin(initial_state=(W.long(), b)), TypeError, "initial_state[0] (W) must be a floating-point"),
    ("mlp W1 hidden", lambda: ttt_mlp(q, q, q, eta, initial_state=(torch.zeros(1, H, Dk, 3 * Dk), None,
                                                                    torch.zeros(1, H, 3 * Dk, Dv), None)),
     ValueError, "initial_state[0] (W1)"),
    ("mlp given linear state", lambda: ttt_mlp(q, q, q, eta, initial_state=(W, b)), TypeError,
     "initial_state must be a tuple (W1, b1, W2, b2)"),
    ("mlp W2 shape", lambda: ttt_mlp(q, q, q, eta, initial_state=(*mlp_state[:2], W, None)),
     ValueError, "initial_state[2] (W2)"),
    ("mid-state position", lin(initial_state=mid_state._replace(pos=4), mini_batch_size=4),
     ValueError, "initial_state.pos must be an int in [1, mini_batch_size=4)"),
    ("mid-state smaller mini-batch", lin(initial_state=mid_state, mini_batch_size=2), ValueError,
     "initial_state.pos"),
    ("mid-state start shape", lin(initial_state=mid_state._replace(start=(W[..., :2], b))),
     ValueError, "initial_state.start[0] (W)"),
    ("mid-state rows count", lin(initial_state=mid_state._replace(rows=mid_state.rows[:1])),
     TypeError, "initial_state.rows must be 2 tensors"),
    ("mid-state rows for pos", lin(initial_state=mid_state._replace(pos=2)), ValueError,
     "initial_state.rows[0] must have shape"),
    ("old 7-item state", lin(initial_state=(W, b, W, b, W, b, 3)), TypeError,
     "initial_state must be a tuple (W, b) or a TTTState"),
    ("token_scale shape", lin(token_scale=torch.ones(3)), ValueError, "token_scale must have shape"),
    ("token_scale heads", lin(token_scale=torch.ones(H + 1, 16)), ValueError, "token_scale"),
    ("unknown mode", lin(mode="chunk"), ValueError, "mode must be one of ['dual', 'primal', 'naive']"),
    ("residual not bool", lin(residual=1), TypeError, "residual must be a bool"),
    ("q rank", lin(q=q[0], k=q[0]), ValueError, "q must be a 4-D"),
    ("v batch", lin(v=q[:1]), ValueError, "v must have shape"),
]


@pytest.mark.parametrize("call,exc,words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    assert words in str(info.value), str(info.value)
