"""TTT's one-token steps (``ttt_linear_step``, ``ttt_mlp_step``; ops/ttt/recurrent.py, the rows
form): token by token they equal the op's dual form (whole sequences, in float64) and leave the
op's own state, whether they start from the initial weights, from an op state inside a
mini-batch, or as rows stacked at different places (committing by reading which rows complete,
or without reading); gradients through a step."""

from __future__ import annotations

import itertools

import pytest
import torch

from fastweights import state_tree
from fastweights.ops import TTTState, ttt_linear_step, ttt_mlp_step
from tests.helpers import assert_close64
from tests.ops.test_ttt import OPS, assert_states_close, make_case

STEPS = {"linear": ttt_linear_step, "mlp": ttt_mlp_step}


def _steps(kind, args, kw, state, start, stop, **extra):
    """Decode tokens [start, stop) one at a time from ``state``; returns (o, state)."""
    q, k, v, eta = args
    opts = {n: kw.get(n) for n in ("ln_weight", "ln_bias", "token_scale")}
    tau = kw.get("token_scale")
    if tau is not None and tau.dim() == 1 and not torch.is_grad_enabled():
        opts["token_scale_values"] = tuple(tau.tolist())  # tau_i as a number
    outs = []
    for t in range(start, stop):
        o, state = STEPS[kind](q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], eta[:, t:t + 1],
                               state=state, residual=kw["residual"],
                               mini_batch_size=kw["mini_batch_size"], **opts, **extra)
        outs.append(o)
    return torch.cat(outs, 1), state


CASES = list(itertools.product(["linear", "mlp"], [(True, True), (False, True), (True, False)],
                               [True, False], ["rand", "per-head", "ones"]))


@pytest.mark.parametrize(
    "kind,ln_bias,residual,tau", CASES,
    ids=[f"{k}-{'ln' if lb[0] else 'noln'}-{'bias' if lb[1] else 'nobias'}-"
         f"{'res' if r else 'nores'}-{t}" for k, lb, r, t in CASES])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
def test_steps_equal_dual(kind, ln_bias, residual, tau, grad):
    """B2-T11-H3-D5, b = 4: every token's output and the state after 6 (mid-mini-batch) and 11
    tokens equal the dual form's; with and without gradients recorded (the step's LayerNorm
    gradient differs: a group norm's kernels without)."""
    with torch.set_grad_enabled(grad):
        ln, bias = ln_bias
        args, kw = make_case(kind, T=11, ln=ln, residual=residual, bias=bias, tau=tau)
        ref, ref_state = OPS[kind](*args, output_final_state=True, **kw)
        o, state = _steps(kind, args, kw, kw["initial_state"], 0, 6)
        assert isinstance(state, TTTState) and state.pos == 2 and state.rows[0].shape[2] == 2
        _, mid_state = OPS[kind](*(x[:, :6] for x in args), output_final_state=True, **kw)
        assert_states_close(state, mid_state, what="after 6")
        o2, state = _steps(kind, args, kw, state, 6, 11)
        assert_close64(torch.cat([o, o2], 1), ref, what="outputs")
        assert_states_close(state, ref_state, what="after 11")
        _, state = _steps(kind, args, kw, state, 0, 1)  # completes the mini-batch: weights
        assert not isinstance(state, TTTState) and len(state) == len(kw["initial_state"])


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
def test_op_and_steps_continue_each_other(kind, grad):
    """An op state ending inside a mini-batch continues in steps, across a mini-batch
    boundary, and the steps' state continues in the op: all equal the whole sequence; the op's
    state after a call equals the steps' after the same tokens (from the start, from rows the
    call does not complete, across a boundary)."""
    with torch.set_grad_enabled(grad):
        args, kw = make_case(kind, T=13, b=4, seed=2)
        ref, ref_state = OPS[kind](*args, output_final_state=True, **kw)
        o1, state = OPS[kind](*(x[:, :5] for x in args), output_final_state=True, **kw)  # pos 1
        o2, state = _steps(kind, args, kw, state, 5, 7)
        assert state.pos == 3
        _, op7 = OPS[kind](*(x[:, 5:7] for x in args), output_final_state=True,
                           **dict(kw, initial_state=OPS[kind](
                               *(x[:, :5] for x in args), output_final_state=True, **kw)[1]))
        assert_states_close(op7, state, what="op 5 -> 7")
        o3, state = _steps(kind, args, kw, state, 7, 10)
        assert state.pos == 2  # the mini-batch completed at token 8
        o4, state = OPS[kind](*(x[:, 10:] for x in args), output_final_state=True,
                              **dict(kw, initial_state=state))
        assert_close64(torch.cat([o1, o2, o3, o4], 1), ref, what="outputs")
        assert_states_close(state, ref_state, what="final")


def _alone(kind, args, kw, row, prefix, op_prefix):
    """Row ``row`` of the case run alone: ``prefix`` tokens first (by the op when
    ``op_prefix``, else decoded), returning the state there and the tokens' whole outputs."""
    one = tuple(x[row:row + 1] for x in args)
    kw1 = dict(kw, initial_state=tuple(None if w is None else w[row:row + 1]
                                       for w in kw["initial_state"]))
    whole, _ = OPS[kind](*one, **kw1)
    if prefix == 0:
        return kw1["initial_state"], whole, one
    if op_prefix:
        _, state = OPS[kind](*(x[:, :prefix] for x in one), output_final_state=True, **kw1)
    else:
        _, state = _steps(kind, one, kw1, kw1["initial_state"], 0, prefix)
    return state, whole, one


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("how", ["step-read", "step-where", "op"])
@pytest.mark.parametrize("tau", ["rand", "per-head"])
@torch.no_grad()
def test_stacked_rows_equal_streams_alone(kind, how, tau):
    """Five streams at places 2 (op state), 0 (op state at a boundary), 3 (decoded rows), 1
    (op state) and 0 (initial weights) of b = 4, stacked (``TTTState.stack``) and decoded
    together for 7 steps (every row completes a mini-batch, some twice): each row equals its
    stream alone, by the step committing the rows it reads complete, by the step committing
    without reading (``commit="where"``), and by the op's one-token calls."""
    B, T = 5, 13
    args, kw = make_case(kind, B=B, T=T, b=4, seed=4, tau=tau)
    plan = [(6, True), (4, True), (3, False), (5, True), (0, True)]
    states, wholes, rows = [], [], []
    for r, (prefix, op_prefix) in enumerate(plan):
        state, whole, one = _alone(kind, args, kw, r, prefix, op_prefix)
        states.append(state)
        wholes.append(whole)
        rows.append(one)
    state = TTTState.stack(states, 4)
    assert state.pos.tolist() == [2, 0, 3, 1, 0] and state.rows[0].shape[2] == 4
    opts = {n: kw.get(n) for n in ("ln_weight", "ln_bias", "token_scale", "residual")}
    for s in range(7):
        toks = [torch.cat([rows[r][i][:, plan[r][0] + s:plan[r][0] + s + 1] for r in range(B)])
                for i in range(4)]
        if how == "op":
            o, state = OPS[kind](*toks, initial_state=state, mini_batch_size=4,
                                 output_final_state=True, **opts)
        else:
            o, state = STEPS[kind](*toks, state=state, mini_batch_size=4,
                                   commit=how.removeprefix("step-"), **opts)
        for r in range(B):
            t = plan[r][0] + s
            assert_close64(o[r:r + 1], wholes[r][:, t:t + 1], what=f"step {s} row {r}")
    assert state.pos.tolist() == [(p + 7) % 4 for p, _ in plan]


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("prefix", [6, 7], ids=["mid-minibatch", "completing"])
def test_step_gradcheck(kind, prefix):
    """gradcheck (float64) of a step w.r.t. the token, eta, LayerNorm, token_scale and every
    carried tensor (start weights, rows); at prefix 7 the step completes the mini-batch
    (b = 4), so the commit is differentiated too."""
    args, kw = make_case(kind, B=1, T=9, H=2, Dk=2, Dv=2, b=4, seed=7)
    _, state = OPS[kind](*(x[:, :5] for x in args), output_final_state=True, **kw)
    _, state = _steps(kind, args, kw, state, 5, prefix)
    leaves, layout = state_tree.flatten(state_tree.map_tensors(torch.Tensor.detach, state))
    extra = [kw["ln_weight"], kw["ln_bias"], kw["token_scale"]]
    inputs = [x[:, prefix:prefix + 1] for x in args]

    def f(q, k, v, eta, *xs):
        n = len(leaves)
        lw, lb, tau = xs[n:]
        o, new = STEPS[kind](q, k, v, eta, state=state_tree.unflatten(list(xs[:n]), layout),
                             ln_weight=lw, ln_bias=lb, residual=kw["residual"],
                             mini_batch_size=4, token_scale=tau)
        return (o, *state_tree.tensors(new))

    xs = [t.detach().clone().requires_grad_() for t in [*inputs, *leaves, *extra]]
    assert torch.autograd.gradcheck(f, xs)


def test_dtypes_and_bad_length():
    """bfloat16 tokens: output bfloat16, state float32 (docs/design.md, "Precision"); T != 1
    and an unknown commit are refused."""
    args, kw = make_case("mlp", B=1, T=3, b=4)
    bf = [x.to(torch.bfloat16) for x in args]
    opts = {n: kw.get(n) for n in ("ln_weight", "ln_bias", "token_scale")}
    o, state = ttt_mlp_step(*(x[:, :1] for x in bf), state=kw["initial_state"], residual=True,
                            mini_batch_size=4, **opts)
    assert o.dtype == torch.bfloat16 and o.shape == (1, 1, 3, 5)
    assert all(t.dtype == torch.float32 for t in state_tree.tensors(state))
    with pytest.raises(ValueError, match="one token"):
        ttt_mlp_step(*args, state=kw["initial_state"], residual=True, mini_batch_size=4, **opts)
    with pytest.raises(ValueError, match="commit"):
        ttt_mlp_step(*(x[:, :1] for x in args), state=kw["initial_state"], residual=True,
                     mini_batch_size=4, commit="maybe", **opts)
