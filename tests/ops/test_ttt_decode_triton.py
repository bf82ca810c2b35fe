"""The TTT decoding steps' Triton kernels (ops/ttt/triton_decode.py, TTT-Linear's and TTT-MLP's)
run by the Triton CPU interpreter: a sequence of one-token steps against the PyTorch step (ops/ttt/recurrent.py) and the
float64 token loop (docs/maths.md 2.2-2.4), and the step's backend= dispatch.

tests/conftest.py sets TRITON_INTERPRET=1; every launch of the kernel is counted, so that a
step that fell back to PyTorch cannot pass. Sizes are tiny (interpreted kernels are slow), T
and b coprime (the sequence ends inside a mini-batch after several commits).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

pytest.importorskip("triton")

from fastweights import state_tree
from fastweights.layers import TTTMLP, TTTLinear
from fastweights.ops import TTTState, ttt_linear, ttt_linear_step, ttt_mlp, ttt_mlp_step
from fastweights.ops import backend as backends
from tests.ops.test_ttt_triton import TOL32, _Counted, case, max_err, on_gpu  # noqa: F401

F64 = torch.float64
KINDS = ("linear", "mlp")
OPS = {"linear": ttt_linear, "mlp": ttt_mlp}
STEPS = {"linear": ttt_linear_step, "mlp": ttt_mlp_step}


@pytest.fixture(scope="module")
def decode_module():
    from triton.runtime.interpreter import InterpretedFunction

    from fastweights.ops.ttt import triton_decode as module

    if not isinstance(module._linear_decode_kernel, InterpretedFunction):
        pytest.fail("triton was imported before tests/conftest.py set TRITON_INTERPRET=1")
    return module


@pytest.fixture
def launches(decode_module, monkeypatch) -> Counter:
    counts: Counter = Counter()
    for kind in KINDS:
        name = f"_{kind}_decode_kernel"
        monkeypatch.setattr(decode_module, name, _Counted(getattr(decode_module, name),
                                                          f"{kind}_decode", counts))
    return counts


@pytest.fixture
def exact(decode_module, on_gpu, monkeypatch):  # noqa: F811
    """``on_gpu``, and float32 inputs and any head size go to the kernels too (the interpreter
    runs them exactly; on a GPU the dispatcher leaves them to PyTorch)."""
    from fastweights.ops.ttt import triton as dual

    monkeypatch.setattr(decode_module, "supports", lambda op, dtype: True)
    monkeypatch.setattr(dual, "HEAD_MULTIPLE", 1)


def steps(args, kw, dtype, kind="linear", **extra):
    """Every output [B, T, H, Dv] and the state after decoding the T tokens of ``args`` one
    at a time from ``kw``'s initial state with ``ttt_linear_step`` (or ``kind``'s)."""
    q, k, v, eta = (x.to(dtype) for x in args)
    pdtype = torch.float32 if dtype != F64 else F64

    def p(x):
        return None if x is None else x.to(pdtype)

    state = tuple(p(x) for x in kw["initial_state"])
    outs = []
    for t in range(q.shape[1]):
        o, state = STEPS[kind](
            *(x[:, t:t + 1] for x in (q, k, v, eta)), state=state,
            ln_weight=p(kw.get("ln_weight")), ln_bias=p(kw.get("ln_bias")),
            residual=kw["residual"], mini_batch_size=kw["mini_batch_size"],
            token_scale=p(kw["token_scale"]), **extra)
        outs.append(o)
    return torch.cat(outs, dim=1), state


def assert_close(x, y, tol, what):
    assert max_err(x, y) <= tol * max(1.0, y.abs().max().item()), f"{what}: {max_err(x, y):.2e}"


def assert_carries_match(got, want, tol: float, dtype=torch.float32) -> None:
    """Two TTT states (weights, or TTTStates) of one layout, their tensors close."""
    got_t, got_layout = state_tree.flatten(got)
    want_t, want_layout = state_tree.flatten(want)
    assert got_layout.same_as(want_layout), (got_layout, want_layout)
    for i, (x, y) in enumerate(zip(got_t, want_t)):
        assert x.dtype == dtype and x.shape == y.shape, (i, x.shape, y.shape)
        assert_close(x, y, tol, f"state[{i}]")


# (kind, T, b, LayerNorm, residual, bias, Dk, Dv): T not a multiple of b, b odd in some cases.
CASES = [
    ("linear", 11, 4, True, True, True, 16, 16),
    ("linear", 11, 5, False, False, False, 16, 32),
    ("linear", 10, 3, True, False, True, 32, 16),
    ("linear", 7, 5, True, False, False, 16, 16),
    ("mlp", 11, 4, True, True, True, 16, 16),
    ("mlp", 10, 3, False, False, False, 16, 32),
    ("mlp", 7, 5, True, False, True, 32, 16),
]


@pytest.mark.parametrize("kind,T,b,ln,res,bias,Dk,Dv", CASES,
                         ids=[f"{c[0]}-T{c[1]}-b{c[2]}-{'ln' if c[3] else 'noln'}-"
                              f"{'res' if c[4] else 'nores'}-{'bias' if c[5] else 'nobias'}-"
                              f"{c[6]}x{c[7]}" for c in CASES])
def test_decode_kernel_matches_step_and_naive(launches, exact, kind, T, b, ln, res, bias, Dk,
                                              Dv):
    """T one-token steps in the kernel (float32 inputs, one launch per step, none elsewhere):
    outputs and carry equal the PyTorch step's to float32 rounding, and the outputs and the op
    state of the carry equal the float64 token loop's (``ttt_linear`` / ``ttt_mlp`` mode
    "naive")."""
    args, kw = case(B=2, T=T, H=2, Dk=Dk, Dv=Dv, b=b, ln=ln, bias=bias, seed=T + b, kind=kind)
    kw["residual"] = res
    if bias:  # the learned initial weights' case: a batch of one, broadcast
        kw["initial_state"] = tuple(x[:1] for x in kw["initial_state"])
    o, carry = steps(args, kw, torch.float32, kind, backend="triton")
    assert launches == Counter({f"{kind}_decode": T}), launches
    ro, rcarry = steps(args, kw, torch.float32, kind, backend="torch")
    assert launches == Counter({f"{kind}_decode": T}), launches
    assert o.dtype == torch.float32
    assert_close(o, ro, 1e-5, "o vs the PyTorch step")
    assert_carries_match(carry, rcarry, 1e-5)
    want, wstate = OPS[kind](*args, output_final_state=True, mode="naive", **kw)
    assert_close(o, want, TOL32, "o vs naive")
    assert isinstance(carry, TTTState) and carry.pos == wstate.pos == T % b
    assert_carries_match(carry, state_tree.map_tensors(lambda x: x.float(), wstate), TOL32)


@pytest.mark.parametrize("kind", KINDS)
def test_decode_kernel_half_inputs(launches, on_gpu, kind):  # noqa: F811
    """bfloat16 q, k, v, eta (the layers' decoding on a GPU): the automatic choice takes the
    kernel (after one trial step); output in bfloat16 equal to the PyTorch step's on the same
    inputs to its rounding, carry in float32 to float32 rounding."""
    args, kw = case(B=2, T=6, H=2, Dk=16, Dv=16, b=4, seed=3, kind=kind)
    kw["residual"] = True
    o, carry = steps(args, kw, torch.bfloat16, kind)
    assert launches == Counter({f"{kind}_decode": 6 + 1}) and o.dtype == torch.bfloat16
    ro, rcarry = steps(args, kw, torch.bfloat16, kind, backend="torch")
    assert launches == Counter({f"{kind}_decode": 7})
    assert_close(o, ro, 2 * torch.finfo(torch.bfloat16).eps, "o")
    assert_carries_match(carry, rcarry, 1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_decode_dispatch(launches, decode_module, on_gpu, monkeypatch, kind):  # noqa: F811
    """The automatic choice leaves to PyTorch what the kernel does not take (float32 and
    float64 inputs, head sizes not multiples of 16, per-row places, gradients,
    backend="torch" or FASTWEIGHTS_BACKEND=torch, CPU tensors); an explicit backend="triton"
    there is a ValueError naming the reason. An op state inside a mini-batch (its rows) goes
    to the kernel."""
    name = f"{kind}_decode"
    args, kw = case(B=2, T=3, H=2, Dk=16, Dv=16, b=4, seed=4, kind=kind)
    kw["residual"] = True
    half = [x.half() for x in args]
    state = tuple(x.float() for x in kw["initial_state"])
    opts = {"ln_weight": kw["ln_weight"].float(), "ln_bias": kw["ln_bias"].float(),
            "residual": True, "mini_batch_size": 4, "token_scale": kw["token_scale"].float()}

    def step(xs, state=state, **extra):
        return STEPS[kind](*(x[:, :1] for x in xs), state=state, **{**opts, **extra})

    _, carry = step(half)  # trial and step
    assert launches == Counter({name: 2})
    step([x.float() for x in args])
    step(args)
    odd, kw_odd = case(B=2, T=3, H=2, Dk=8, Dv=8, b=4, seed=4, kind=kind)
    odd_opts = {"state": tuple(x.float() for x in kw_odd["initial_state"]),
                "ln_weight": kw_odd["ln_weight"].float(), "ln_bias": kw_odd["ln_bias"].float()}
    step([x.half() for x in odd], **odd_opts)

    def row0(items):
        return None if items is None else tuple(None if x is None else x[:1] for x in items)

    first = TTTState(row0(carry.start), row0(carry.rows), carry.pos)
    per_row = TTTState.stack([first, first], 4)
    step(half, state=per_row)
    _, mid = OPS[kind](*(x[:, :2].double() for x in args), output_final_state=True, **kw)
    mid = state_tree.map_tensors(lambda x: x.float(), mid)
    step(half, state=mid)  # an op state inside a mini-batch: its rows, on the kernel
    assert launches == Counter({name: 3})
    leaf = opts["ln_weight"].clone().requires_grad_()
    step(half, ln_weight=leaf)
    step(half, backend="torch")
    monkeypatch.setenv("FASTWEIGHTS_BACKEND", "torch")
    step(half)
    monkeypatch.delenv("FASTWEIGHTS_BACKEND")
    assert launches == Counter({name: 3})
    for xs, extra, match in (
            ([x.float() for x in args], {}, "no Triton tiling"),
            (args, {}, "float64"),
            ([x.half() for x in odd], odd_opts, "multiples of 16"),
            (half, {"state": per_row}, "per-row places"),
            (half, {"ln_weight": leaf}, "no backward"),
            (half, {"mini_batch_size": 65, "token_scale": None}, "mini_batch_size <= 64")):
        with pytest.raises(ValueError, match=match):
            step(xs, backend="triton", **extra)
    monkeypatch.setattr(backends, "_on_cuda", lambda q: q.is_cuda)  # CPU tensors as CPU
    step(half)
    with pytest.raises(ValueError, match="CUDA"):
        step(half, backend="triton")
    assert launches == Counter({name: 3})


@pytest.mark.parametrize("kind", KINDS)
def test_layer_decodes_through_the_kernel(launches, exact, kind):
    """TTTLinear / TTTMLP decoding after a prefill (the carry's rows then views of the
    prefill's keys): every step one launch, outputs equal those of the PyTorch layer's steps
    and of one forward over the whole sequence, to float32 accuracy; a layer made with
    backend="triton" decodes on the kernel too."""
    torch.manual_seed(0)
    x = torch.randn(2, 10, 32)
    cls = TTTLinear if kind == "linear" else TTTMLP
    layer = cls(32, 2, mini_batch_size=4)
    explicit = cls(32, 2, mini_batch_size=4, backend="triton")
    ref = cls(32, 2, mini_batch_size=4, backend="torch")
    for m in (explicit, ref):
        m.load_state_dict(layer.state_dict())
    with torch.no_grad():
        y_all, _ = ref(x)
        outs = {}
        for name, m in (("kernel", layer), ("explicit", explicit), ("torch", ref)):
            y, state = ref(x[:, :3])  # the prefill on PyTorch (the forward's kernels aside)
            ys = [y]
            for t in range(3, 10):
                y, state = m(x[:, t:t + 1], state)
                ys.append(y)
            outs[name] = torch.cat(ys, dim=1)
    assert launches == Counter({f"{kind}_decode": 2 * 7 + 1})  # one trial
    for name in ("kernel", "explicit"):
        assert_close(outs[name], outs["torch"], 1e-5, f"{name} vs torch steps")
        assert_close(outs[name], y_all, TOL32, f"{name} steps vs forward")


@pytest.mark.parametrize("kind", KINDS)
def test_kept_state_is_not_written(launches, exact, kind):
    """A carry the caller keeps continues as it was after the kernel stepped from it (the
    rows are copied into fresh buffers): two steps from one carry give the same output, and
    the carry's tensors are unchanged."""
    args, kw = case(B=1, T=4, H=2, Dk=16, Dv=16, b=4, seed=9, kind=kind)
    kw["residual"] = True
    one = {"ln_weight": kw["ln_weight"].float(), "ln_bias": kw["ln_bias"].float(),
           "residual": True, "mini_batch_size": 4, "token_scale": kw["token_scale"].float()}
    for t in (1, 3):  # a step inside the mini-batch and one that completes it
        _, carry = steps([x[:, :t] for x in args], kw, torch.float32, kind, backend="triton")
        kept = state_tree.tensors(carry)
        before = [x.clone() for x in kept]
        xs = [x[:, t:t + 1].float() for x in args]
        o1, c1 = STEPS[kind](*xs, state=carry, backend="triton", **one)
        o2, _ = STEPS[kind](*xs, state=carry, backend="triton", **one)
        assert (c1.pos if isinstance(c1, TTTState) else 0) == (t + 1) % 4
        assert torch.equal(o1, o2) and all(torch.equal(a, b) for a, b in zip(before, kept))
