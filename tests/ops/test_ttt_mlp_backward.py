"""TTT-MLP's dual form with its hand-written backward pass (ops/ttt/mlp_scan.py): gradients of
every input against autograd through the naive oracle (float64, odd sizes, the option
combinations), across the reverse walk's anchors and checkpoint groups, second derivatives."""

from __future__ import annotations

import pytest
import torch

from fastweights import state_tree
from fastweights.ops import ttt_mlp
from fastweights.ops.ttt import chunk, mlp_scan
from fastweights.ops.ttt.common import Carry
from tests.helpers import assert_close64
from tests.ops.test_ttt import make_case

# (id, make_case keywords, tokens consumed by an earlier call, batch-1 initial weights)
CASES = [
    ("all-on-b4", {"b": 4}, 0, False),
    ("carried-mid-minibatch-b3", {"b": 3, "seed": 1}, 4, False),
    ("no-ln-no-bias-b5", {"b": 5, "ln": False, "bias": False, "seed": 2}, 2, True),
    ("no-residual-Dv4-per-head-tau", {"b": 3, "residual": False, "Dv": 4, "tau": "per-head",
                                      "seed": 3}, 0, True),
    ("b1", {"b": 1, "T": 7, "seed": 4}, 0, False),
    ("b-greater-than-T", {"b": 16, "T": 9, "seed": 5}, 3, False),
]


def _grads(mode: str, kw_case: dict, carried: int, batch1: bool, ln_bias_none: bool = False):
    """Outputs, final state and gradients (w.r.t. q, k, v, eta, ln_weight, ln_bias,
    token_scale and the initial weights or, when the call starts inside a mini-batch, the
    carried start weights and gradient sums) of a random weighting of everything the call
    returns."""
    args, kw = make_case("mlp", B=2, H=2, Dk=3, **{"T": 11, "Dv": 3, **kw_case})
    init = kw.pop("initial_state")
    if batch1:
        init = tuple(None if w is None else w[:1].clone() for w in init)
    if ln_bias_none:
        kw["ln_bias"] = None
    leaves = [x.clone().requires_grad_() for x in args]
    opts = {k: (v.clone().requires_grad_() if torch.is_tensor(v) else v) for k, v in kw.items()}
    init = [None if w is None else w.clone().requires_grad_() for w in init]
    state, xs = tuple(init), leaves
    if carried:  # an earlier call ends inside a mini-batch; its state is differentiated too
        _, state = ttt_mlp(*(x[:, :carried] for x in leaves), initial_state=state,
                           output_final_state=True, mode=mode, **opts)
        state = tuple(s.detach().requires_grad_() if torch.is_tensor(s) else s for s in state)
        xs = [x[:, carried:] for x in leaves]
    o, final = ttt_mlp(*xs, initial_state=state, output_final_state=True, mode=mode, **opts)
    gen = torch.Generator().manual_seed(11)
    outs = [o, *(s for s in final if torch.is_tensor(s))]
    loss = sum((t * torch.randn(t.shape, generator=gen, dtype=t.dtype)).sum() for t in outs)
    # A carried state's leading (current) weights are implied by the rest and not read.
    wrt = [*leaves, *(v for v in opts.values() if torch.is_tensor(v)),
           *(s for s in (state[4:] if carried else state) if torch.is_tensor(s))]
    return outs, torch.autograd.grad(loss, wrt)


def _uses_scan(o: torch.Tensor) -> bool:
    """Whether the hand-written backward is in o's autograd graph."""
    seen, todo = set(), [o.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        if type(fn).__name__ == "MLPScanBackward":
            return True
        seen.add(fn)
        todo += [f for f, _ in fn.next_functions]
    return False


@pytest.mark.parametrize("kw_case,carried,batch1", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_gradients_equal_autograd_through_naive(kw_case, carried, batch1):
    """B2-T11-H2-Dk3 float64: T is a multiple of no b used but 1, the final state ends inside a
    mini-batch (its gradient sums are outputs), and a carried mid-mini-batch state comes in."""
    (o, *s), grads = _grads("dual", kw_case, carried, batch1)
    (o_ref, *s_ref), grads_ref = _grads("naive", kw_case, carried, batch1)
    assert _uses_scan(o)
    assert_close64(o, o_ref, what="output")
    for i, (a, b) in enumerate(zip(s, s_ref)):
        assert_close64(a, b, what=f"state[{i}]")
    assert len(grads) == len(grads_ref)
    for i, (a, b) in enumerate(zip(grads, grads_ref)):
        assert b.abs().max() > 0, f"input {i} gets no gradient: the case would test nothing"
        assert_close64(a, b, atol=1e-9, what=f"gradient {i}")


def test_ln_without_bias():
    _, grads = _grads("dual", {"b": 4, "seed": 6}, 0, False, ln_bias_none=True)
    _, grads_ref = _grads("naive", {"b": 4, "seed": 6}, 0, False, ln_bias_none=True)
    for i, (a, b) in enumerate(zip(grads, grads_ref)):
        assert_close64(a, b, atol=1e-9, what=f"gradient {i}")


@pytest.mark.parametrize("segment_floats", [1, 400], ids=["anchor-every-step", "anchor-2"])
def test_reverse_walk_anchors_and_groups(monkeypatch, segment_floats):
    """The backward pass rebuilds each step's weights in reverse from exact anchors; with
    anchors every step or every 2nd (instead of every 16th) the gradients still equal
    autograd through the plain scan, and checkpoint groups change no bit."""
    monkeypatch.setattr(mlp_scan, "_SEGMENT_FLOATS", segment_floats)
    args, kw = make_case("mlp", B=1, T=23, H=2, Dk=3, Dv=3, b=3, seed=8)
    leaves = [x.clone().requires_grad_() for x in (*args, *kw["initial_state"])]
    kw = {k: v for k, v in kw.items() if k != "initial_state"}

    def run(form, group):
        q, k, v, eta, *init = leaves
        tau = kw["token_scale"].expand(2, 3)
        o, c = form(q, k, v, eta, Carry(tuple(init), None, 0), kw["ln_weight"], kw["ln_bias"],
                    kw["residual"], tau, checkpoint_group=group)
        loss = o.square().sum() + sum(w.sum() for w in c.start) + sum(g.sum() for g in c.grads)
        return o, torch.autograd.grad(loss, leaves)

    o_ref, g_ref = run(chunk._ttt_mlp_dual_traced, None)
    o, g = run(chunk.ttt_mlp_dual, None)
    assert_close64(o, o_ref)
    for i, (a, b) in enumerate(zip(g, g_ref)):
        assert_close64(a, b, atol=1e-9, what=f"gradient {i}")
    for group in (2, 3):
        o_g, g_g = run(chunk.ttt_mlp_dual, group)
        assert torch.equal(o_g, o)
        assert all(torch.equal(a, b) for a, b in zip(g_g, g))


def test_second_derivatives():
    """create_graph=True differentiates a plain re-run of the scan: gradgradcheck on a tiny
    case (B1-T3-H1-D2, b 2: a full and a partial mini-batch) w.r.t. q, eta, gamma and b2."""
    args, kw = make_case("mlp", B=1, T=3, H=1, Dk=2, Dv=2, b=2, seed=5)
    q, k, v, eta = args
    W1, b1, W2, b2 = kw.pop("initial_state")
    lw = kw.pop("ln_weight")
    inputs = [x.clone().requires_grad_() for x in (q, eta, lw, b2)]

    def f(q, eta, lw, b2):
        o, s = ttt_mlp(q, k, v, eta, initial_state=(W1, b1, W2, b2), ln_weight=lw,
                       output_final_state=True, **kw)
        return o, *(t for t in s if torch.is_tensor(t))

    assert torch.autograd.gradgradcheck(f, inputs, eps=1e-6, atol=1e-5, fast_mode=True)


def test_first_derivatives_under_create_graph_equal_the_plain_ones():
    """create_graph=True must not change the first derivatives: the scan's inputs depend on one
    another (E is formed from eta, the residual target from the keys), and a double backward
    that differentiated w.r.t. the inputs themselves counted those paths twice (the gradients
    of k and eta were wrong under create_graph while gradgradcheck, which only compares
    second derivatives with differences of those first derivatives, passed). Every input:
    tokens, eta, LayerNorm, token scale and a mid-mini-batch state."""
    args, kw = make_case("mlp", B=2, T=9, H=2, Dk=3, Dv=3, b=4, seed=8)
    _, state = ttt_mlp(*(x[:, :2] for x in args), output_final_state=True, **kw)
    names = ("ln_weight", "ln_bias", "token_scale")
    grads = {}
    for create_graph in (False, True):
        xs = [x[:, 2:].clone().requires_grad_() for x in args]
        extra = {n: kw[n].clone().requires_grad_() for n in names}
        carried = [s.clone().requires_grad_() if torch.is_tensor(s) else s for s in state]
        o, final = ttt_mlp(*xs, **{**kw, **extra, "initial_state": tuple(carried)},
                           output_final_state=True)
        loss = o.square().sum() + sum(t.square().sum() for t in final if torch.is_tensor(t))
        leaves = [*xs, *extra.values(), *(t for t in carried[4:] if torch.is_tensor(t))]
        grads[create_graph] = torch.autograd.grad(loss, leaves, create_graph=create_graph)
    for i, (a, b) in enumerate(zip(grads[True], grads[False])):
        assert_close64(a.detach(), b, atol=1e-9, what=f"gradient {i}")


def test_gelu_parts_and_layernorm_gradient_backward():
    """The fused pieces against autograd: gelu, gelu', gelu'' from one sigmoid, and the
    vector-Jacobian product of the inner loss gradient through the LayerNorm."""
    gen = torch.Generator().manual_seed(9)
    x = 3 * torch.randn(4, 5, 7, generator=gen, dtype=torch.float64)
    y = torch.empty_like(x)
    g1, g2 = mlp_scan._gelu_parts(x.clone(), y, second=True)
    xr = x.clone().requires_grad_()
    ref = torch.nn.functional.gelu(xr, approximate="tanh")
    (d1,) = torch.autograd.grad(ref.sum(), xr, create_graph=True)
    (d2,) = torch.autograd.grad(d1.sum(), xr)
    assert_close64(y, ref.detach())
    assert_close64(g1, d1.detach())
    assert_close64(g2, d2)
    z = torch.randn(3, 4, 6, generator=gen, dtype=torch.float64).requires_grad_()
    tgt, dG = (torch.randn(3, 4, 6, generator=gen, dtype=torch.float64) for _ in range(2))
    lw = (1 + 0.3 * torch.randn(3, 1, 6, generator=gen, dtype=torch.float64)).requires_grad_()
    lb = torch.randn(3, 1, 6, generator=gen, dtype=torch.float64)
    G, _, r = mlp_scan._ln_grad(z, tgt, lw, lb)
    dz_ref, dlw_ref = torch.autograd.grad(G, (z, lw), dG)
    lw, z = lw.detach(), z.detach()
    G_fast, mean, r_fast = mlp_scan._ln_grad_fast(z, tgt, lw, lb)
    assert_close64(G_fast, G.detach())
    assert_close64(r_fast, r.detach())
    rows = mlp_scan._LNRows(z, mean, r_fast, tgt, lw, lb)
    dz, dg = mlp_scan._ln_grad_backward(dG, G_fast, z, mean, r_fast, rows.g, rows.rxh, rows.c,
                                        rows.lw2)
    assert_close64(dz, dz_ref)
    assert_close64((dg * (rows.e + lw * rows.xh)).sum(1, keepdim=True), dlw_ref)


def test_recording_gradients_changes_no_output_bit():
    """With gradients recorded the scan runs as one autograd node that keeps its rows; without
    (no_grad, though the inputs require grad) it runs straight: the same outputs and state."""
    args, kw = make_case("mlp", T=10, b=4, seed=10)
    args = [x.requires_grad_() for x in args]
    o, s = ttt_mlp(*args, output_final_state=True, **kw)
    assert _uses_scan(o)
    with torch.no_grad():
        o2, s2 = ttt_mlp(*args, output_final_state=True, **kw)
    assert o2.grad_fn is None and torch.equal(o, o2)
    assert s.pos == s2.pos
    assert all(torch.equal(a, b) for a, b in zip(state_tree.tensors(s), state_tree.tensors(s2)))
