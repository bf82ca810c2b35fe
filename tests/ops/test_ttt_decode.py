"""The TTT layers' decoding step in rows form (ops/ttt/decode.py): token by token it equals the
op's dual form (whole sequences, in float64) and its carry converts to the op's state exactly,
whether it starts from the initial weights, from an op state that ends inside a mini-batch
(``prior`` sums), or as rows stacked at different places; gradients through a step."""

from __future__ import annotations

import itertools

import pytest
import torch

import fastweights.ops.ttt.decode as decode_mod
from fastweights.ops.ttt import (
    DecodeCarry,
    stack_decode_carries,
    stack_inner_states,
    to_op_state,
    ttt_decode_step,
)
from fastweights.ops.ttt.decode import decode_carry, layer_state_after
from tests.helpers import assert_close64
from tests.ops.test_ttt import OPS, assert_states_close, make_case

F64 = torch.float64


def _steps(kind, args, kw, state, start, stop):
    """Decode tokens [start, stop) one at a time from ``state``; returns (o, carry)."""
    q, k, v, eta = args
    opts = {n: kw.get(n) for n in ("ln_weight", "ln_bias", "token_scale")}
    tau = kw.get("token_scale")
    if tau is not None and tau.dim() == 1:  # used without gradients (tau_i as a number)
        opts["token_scale_values"] = tuple(tau.tolist())
    outs = []
    for t in range(start, stop):
        o, state = ttt_decode_step(kind, q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1],
                                   eta[:, t:t + 1], state=state, residual=kw["residual"],
                                   mini_batch_size=kw["mini_batch_size"], **opts)
        outs.append(o)
    return torch.cat(outs, 1), state


def _tau(kw, H):
    b = kw["mini_batch_size"]
    tau = kw.get("token_scale")
    return torch.ones(H, b, dtype=F64) if tau is None else tau


CASES = list(itertools.product(["linear", "mlp"], [(True, True), (False, True), (True, False)],
                               [True, False], ["rand", "per-head", "ones"]))


@pytest.mark.parametrize(
    "kind,ln_bias,residual,tau", CASES,
    ids=[f"{k}-{'ln' if lb[0] else 'noln'}-{'bias' if lb[1] else 'nobias'}-"
         f"{'res' if r else 'nores'}-{t}" for k, lb, r, t in CASES])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
def test_steps_equal_dual(kind, ln_bias, residual, tau, grad):
    """B2-T11-H3-D5, b = 4: every token's output and the carry after 6 (mid-mini-batch) and 11
    tokens (as an op state) equal the dual form's; with and without gradients recorded (the
    step's LayerNorm gradient differs: a group norm's kernels without)."""
    with torch.set_grad_enabled(grad):
        _steps_equal_dual(kind, ln_bias, residual, tau)


def _steps_equal_dual(kind, ln_bias, residual, tau):
    ln, bias = ln_bias
    args, kw = make_case(kind, T=11, ln=ln, residual=residual, bias=bias, tau=tau)
    ref, ref_state = OPS[kind](*args, output_final_state=True, **kw)
    o, carry = _steps(kind, args, kw, kw["initial_state"], 0, 6)
    assert isinstance(carry, DecodeCarry) and carry.pos == 2 and carry.rows[0].shape[2] == 2
    _, mid_state = OPS[kind](*(x[:, :6] for x in args), output_final_state=True, **kw)
    tau_t = _tau(kw, 3)
    assert_states_close(to_op_state(carry, tau_t), mid_state, what="after 6")
    o2, carry = _steps(kind, args, kw, carry, 6, 11)
    assert_close64(torch.cat([o, o2], 1), ref, what="outputs")
    assert_states_close(to_op_state(carry, tau_t), ref_state, what="after 11")
    assert carry.prior is None


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
def test_from_and_to_op_states(kind, grad):
    """An op state ending inside a mini-batch continues as rows (its sums held as ``prior``
    until that mini-batch completes, then dropped); a carry converted back continues in the
    op: both equal the whole sequence."""
    with torch.set_grad_enabled(grad):
        _from_and_to_op_states(kind)


def _from_and_to_op_states(kind):
    args, kw = make_case(kind, T=13, b=4, seed=2)
    ref, ref_state = OPS[kind](*args, output_final_state=True, **kw)
    o1, state = OPS[kind](*(x[:, :5] for x in args), output_final_state=True, **kw)  # pos 1
    o2, carry = _steps(kind, args, kw, state, 5, 7)
    assert carry.prior is not None and carry.pos == 3 and carry.prior_steps == 1
    o3, carry = _steps(kind, args, kw, carry, 7, 10)
    assert carry.prior is None and carry.pos == 2  # the mini-batch completed at token 8
    o4, state = OPS[kind](*(x[:, 10:] for x in args), output_final_state=True,
                          **dict(kw, initial_state=to_op_state(carry, _tau(kw, 3))))
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
        return kw1["initial_state"], whole, one, kw1
    if op_prefix:
        _, state = OPS[kind](*(x[:, :prefix] for x in one), output_final_state=True, **kw1)
    else:
        _, state = _steps(kind, one, kw1, kw1["initial_state"], 0, prefix)
    return state, whole, one, kw1


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "exported-commit"])
@pytest.mark.parametrize("tau", ["rand", "per-head"])
@torch.no_grad()
def test_stacked_rows_equal_streams_alone(kind, traced, tau, monkeypatch):
    """Five streams at places 2 (op state: prior sums), 0 (op state at a boundary), 3 (decoded
    rows), 1 (op state) and 0 (initial weights) of b = 4, stacked and decoded together for 7
    steps (every row completes a mini-batch, some twice): each row equals its stream alone.
    ``traced`` takes the commit path an exported step uses (no host read of the rows done)."""
    if traced:
        monkeypatch.setattr(decode_mod.torch.compiler, "is_compiling", lambda: True)
        monkeypatch.setattr(decode_mod.torch.compiler, "is_exporting", lambda: True)
    B, T = 5, 13
    args, kw = make_case(kind, B=B, T=T, b=4, seed=4, tau=tau)
    plan = [(6, True), (4, True), (3, False), (5, True), (0, True)]
    carries, wholes, rows = [], [], []
    for r, (prefix, op_prefix) in enumerate(plan):
        state, whole, one, _ = _alone(kind, args, kw, r, prefix, op_prefix)
        carries.append(decode_carry(state, kind, 1, 3, 5, 5, 4, one[0]))
        wholes.append(whole)
        rows.append(one)
    stacked = stack_decode_carries(carries, 4)
    assert stacked.pos.tolist() == [2, 0, 3, 1, 0] and stacked.rows[0].shape[2] == 4
    opts = {n: kw.get(n) for n in ("ln_weight", "ln_bias", "token_scale")}
    carry = stacked
    for s in range(7):
        toks = [torch.cat([rows[r][i][:, plan[r][0] + s:plan[r][0] + s + 1] for r in range(B)])
                for i in range(4)]
        o, carry = ttt_decode_step(kind, *toks, state=carry, residual=kw["residual"],
                                   mini_batch_size=4, **opts)
        for r in range(B):
            t = plan[r][0] + s
            assert_close64(o[r:r + 1], wholes[r][:, t:t + 1], what=f"step {s} row {r}")
    assert carry.prior is None  # every row with prior sums has completed its mini-batch
    assert carry.pos.tolist() == [(p + 7) % 4 for p, _ in plan]


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("prefix", [6, 7], ids=["mid-minibatch", "completing"])
def test_step_gradcheck(kind, prefix):
    """gradcheck (float64) of decoding steps w.r.t. the tokens, eta, LayerNorm, token_scale
    and every carried tensor (start weights, prior sums, rows); at prefix 7 the step completes
    the mini-batch (b = 4), so the commit is differentiated too."""
    args, kw = make_case(kind, B=1, T=9, H=2, Dk=2, Dv=2, b=4, seed=7)
    _, state = OPS[kind](*(x[:, :5] for x in args), output_final_state=True, **kw)
    _, carry = _steps(kind, args, kw, state, 5, prefix)
    leaves = [*carry.start, *carry.prior, *carry.rows]
    extra = [kw["ln_weight"], kw["ln_bias"], kw["token_scale"]]
    inputs = [x[:, prefix:prefix + 1].clone() for x in args]

    def f(*xs):
        q, k, v, eta = xs[:4]
        n = len(leaves)
        c = DecodeCarry(tuple(xs[4:4 + len(carry.start)]),
                        tuple(xs[4 + len(carry.start):4 + 2 * len(carry.start)]),
                        tuple(xs[4 + 2 * len(carry.start):4 + n]), carry.pos, carry.prior_steps)
        lw, lb, tau = xs[4 + n:]
        o, new = ttt_decode_step(kind, q, k, v, eta, state=c, ln_weight=lw, ln_bias=lb,
                                 residual=kw["residual"], mini_batch_size=4, token_scale=tau)
        return (o, *[t for t in new.start if t is not None],
                *[t for t in new.rows])

    xs = [t.detach().clone().requires_grad_() for t in [*inputs, *leaves, *extra]]
    assert torch.autograd.gradcheck(f, xs)


def test_dtypes_and_bad_length():
    """bfloat16 tokens: output bfloat16, carry float32 (docs/design.md, "Precision"); T != 1 is
    refused."""
    args, kw = make_case("mlp", B=1, T=3, b=4)
    bf = [x.to(torch.bfloat16) for x in args]
    opts = {n: kw.get(n) for n in ("ln_weight", "ln_bias", "token_scale")}
    o, carry = ttt_decode_step("mlp", *(x[:, :1] for x in bf), state=kw["initial_state"],
                               residual=True, mini_batch_size=4, **opts)
    assert o.dtype == torch.bfloat16 and o.shape == (1, 1, 3, 5)
    assert all(t.dtype == torch.float32 for t in (*carry.start, *carry.rows))
    with pytest.raises(ValueError, match="one token"):
        ttt_decode_step("mlp", *args, state=kw["initial_state"], residual=True,
                        mini_batch_size=4, **opts)


def _assert_carries_close(a: DecodeCarry, b: DecodeCarry, what: str) -> None:
    assert a.pos == b.pos and a.prior_steps == b.prior_steps, what
    assert (a.prior is None) == (b.prior is None), what
    for x, y in zip([*a.start, *(a.prior or ()), *a.rows], [*b.start, *(b.prior or ()), *b.rows]):
        assert (x is None) == (y is None), what
        if x is not None:
            assert_close64(x, y, what=what)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_layer_state_after_equals_decoding(kind):
    """The state after a multi-token call (``layer_state_after``, what the layers keep) equals
    the carry of decoding the same tokens one at a time: from the start (b = 4, T = 6), from a
    carry inside a mini-batch the call does not complete (rows kept) and from an op state
    inside a mini-batch (its sums kept as prior)."""
    args, kw = make_case(kind, T=13, b=4, seed=11)
    opts = {"ln_weight": kw["ln_weight"], "ln_bias": kw["ln_bias"],
            "residual": kw["residual"], "mini_batch_size": 4}
    tau = _tau(kw, 3)

    def after(state_in, a, z):
        op_in = to_op_state(state_in, tau) if isinstance(state_in, DecodeCarry) else state_in
        _, op_state = OPS[kind](*(x[:, a:z] for x in args), output_final_state=True,
                                **dict(kw, initial_state=op_in))
        return layer_state_after(kind, op_state, state_in, *(x[:, a:z] for x in args[1:]),
                                 **opts)

    _, decoded = _steps(kind, args, kw, kw["initial_state"], 0, 6)
    whole = after(kw["initial_state"], 0, 6)
    _assert_carries_close(whole, decoded, "from the start")
    _, decoded8 = _steps(kind, args, kw, decoded, 6, 7)  # 6 -> 7: inside the mini-batch
    _assert_carries_close(after(decoded, 6, 7), decoded8, "rows kept")
    _, op_state = OPS[kind](*(x[:, :5] for x in args), output_final_state=True, **kw)
    _, stepped = _steps(kind, args, kw, op_state, 5, 7)
    got = after(op_state, 5, 7)
    assert got.prior is not None and got.prior_steps == 1
    _assert_carries_close(got, stepped, "prior kept")
    assert after(kw["initial_state"], 0, 8).rows[0].shape[2] == 0  # a boundary: no rows


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_op_states_at_their_own_places(kind):
    """The ops' own per-row state (``stack_inner_states``: pos a long tensor) continues one token
    per call with each row equal to its stream alone, and stacked decoding carries convert to
    that same op state (``to_op_state``)."""
    B, b, prefixes = 4, 4, [5, 4, 2, 7]
    args, kw = make_case(kind, B=B, T=12, b=b, seed=6)
    states, wholes, rows, carries = [], [], [], []
    for r, p in enumerate(prefixes):
        state, whole, one, _ = _alone(kind, args, kw, r, p, True)
        states.append(state)
        wholes.append(whole)
        rows.append(one)
        carries.append(decode_carry(state, kind, 1, 3, 5, 5, b, one[0]))
    tau = kw["token_scale"]
    stacked = stack_inner_states(states, [torch.tensor([p % b]) for p in prefixes], tau)
    assert stacked[-1].tolist() == [1, 0, 2, 3]
    converted = to_op_state(stack_decode_carries(carries, b), tau)
    assert_states_close(converted, stacked, what="stacked carries as an op state")
    kw_rows = {n: kw[n] for n in ("ln_weight", "ln_bias", "token_scale", "residual",
                                  "mini_batch_size")}
    state = stacked
    for s in range(5):
        toks = [torch.cat([rows[r][i][:, prefixes[r] + s:prefixes[r] + s + 1] for r in range(B)])
                for i in range(4)]
        o, state = OPS[kind](*toks, initial_state=state, output_final_state=True, **kw_rows)
        for r in range(B):
            t = prefixes[r] + s
            assert_close64(o[r:r + 1], wholes[r][:, t:t + 1], what=f"step {s} row {r}")
