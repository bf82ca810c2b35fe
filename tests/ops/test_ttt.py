"""TTT-Linear / TTT-MLP ops (docs/maths.md 2): naive == primal == dual, streaming, gradients, and
the papers' equivalences (delta rule at b = 1, causal linear attention with one mini-batch)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from fastweights import state_tree
from fastweights.ops import TTTState, delta_rule, linear_attn, ttt_linear, ttt_mlp
from fastweights.ops.ttt.chunk import _ttt_mlp_dual_traced
from fastweights.ops.ttt.common import gelu, gelu_grad, loss_grad
from fastweights.ops.ttt.inner_loop import _KERNELS
from tests.helpers import assert_close64

OPS = {"linear": ttt_linear, "mlp": ttt_mlp}
MODES = ("naive", "primal", "dual")
F64 = torch.float64


def rand(*shape: int, gen: torch.Generator, scale: float = 1.0, dtype=F64) -> torch.Tensor:
    return (scale * torch.randn(*shape, generator=gen, dtype=F64)).to(dtype)


def make_state(kind: str, B: int, H: int, Dk: int, Dv: int, bias: bool, gen, scale: float = 0.3):
    """Random inner weights (batch B); biases None when ``bias`` is False."""
    if kind == "linear":
        shapes = [(Dk, Dv), (Dv,)]
    else:
        shapes = [(Dk, 4 * Dk), (4 * Dk,), (4 * Dk, Dv), (Dv,)]
    return tuple(
        None if (i % 2 and not bias) else rand(B, H, *s, gen=gen, scale=scale)
        for i, s in enumerate(shapes)
    )


def make_case(kind, B=2, T=13, H=3, Dk=5, Dv=5, b=4, ln=True, residual=True, bias=True,
              tau="rand", seed=0):
    """Inputs and keyword arguments for one op call (float64, non-trivial everything)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = rand(B, T, H, Dk, gen=gen), rand(B, T, H, Dk, gen=gen)
    v = rand(B, T, H, Dv, gen=gen)
    # eta_base sigmoid(.) / d-sized rates, so that no configuration (MLP without LN) diverges
    eta = (0.1 + torch.rand(B, T, H, generator=gen, dtype=F64)) / Dk
    if kind == "mlp":
        eta = eta / 10  # docs/maths.md 2.6 gives TTT-MLP a 10x smaller eta_base
    kw = {"initial_state": make_state(kind, B, H, Dk, Dv, bias, gen), "residual": residual,
              "mini_batch_size": b}
    if ln:
        kw["ln_weight"] = 1.0 + rand(H, Dv, gen=gen, scale=0.3)
        kw["ln_bias"] = rand(H, Dv, gen=gen, scale=0.3)
    if tau == "rand":
        kw["token_scale"] = 0.3 + torch.rand(b, generator=gen, dtype=F64)
    elif tau == "per-head":  # [H, b], with some zeros (the layer clamps tau at 0)
        kw["token_scale"] = (torch.rand(H, b, generator=gen, dtype=F64) * 1.5 - 0.3).clamp_min(0)
    return (q, k, v, eta), kw


def assert_states_close(a, b, atol=1e-10, what=""):
    """Two TTT states (weights, or TTTStates: nested tuples) equal to ``atol``."""
    assert type(a) is type(b) or (not isinstance(a, TTTState) and not isinstance(b, TTTState)), \
        f"{what}: {type(a).__name__} != {type(b).__name__}"
    assert len(a) == len(b), f"{what}: state lengths {len(a)} != {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if isinstance(x, torch.Tensor):
            assert_close64(x, y, atol=atol, what=f"{what} state[{i}]")
        elif isinstance(x, (tuple, list)):
            assert_states_close(x, y, atol, f"{what} state[{i}]")
        else:
            assert x == y, f"{what} state[{i}]: {x!r} != {y!r}"


MODE_CASES = [
    (kind, b, ln, res, bias)
    for kind, b, ln, res, bias in itertools.product(
        ["linear", "mlp"], [1, 3, 4, 16], [True, False], [True, False], [True, False])
]


@pytest.mark.parametrize(
    "kind,b,ln,res,bias", MODE_CASES,
    ids=[f"{k}-b{b}-{'ln' if ln else 'noln'}-{'res' if r else 'nores'}-{'bias' if bi else 'nobias'}"
         for k, b, ln, r, bi in MODE_CASES])
def test_modes_agree(kind, b, ln, res, bias):
    """B2-T13-H3-D5: T=13 divisible by none of b = 3, 4, 16 (16 > T: one partial mini-batch)."""
    args, kw = make_case(kind, b=b, ln=ln, residual=res, bias=bias)
    ref, ref_state = OPS[kind](*args, mode="naive", output_final_state=True, **kw)
    assert ref.abs().max() < 100  # a meaningful comparison, not of diverged values
    for mode in ("primal", "dual"):
        o, state = OPS[kind](*args, mode=mode, output_final_state=True, **kw)
        assert_close64(o, ref, what=mode)
        assert_states_close(state, ref_state, what=mode)
    if not bias:
        assert (state.start if isinstance(state, TTTState) else state)[1] is None


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("tau", ["ones", "per-head"])
def test_modes_agree_other_shapes(kind, tau):
    """Dk != Dv (no residual), token_scale None or [H, b] with zeros, T=37, B1-H2."""
    args, kw = make_case(kind, B=1, T=37, H=2, Dk=4, Dv=6, b=5, residual=False, tau=tau, seed=3)
    ref, ref_state = OPS[kind](*args, mode="naive", output_final_state=True, **kw)
    for mode in ("primal", "dual"):
        o, state = OPS[kind](*args, mode=mode, output_final_state=True, **kw)
        assert_close64(o, ref, what=mode)
        assert_states_close(state, ref_state, what=mode)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("splits", [(1,), (3, 4), (6, 7, 11), tuple(range(1, 13))],
                         ids=["1", "3-4", "6-7-11", "token-by-token"])
def test_pieces_equal_whole(kind, mode, splits):
    args, kw = make_case(kind, b=4)
    whole, whole_state = OPS[kind](*args, mode="dual", output_final_state=True, **kw)
    outs, state, start = [], kw.pop("initial_state"), 0
    for stop in [*splits, 13]:
        o, state = OPS[kind](*(x[:, start:stop] for x in args), initial_state=state, mode=mode,
                             output_final_state=True, **kw)
        outs.append(o)
        start = stop
    assert_close64(torch.cat(outs, 1), whole, what=mode)
    assert_states_close(state, whole_state, what=mode)


def gradcheck_call(kind, args, kw, carried, start, stop, **call):
    """gradcheck (float64) of one call on tokens start..stop-1 w.r.t. the tokens, eta,
    LayerNorm, token_scale and every tensor of the state reached after the first ``carried``
    tokens (start weights and gradient sums when that is mid-mini-batch)."""
    if carried:
        _, state = OPS[kind](*(x[:, :carried] for x in args), output_final_state=True, **kw)
        kw["initial_state"] = state_tree.map_tensors(torch.Tensor.detach, state)
    init, layout = state_tree.flatten(kw.pop("initial_state"))
    ln_w, ln_b, tau = kw.pop("ln_weight"), kw.pop("ln_bias"), kw.pop("token_scale")
    inputs = [x.clone().requires_grad_() for x in (*(x[:, start:stop] for x in args), ln_w, ln_b,
                                                      tau, *init)]

    def fn(q, k, v, eta, lw, lb, ts, *tensors):
        o, s = OPS[kind](q, k, v, eta, initial_state=state_tree.unflatten(list(tensors), layout),
                         ln_weight=lw, ln_bias=lb, token_scale=ts, output_final_state=True,
                         **call, **kw)
        return o, *state_tree.tensors(s)

    return torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6)


STEP_CASES = [
    (kind, b, ln, res, bias, tau)
    for kind, b, ln, res, bias, tau in itertools.product(
        ["linear", "mlp"], [1, 4, 16], [True, False], [True, False], [True, False],
        ["rand", "per-head"])
]


@pytest.mark.parametrize(
    "kind,b,ln,res,bias,tau", STEP_CASES,
    ids=[f"{k}-b{b}-{'ln' if ln else 'noln'}-{'res' if r else 'nores'}-"
         f"{'bias' if bi else 'nobias'}-{t}" for k, b, ln, r, bi, t in STEP_CASES])
def test_decoding_steps_equal_naive_whole(kind, b, ln, res, bias, tau):
    """The T = 1 form of mode="dual" (ops/ttt/step.py), fed token by token with the state
    carried across mini-batch boundaries (T = 13 > b), equals the naive form on the whole
    sequence: outputs and final state. Batch-1 initial weights broadcast over B = 2; Dk != Dv
    without the residual."""
    Dv = 5 if res else 6
    args, kw = make_case(kind, b=b, ln=ln, residual=res, bias=bias, tau=tau, Dv=Dv, seed=7)
    kw["initial_state"] = tuple(None if w is None else w[:1] for w in kw["initial_state"])
    ref, ref_state = OPS[kind](*args, mode="naive", output_final_state=True, **kw)
    outs, state = [], kw.pop("initial_state")
    for t in range(13):
        o, state = OPS[kind](*(x[:, t:t + 1] for x in args), initial_state=state,
                             output_final_state=True, **kw)
        outs.append(o)
    assert_close64(torch.cat(outs, 1), ref, what="steps")
    assert_states_close(state, ref_state, what="steps")


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("pos", [0, 1], ids=["fresh", "mid-minibatch"])
def test_decoding_step_gradcheck(kind, pos):
    """gradcheck of one decoding step (float64) w.r.t. the token, eta, LayerNorm, token_scale
    and every carried tensor (start weights and gradient sums when mid-mini-batch)."""
    args, kw = make_case(kind, B=1, T=2, H=2, Dk=2, Dv=2, b=3, seed=9)
    assert gradcheck_call(kind, args, kw, pos, pos, pos + 1)


def test_mid_minibatch_state_layout():
    """A call ending inside a mini-batch returns a TTTState: the mini-batch's start weights, the
    rows of its pos tokens and pos; its weights() are W_0 - tau_pos S, checked against the
    weights at the boundary of a call whose remaining tokens learn nothing (eta = 0) with
    tau_pos moved to the last place. A call ending on a boundary returns just (W, b)."""
    args, kw = make_case("linear", T=6, b=4)
    _, state = ttt_linear(*args, output_final_state=True, **kw)
    assert isinstance(state, TTTState) and state.pos == 2
    assert [r.shape for r in state.rows] == [(2, 3, 2, 5), (2, 3, 2, 5)]
    tau = kw["token_scale"]
    _, W4 = ttt_linear(*(x[:, :4] for x in args), output_final_state=True, **kw)
    q, k, v, eta = (torch.cat([x[:, 4:], x[:, :2]], 1) for x in args)
    eta = torch.cat([eta[:, :2], torch.zeros_like(eta[:, 2:])], 1)
    moved = tau.clone()
    moved[3] = tau[1]
    _, boundary = ttt_linear(q, k, v, eta, output_final_state=True,
                             **dict(kw, token_scale=moved, initial_state=W4))
    assert len(boundary) == 2
    assert_states_close(state.weights(tau), boundary)
    _, state = ttt_mlp(*make_case("mlp", T=5, b=4)[0], output_final_state=True,
                       **make_case("mlp", T=5, b=4)[1])
    assert isinstance(state, TTTState) and state.pos == 1 and len(state.rows) == 4


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_batch1_initial_state_broadcasts(kind):
    args, kw = make_case(kind, B=3)
    kw["initial_state"] = tuple(w[:1] for w in kw["initial_state"])
    o, state = OPS[kind](*args, output_final_state=True, **kw)
    expanded = dict(kw, initial_state=tuple(w.expand(3, *w.shape[1:]) for w in kw["initial_state"]))
    o2, state2 = OPS[kind](*args, output_final_state=True, **expanded)
    assert_close64(o, o2)
    assert_states_close(state, state2)
    assert state.start[0].shape[0] == 3


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("mode", ["primal", "dual"])
def test_gradients_match_naive(kind, mode):
    """Gradients w.r.t. q, k, v, eta, the initial weights, LayerNorm and token_scale."""
    args, kw = make_case(kind, B=1, T=7, H=2, Dk=3, Dv=3, b=3)
    leaves = [*args, *kw["initial_state"], kw["ln_weight"], kw["ln_bias"], kw["token_scale"]]
    grads = {}
    for m in ("naive", mode):
        for x in leaves:
            x.requires_grad_(True)
            x.grad = None
        o, state = OPS[kind](*args, mode=m, output_final_state=True, **kw)
        (o.square().sum() + sum(s.sum() for s in state_tree.tensors(state))).backward()
        grads[m] = [x.grad.clone() for x in leaves]
    for i, (a, b) in enumerate(zip(grads["naive"], grads[mode])):
        assert_close64(b, a, atol=1e-9, what=f"grad of leaf {i}")


DUAL_FORMS = [("linear", "autograd"), ("mlp", "scan"), ("mlp", "traced")]


@pytest.mark.parametrize(("kind", "form"), DUAL_FORMS, ids=[f"{k}-{f}" for k, f in DUAL_FORMS])
@pytest.mark.parametrize("group", [None, 2], ids=["whole", "checkpointed"])
@pytest.mark.parametrize("full", [True, False], ids=["ln-bias", "plain"])
def test_dual_forms_with_gradients_from_a_mid_minibatch_carry_equal_naive(
        kind, form, group, full, monkeypatch):
    """The dual forms that record gradients, continued from a state inside a mini-batch (start
    weights and carried gradient sums, reached by the naive form): outputs, final state and the
    gradients w.r.t. the tokens, the start weights and the gradient sums equal the naive form's. ``autograd``:
    TTT-Linear's scan under autograd (what torch.compile traces too); ``scan``: TTT-MLP's
    hand-written backward (mlp_scan.py); ``traced``: ``_ttt_mlp_dual_traced``, what
    torch.compile runs for TTT-MLP (put in the dispatch table here, so it runs eagerly;
    tests/ops/test_compile.py compiles both)."""
    if form == "traced":
        monkeypatch.setitem(_KERNELS["mlp"], "dual", _ttt_mlp_dual_traced)
    args, kw = make_case(kind, B=2, T=15, H=2, Dk=4, Dv=3, b=4, ln=full, residual=False,
                         bias=full, seed=11)
    _, state = OPS[kind](*(x[:, :6] for x in args), mode="naive", output_final_state=True, **kw)
    assert state[-1] == 2  # two tokens into the mini-batch: gradient sums carried
    results = {}
    for mode in ("naive", "dual"):
        rest = [x[:, 6:].clone().requires_grad_() for x in args]
        carried = [s.clone().requires_grad_() if isinstance(s, torch.Tensor) else s for s in state]
        o, final = OPS[kind](*rest, **{**kw, "initial_state": tuple(carried)}, mode=mode,
                             output_final_state=True, checkpoint_group=group)
        loss = o.square().sum() + sum(x.square().sum() for x in final if torch.is_tensor(x))
        n = 2 if kind == "linear" else 4  # the leading current weights are implied by the rest
        leaves = rest + [s for s in carried[n:] if torch.is_tensor(s)]
        results[mode] = (o, final, torch.autograd.grad(loss, leaves))
    (o_ref, s_ref, g_ref), (o, s, g) = results["naive"], results["dual"]
    assert_close64(o, o_ref, what=form)
    assert_states_close([x.detach() if torch.is_tensor(x) else x for x in s],
                        [x.detach() if torch.is_tensor(x) else x for x in s_ref], what=form)
    for i, (a, b) in enumerate(zip(g, g_ref)):
        assert_close64(a, b, atol=1e-9, what=f"{form} grad of leaf {i}")


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("mode", ["primal", "dual"])
@pytest.mark.parametrize("carried", [False, True], ids=["fresh", "carried-mid-minibatch"])
def test_gradcheck(kind, mode, carried):
    """torch.autograd.gradcheck (float64) on B1-T5-H1-D2, mini-batch 2, everything switched on;
    ``carried`` starts from a mid-mini-batch state so the carried sums are differentiated too."""
    args, kw = make_case(kind, B=1, T=5, H=1, Dk=2, Dv=2, b=2, seed=5)
    assert gradcheck_call(kind, args, kw, 1 if carried else 0, 0, 5, mode=mode)


def test_inner_gradient_formula_matches_autograd():
    """docs/maths.md 2.2's dl/dZ through the LayerNorm equals autograd of
    1/2 ||LN(Z) - target||^2."""
    gen = torch.Generator().manual_seed(2)
    Z = rand(2, 3, 4, 7, gen=gen).requires_grad_()
    target, w, b = rand(2, 3, 4, 7, gen=gen), 1 + rand(3, 7, gen=gen, scale=0.5), rand(3, 7, gen=gen)
    ln = F.layer_norm(Z, (7,), eps=1e-6) * w[:, None] + b[:, None]
    (auto,) = torch.autograd.grad(0.5 * (ln - target).square().sum(), Z)
    assert_close64(loss_grad(Z.detach(), target, w, b), auto)
    x = rand(50, gen=gen, scale=3.0).requires_grad_()
    (auto,) = torch.autograd.grad(gelu(x).sum(), x)
    assert_close64(gelu_grad(x.detach()), auto)


@pytest.mark.parametrize("mode", MODES)
def test_minibatch_1_is_the_delta_rule(mode):
    """Bare TTT-Linear (no LN, no residual, no bias, tau = 1) with b = 1 takes one GD step on
    1/2 ||k W - v||^2 per token: W_t = W_{t-1} + k_t^T eta_t (v_t - k_t W_{t-1}), the delta rule
    with beta = eta, read after write."""
    gen = torch.Generator().manual_seed(4)
    B, T, H, Dk, Dv = 2, 11, 3, 4, 5
    q, k, v = rand(B, T, H, Dk, gen=gen), rand(B, T, H, Dk, gen=gen), rand(B, T, H, Dv, gen=gen)
    eta = 0.5 * torch.rand(B, T, H, generator=gen, dtype=F64)
    W0 = rand(B, H, Dk, Dv, gen=gen)
    o, (W, b) = ttt_linear(q, k, v, eta, initial_state=(W0, None), mini_batch_size=1, mode=mode,
                           output_final_state=True)
    ref, S = delta_rule(q, k, v, eta, initial_state=W0, output_final_state=True, mode="naive")
    assert_close64(o, ref)
    assert_close64(W, S)
    assert b is None


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("b", [13, 20], ids=["b=T", "b>T"])
def test_one_minibatch_is_linear_attention(mode, b):
    """With W_0 = 0 and every gradient taken at W_0, W_t = -sum_j eta_j grad_j = sum_j eta_j
    k_j^T v_j: bare TTT-Linear is un-normalised causal linear attention with keys scaled by eta."""
    gen = torch.Generator().manual_seed(6)
    B, T, H, Dk, Dv = 2, 13, 3, 4, 5
    q, k, v = rand(B, T, H, Dk, gen=gen), rand(B, T, H, Dk, gen=gen), rand(B, T, H, Dv, gen=gen)
    eta = torch.rand(B, T, H, generator=gen, dtype=F64)
    W0 = torch.zeros(1, H, Dk, Dv, dtype=F64)
    o, _ = ttt_linear(q, k, v, eta, initial_state=(W0, None), mini_batch_size=b, mode=mode)
    ref, _ = linear_attn(q, k * eta.unsqueeze(-1), v, mode="naive")
    assert_close64(o, ref)


def _inner_loss(W, b, k, v, ln_w, ln_b):
    """1/2 ||LN(k W + b) - (v - k)||^2 per token and head: k, v [B, H, D] -> [B, H]."""
    z = torch.einsum("bhd,bhde->bhe", k, W) + b
    z = F.layer_norm(z, z.shape[-1:], eps=1e-6) * ln_w + ln_b
    return 0.5 * (z - (v - k)).square().sum(-1)


def test_inner_loss_decreases_after_the_update():
    """With a small eta, each token's own loss is lower at the weights after its update than at
    the weights before (b = 1, LayerNorm and residual on)."""
    args, kw = make_case("linear", B=2, T=9, H=3, Dk=6, Dv=6, b=1, tau="ones", seed=7)
    q, k, v, _ = args
    eta = torch.full(q.shape[:3], 0.02, dtype=F64)
    state = kw["initial_state"]
    for t in range(9):
        _, new = ttt_linear(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], eta[:, t:t + 1],
                            initial_state=state, ln_weight=kw["ln_weight"], ln_bias=kw["ln_bias"],
                            residual=True, mini_batch_size=1, output_final_state=True)
        before = _inner_loss(*state, k[:, t], v[:, t], kw["ln_weight"], kw["ln_bias"])
        after = _inner_loss(*new, k[:, t], v[:, t], kw["ln_weight"], kw["ln_bias"])
        assert (after < before).all(), f"token {t}: {after} >= {before}"
        state = new


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_low_precision_inputs_keep_float32_states(kind, dtype):
    args, kw = make_case(kind, b=4)
    low = [x.to(dtype) for x in args]
    kw = dict(kw, ln_weight=kw["ln_weight"].to(dtype), ln_bias=kw["ln_bias"].to(dtype))
    o, state = OPS[kind](*low, output_final_state=True, **kw)
    assert o.dtype == dtype
    assert all(s.dtype == torch.float32 for s in state_tree.tensors(state))
    ref, _ = OPS[kind](*(x.double() for x in low), **dict(
        kw, ln_weight=kw["ln_weight"].double(), ln_bias=kw["ln_bias"].double()))
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    assert (o.double() - ref).abs().max().item() < tol * max(1.0, ref.abs().max().item())


def test_no_final_state_unless_asked():
    args, kw = make_case("linear")
    assert ttt_linear(*args, **kw)[1] is None


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("group", [1, 2, 3])
@pytest.mark.parametrize("bias", [True, False])
def test_checkpoint_group_gives_identical_outputs_states_and_gradients(kind, group, bias):
    """Recomputing the scan in groups (docs/maths.md 2.6) changes nothing: T = 13 with b = 4 leaves
    a partial last mini-batch, and the second call starts inside a mini-batch (carried sums)."""
    op = ttt_linear if kind == "linear" else ttt_mlp
    (q, k, v, eta), kw = make_case(kind, bias=bias, seed=40)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, eta)]
    results = {}
    for g in (None, group):
        xs = [x.detach().clone().requires_grad_() for x in leaves]
        o1, s1 = op(*(x[:, :6] for x in xs), output_final_state=True, checkpoint_group=g, **kw)
        kw2 = {**kw, "initial_state": s1}
        o2, s2 = op(*(x[:, 6:] for x in xs), output_final_state=True, checkpoint_group=g, **kw2)
        loss = o1.square().sum() + o2.square().sum() + sum(t.sum() for t in s2 if torch.is_tensor(t))
        results[g] = (torch.cat([o1, o2], 1), s2, torch.autograd.grad(loss, xs))
    (o_ref, s_ref, g_ref), (o, s, g) = results[None], results[group]
    assert torch.equal(o, o_ref)
    assert_states_close(s, s_ref, atol=0.0, what="checkpointed")
    for a, b in zip(g, g_ref):
        assert torch.equal(a, b)


def test_checkpoint_group_must_be_a_positive_int():
    (q, k, v, eta), kw = make_case("linear")
    for bad in (0, -2, 1.5, True):
        with pytest.raises((ValueError, TypeError), match="checkpoint_group"):
            ttt_linear(q, k, v, eta, checkpoint_group=bad, **kw)


@pytest.mark.parametrize("bias", [True, False], ids=["ln-bias", "ln-no-bias"])
def test_loss_grad_fused_inference_path_equals_the_differentiable_one(bias):
    """Without autograd loss_grad takes ATen's fused LayerNorm kernels; with it, the explicit
    expression. Both are dl/dZ of 1/2 ||LN(Z) - target||^2 (float64, per-head gamma/beta)."""
    g = torch.Generator().manual_seed(3)
    z, target = (torch.randn(2, 3, 5, 7, generator=g, dtype=torch.float64) for _ in range(2))
    w = torch.randn(3, 7, generator=g, dtype=torch.float64)
    b = torch.randn(3, 7, generator=g, dtype=torch.float64) if bias else None
    with torch.no_grad():
        fused = loss_grad(z, target, w, b)
    zg = z.clone().requires_grad_()
    explicit = loss_grad(zg, target, w, b)
    # the oracle: autograd's gradient of the loss itself
    y = F.layer_norm(zg, (7,), eps=1e-6) * w.unsqueeze(1) + (0 if b is None else b.unsqueeze(1))
    (oracle,) = torch.autograd.grad(0.5 * (y - target).square().sum(), zg)
    assert_close64(fused, oracle)
    assert_close64(explicit.detach(), oracle)


@pytest.mark.parametrize("kind", ["linear", "mlp"])
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "autograd"])
def test_dual_single_sequence_single_head_leaves_inputs_untouched(kind, grad):
    """B = H = 1 with T a multiple of b: the step-major layout of v is a view of v itself, so
    the residual target must not be formed in place; dual still equals naive."""
    args, kw = make_case(kind, B=1, T=12, H=1, Dk=4, Dv=4, b=4, residual=True)
    before = [x.clone() for x in args]
    if grad:
        args = tuple(x.clone().requires_grad_() for x in args)
    o, state = OPS[kind](*args, mode="dual", output_final_state=True, **kw)
    ref, ref_state = OPS[kind](*(x.detach() for x in args), mode="naive",
                               output_final_state=True, **kw)
    for x, x0 in zip(args, before):
        assert torch.equal(x.detach(), x0)
    assert_close64(o.detach(), ref, what="dual")
    assert_states_close([s.detach() if isinstance(s, torch.Tensor) else s for s in state],
                        ref_state, what="dual")


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_naive_under_no_grad_with_a_grad_requiring_broadcast_state(kind):
    """The oracle under torch.no_grad with an initial state of batch 1 that requires grad (the
    broadcast view over B is then made in no-grad mode, which autograd cannot differentiate
    through: the inner gradient must be taken on detached weights): equal to the dual form."""
    args, kw = make_case(kind, B=2, T=9, b=4)
    kw["initial_state"] = tuple(w[:1].clone().requires_grad_() for w in kw["initial_state"])
    with torch.no_grad():
        outs = {m: OPS[kind](*args, **kw, mode=m, output_final_state=True) for m in
                ("naive", "dual")}
    assert_close64(outs["naive"][0], outs["dual"][0])
    assert_states_close(outs["naive"][1], outs["dual"][1])
