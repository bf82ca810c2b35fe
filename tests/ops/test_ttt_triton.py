"""Triton kernels of the TTT dual form (ops/ttt/triton.py) run by the Triton CPU interpreter
against the float64 token-loop oracle (docs/maths.md 2.2-2.4), and the backend= dispatch of the
TTT ops and layers.

tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton; the ``kernels``
fixture checks that the kernels really are interpreted, and every kernel launch is counted
(``launches``), so that a call that fell back to PyTorch cannot pass. Interpreted kernels are
slow: sizes are tiny, but odd (T and b coprime, Dk != Dv where the residual allows it).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

pytest.importorskip("triton")

from fastweights import state_tree
from fastweights.layers import TTTLinear
from fastweights.ops import TTTState, ttt_linear, ttt_mlp
from fastweights.ops import backend as backends
from tests.helpers import CountedKernel as _Counted

F64 = torch.float64
TOL32 = 1e-4


@pytest.fixture(scope="module")
def kernels():
    from triton.runtime.interpreter import InterpretedFunction

    from fastweights.ops.ttt import triton as module
    from fastweights.ops.ttt import triton_regs

    if not all(isinstance(f, InterpretedFunction)
               for f in (module._linear_fwd_kernel, triton_regs._linear_fwd_regs_kernel)):
        pytest.fail("triton was imported before tests/conftest.py set TRITON_INTERPRET=1 "
                    "(or it is set to 0): these CPU tests need the Triton interpreter")
    return module


@pytest.fixture
def launches(kernels, monkeypatch) -> Counter:
    """Launches per kernel (name without the leading underscore and ``_kernel``) of
    ops/ttt/triton.py and triton_regs.py (the register-resident forward, ``linear_fwd_regs``)."""
    from fastweights.ops.ttt import triton_regs

    counts: Counter = Counter()
    for module in (kernels, triton_regs):
        for name in [n for n in vars(module) if n.endswith("_kernel")]:
            monkeypatch.setattr(module, name, _Counted(getattr(module, name),
                                                       name.strip("_").removesuffix("_kernel"),
                                                       counts))
    return counts


# TTT-Linear's two forward kernels by FASTWEIGHTS_TTT_FWD's values (ops/ttt/triton_regs.py)
FWD = {"stream": "linear_fwd", "regs": "linear_fwd_regs"}


@pytest.fixture(params=list(FWD))
def fwd(request, monkeypatch) -> str:
    """Each forward kernel in turn, chosen by FASTWEIGHTS_TTT_FWD: the name it counts under."""
    monkeypatch.setenv("FASTWEIGHTS_TTT_FWD", request.param)
    return FWD[request.param]


def default_fwd(D: int) -> str:
    """The forward kernel a call with head size D runs without FASTWEIGHTS_TTT_FWD under the
    interpreter (sm_80's choice)."""
    from fastweights.ops.ttt.triton_regs import regs_config

    return FWD["regs" if regs_config(80, torch.bfloat16, D) else "stream"]


@pytest.fixture
def on_gpu(monkeypatch):
    """The dispatcher sees CPU tensors as CUDA ones (the interpreter runs the kernels)."""
    monkeypatch.setattr(backends, "_on_cuda", lambda q: True)
    monkeypatch.setattr(backends, "fla_ops", lambda: None)
    monkeypatch.setattr(backends, "_trials", {})  # the automatic choice's trial runs afresh
    monkeypatch.delenv("FASTWEIGHTS_BACKEND", raising=False)
    monkeypatch.delenv("FASTWEIGHTS_TRITON", raising=False)
    monkeypatch.delenv("FASTWEIGHTS_TTT_FWD", raising=False)
    monkeypatch.delenv("FASTWEIGHTS_TTT_BWD", raising=False)


@pytest.fixture
def exact(kernels, on_gpu, monkeypatch):
    """``on_gpu``, and the dispatcher also sends float32 inputs and odd head sizes to the
    kernels (it leaves them to PyTorch on a GPU, having no spill-free tiling for them; the
    interpreter runs them exactly), so that the public ops can be compared with the float64
    oracle on odd sizes."""
    monkeypatch.setattr(kernels, "supports", lambda op, dtype: True)
    monkeypatch.setattr(kernels, "HEAD_MULTIPLE", 1)
    monkeypatch.setattr(kernels, "BACKWARD_OPS", kernels.OPS)



def case(B=1, T=11, H=2, Dk=5, Dv=5, b=4, ln=True, bias=True, seed=0, kind="linear"):
    """float64 inputs of one TTT-Linear (or ``kind`` "mlp") call: (q, k, v, eta), and the
    keyword arguments (initial state, LayerNorm, token scales [H, b] with a zero)."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, Dk, generator=g, dtype=F64) for _ in range(2))
    v = torch.randn(B, T, H, Dv, generator=g, dtype=F64)
    eta = (0.1 + torch.rand(B, T, H, generator=g, dtype=F64)) / Dk
    shapes = [(Dk, Dv), (Dv,)] if kind == "linear" else [(Dk, 4 * Dk), (4 * Dk,), (4 * Dk, Dv),
                                                          (Dv,)]
    state = tuple(None if len(s) == 1 and not bias
                  else 0.3 * torch.randn(B, H, *s, generator=g, dtype=F64) for s in shapes)
    kw = {"initial_state": state, "mini_batch_size": b,
          "token_scale": (torch.rand(H, b, generator=g, dtype=F64) * 1.5 - 0.2).clamp_min(0)}
    if ln:
        kw["ln_weight"] = 1.0 + 0.3 * torch.randn(H, Dv, generator=g, dtype=F64)
        kw["ln_bias"] = 0.3 * torch.randn(H, Dv, generator=g, dtype=F64)
    return (q, k, v, eta), kw


def leaves(args, kw, dtype):
    """Copies of every tensor input in ``dtype`` that require gradients (states and
    parameters in float32 or float64, q, k, v, eta in ``dtype``); None stays None."""
    pdtype = F64 if dtype == F64 else torch.float32

    def leaf(x, d):
        return None if x is None else x.detach().to(d).requires_grad_()

    args = [leaf(x, dtype) for x in args]
    kw = dict(kw)
    kw["initial_state"] = state_tree.map_tensors(lambda x: leaf(x, pdtype), kw["initial_state"])
    for n in ("ln_weight", "ln_bias", "token_scale"):
        if n in kw:
            kw[n] = leaf(kw[n], pdtype)
    return args, kw


def inputs_of(args, kw):
    return [x for x in [*args, *state_tree.tensors(kw["initial_state"]), kw.get("ln_weight"),
                        kw.get("ln_bias"), kw["token_scale"]]
            if isinstance(x, torch.Tensor) and x.requires_grad]


def loss(o, state, gen_seed=5):
    """A random linear function of the output and of every tensor of the final state."""
    g = torch.Generator().manual_seed(gen_seed)
    total = (o.double() * torch.randn(o.shape, generator=g, dtype=F64)).sum()
    for x in state_tree.tensors(state):
        if x.is_floating_point():
            total = total + (x.double() * torch.randn(x.shape, generator=g, dtype=F64)).sum()
    return total


def run(op, args, kw, dtype, **extra):
    """(o, final state, gradients of every input) of one call with inputs in ``dtype``."""
    a, k = leaves(args, kw, dtype)
    o, state = op(*a, output_final_state=True, **k, **extra)
    loss(o, state).backward()
    return o, state, [x.grad for x in inputs_of(a, k)]


def max_err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


def assert_matches(got, want, tol, what):
    o, state, grads = got
    ro, rstate, rgrads = want
    assert o.dtype == torch.float32 or o.dtype != F64, what
    assert max_err(o, ro) <= tol * max(1.0, ro.abs().max().item()), f"{what} o"
    (tensors, layout), (rtensors, rlayout) = state_tree.flatten(state), state_tree.flatten(rstate)
    assert layout.same_as(rlayout), f"{what}: {layout} != {rlayout}"
    for i, (x, y) in enumerate(zip(tensors, rtensors)):
        assert x.dtype == torch.float32, f"{what} state[{i}] {x.dtype}"
        assert max_err(x, y) <= tol * max(1.0, y.abs().max().item()), f"{what} state[{i}]"
    assert len(grads) == len(rgrads)
    for i, (x, y) in enumerate(zip(grads, rgrads)):
        assert x is not None, f"{what}: no gradient for input {i}"
        scale = max(1.0, y.abs().max().item())
        assert max_err(x, y) <= tol * scale, f"{what} grad {i}: {max_err(x, y):.2e} ({scale:.1f})"


# (T, b, LayerNorm, residual, bias, Dk, Dv, checkpoint_group): T never a multiple of b (a
# partial last mini-batch: the state ends inside one), the backward in several segments.
LINEAR_CASES = [
    (11, 4, True, True, True, 5, 5, 2),
    (10, 3, False, False, False, 4, 6, 1),
    (7, 7, True, False, True, 6, 3, None),  # one full mini-batch, no tail
    (3, 4, True, True, False, 5, 5, None),  # no full mini-batch: only the partial one
]


@pytest.mark.parametrize("T,b,ln,res,bias,Dk,Dv,group", LINEAR_CASES,
                         ids=[f"T{c[0]}-b{c[1]}-{'ln' if c[2] else 'noln'}-"
                              f"{'res' if c[3] else 'nores'}-{'bias' if c[4] else 'nobias'}"
                              for c in LINEAR_CASES])
def test_linear_kernels_match_naive(launches, exact, fwd, T, b, ln, res, bias, Dk, Dv,
                                    group):
    """Output, final state and the gradients of q, k, v, eta, the initial weights and bias,
    the LayerNorm's weight and bias and the token scales: the kernels (either forward kernel:
    the backward reads its checkpoints) on float32 inputs against autograd through the
    float64 token loop."""
    args, kw = case(T=T, b=b, ln=ln, bias=bias, Dk=Dk, Dv=Dv)
    kw["residual"] = res
    want = run(ttt_linear, args, kw, F64, mode="naive")
    got = run(ttt_linear, args, kw, torch.float32, backend="triton", checkpoint_group=group)
    assert_matches(got, want, TOL32, "triton")
    segments = -(-(T // b) // (group or 16)) + (T % b > 0)
    assert launches == Counter({"qk": 1, fwd: 1, "linear_bwd_a": segments,
                                "linear_bwd_b": segments, "linear_bwd_c": segments}), launches


def test_linear_continues_a_state_inside_a_mini_batch(launches, exact, fwd):
    """A call that starts inside a mini-batch (the state of a call that ended inside one:
    its start weights and rows): its first tokens complete that mini-batch in PyTorch, the
    kernels run the rest; output, state and gradients (those of the carried rows too) equal
    the oracle's, and so does the whole sequence in one call."""
    args, kw = case(T=13, b=5, seed=2)
    kw["residual"] = True
    first = [x[:, :3] for x in args]
    _, mid = ttt_linear(*first, output_final_state=True, mode="naive", **kw)
    assert isinstance(mid, TTTState) and mid.pos == 3
    rest = [x[:, 3:] for x in args]
    kw_mid = {**kw, "initial_state": mid}
    want = run(ttt_linear, rest, kw_mid, F64, mode="naive")
    got = run(ttt_linear, rest, kw_mid, torch.float32, backend="triton")
    assert_matches(got, want, TOL32, "continued")
    assert launches[fwd] == 1 and launches["linear_bwd_b"] == 2


def test_linear_half_inputs(launches, on_gpu, fwd):
    """bfloat16 q, k, v: output in bfloat16 within its rounding of the oracle on the same
    rounded inputs; state in float32, to float32 accuracy."""
    args, kw = case(T=9, b=4, Dk=16, Dv=16, seed=3)
    kw["residual"] = True
    args = [x.bfloat16() if i < 3 else x for i, x in enumerate(args)]
    o, state = ttt_linear(*args, output_final_state=True, backend="triton", **kw)
    ro, rstate = ttt_linear(*(x.double() for x in args), output_final_state=True, mode="naive",
                            **kw)
    assert o.dtype == torch.bfloat16 and launches[fwd] == 1
    assert max_err(o, ro) <= 2 * torch.finfo(torch.bfloat16).eps * ro.abs().max().item()
    for x, y in zip(state, rstate):
        if isinstance(y, torch.Tensor):
            assert x.dtype == torch.float32 and max_err(x, y) <= TOL32 * y.abs().max().item()


def test_dispatch(launches, kernels, on_gpu, monkeypatch):
    """The automatic choice takes the kernels for half inputs on "CUDA" with head sizes that
    are multiples of 16 (float32 and other head sizes: PyTorch, no spill-free tiling), PyTorch
    for one-token calls, other modes, CPU tensors and backend="torch"; packed documents run
    one document at a time through the kernels, the forward by default the register-resident
    one (where it has a tiling); explicit choices that cannot run, and a FASTWEIGHTS_TTT_FWD
    that names no forward kernel, are ValueErrors naming the reason."""
    args, kw = case(T=6, b=4, Dk=16, Dv=16, seed=4)
    kw["residual"] = True
    half = [x.half() if i < 3 else x.float() for i, x in enumerate(args)]
    ttt_linear(*half, **kw)  # the automatic choice's trial call (once), then the call
    fwd = default_fwd(16)
    assert launches[fwd] == 2 and launches["linear_fwd"] + launches["linear_fwd_regs"] == 2
    assert backends._trials == {("ttt_linear", "triton", torch.float16, "cpu", False): None}
    ttt_linear(*(x.float() for x in args), **kw)  # float32: PyTorch
    odd, kw_odd = case(T=6, b=4, Dk=8, Dv=8, seed=4)
    ttt_linear(*(x.half() if x.dim() == 4 else x for x in odd), **kw_odd)  # Dk = 8: PyTorch
    ttt_linear(*(x[:, :1] for x in half), **kw)  # one token
    ttt_linear(*half, mode="primal", **kw)
    ttt_linear(*half, backend="torch", **kw)
    monkeypatch.setenv("FASTWEIGHTS_BACKEND", "torch")
    ttt_linear(*half, **kw)
    monkeypatch.delenv("FASTWEIGHTS_BACKEND")
    assert launches[fwd] == 2
    cu = torch.tensor([0, 2, 6])
    packed = {**kw, "initial_state": tuple(x[:1] for x in kw["initial_state"])}
    o, states = ttt_linear(*(x[:1] for x in half), cu_seqlens=cu, output_final_state=True,
                           **packed)
    ro, rstates = ttt_linear(*(x[:1].double() for x in half), cu_seqlens=cu,
                             output_final_state=True, mode="naive", **packed)
    assert launches[fwd] == 4 and len(states) == 2
    assert max_err(o, ro) <= 2 * torch.finfo(torch.float16).eps * ro.abs().max().item()
    for st, rst in zip(states, rstates):
        for x, y in zip(st, rst):
            if isinstance(y, torch.Tensor):
                assert max_err(x, y) <= TOL32 * max(1.0, y.abs().max().item())
    with pytest.raises(ValueError, match="float64"):
        ttt_linear(*args, backend="triton", **kw)
    with pytest.raises(ValueError, match="mini_batch_size <= 64"):
        ttt_linear(*half, backend="triton", **{**kw, "mini_batch_size": 65,
                                               "token_scale": None})
    with pytest.raises(ValueError, match="mode='primal'"):
        ttt_linear(*half, backend="triton", mode="primal", **kw)
    wide = [*half[:2], torch.zeros(1, 6, 2, 129, dtype=torch.float16), half[3]]
    with pytest.raises(ValueError, match="Dv <= 128"):
        ttt_linear(*wide, backend="triton", initial_state=(torch.zeros(1, 2, 16, 129), None),
                   mini_batch_size=4)
    with pytest.raises(ValueError, match="multiples of 16"):
        ttt_linear(*(x.half() if x.dim() == 4 else x for x in odd), backend="triton", **kw_odd)
    per_row = TTTState(tuple(torch.zeros(1, 2, *s) for s in ((16, 64), (64,), (64, 16), (16,))),
                       tuple(torch.zeros(1, 2, 4, d) for d in (16, 64, 64, 16)), torch.tensor([1]))
    mlp_state = (torch.zeros(1, 2, 16, 64), None, torch.zeros(1, 2, 64, 16), None)
    # automatic: TTT-MLP calls that record gradients run the kernels, forward and backward
    lnw = torch.ones(2, 16, requires_grad=True)
    o, _ = ttt_mlp(*half, initial_state=mlp_state, mini_batch_size=4, ln_weight=lnw)
    o.float().sum().backward()
    assert lnw.grad is not None and launches["mlp_fwd"] == 2 and launches["mlp_bwd_b"] == 2
    # an op outside BACKWARD_OPS (a backward kernel that spills) runs PyTorch when it records
    # gradients, and an explicit choice of triton is an error
    monkeypatch.setattr(kernels, "BACKWARD_OPS", ("ttt_linear",))
    with pytest.raises(ValueError, match="no spill-free tiling"):
        ttt_mlp(*half, backend="triton", initial_state=mlp_state, mini_batch_size=4,
                ln_weight=lnw)
    o, _ = ttt_mlp(*half, initial_state=mlp_state, mini_batch_size=4, ln_weight=lnw)
    o.float().sum().backward()
    assert launches["mlp_fwd"] == 2 and launches["mlp_bwd_b"] == 2
    with pytest.raises(ValueError, match="per-row places"):
        ttt_mlp(*(x[:, :1] for x in half), backend="triton", initial_state=per_row,
                mini_batch_size=4)
    assert backends.choose_backend("ttt_linear", half[0], None, "dual", 4) == "triton"
    assert launches[fwd] == 4
    monkeypatch.setenv("FASTWEIGHTS_TTT_FWD", "fast")
    with pytest.raises(ValueError, match="FASTWEIGHTS_TTT_FWD"):
        ttt_linear(*half, backend="triton", **kw)


MLP_CASES = [(11, 4, True, True, True, 5), (10, 3, False, False, False, 9), (8, 8, True, True, True, 6)]


@pytest.mark.parametrize("T,b,ln,res,bias,D", MLP_CASES,
                         ids=[f"T{c[0]}-b{c[1]}-{'ln' if c[2] else 'noln'}-"
                              f"{'res' if c[3] else 'nores'}-{'bias' if c[4] else 'nobias'}-D{c[5]}"
                              for c in MLP_CASES])
def test_mlp_forward_kernel_matches_naive(launches, exact, T, b, ln, res, bias, D):
    """TTT-MLP's forward kernel (no gradients recorded) on float32 inputs: output and final
    state (inside a mini-batch where T is not a multiple of b) against the float64 token loop;
    D = 9 has two hidden blocks (36 units); with gradients the automatic choice runs PyTorch."""
    args, kw = case(T=T, b=b, ln=ln, bias=bias, Dk=D, Dv=D, kind="mlp", seed=6)
    kw["residual"] = res
    want = ttt_mlp(*args, output_final_state=True, mode="naive", **kw)
    a32, kw32 = leaves(args, kw, torch.float32)
    with torch.no_grad():
        got = ttt_mlp(*a32, output_final_state=True, backend="triton", **kw32)
    assert launches == Counter(qk=1, mlp_fwd=1), launches
    assert_matches((*got, []), (*want, []), TOL32, "mlp")


# (T, b, LayerNorm, residual, bias, Dk, Dv, checkpoint_group), as LINEAR_CASES
MLP_GRAD_CASES = [
    (11, 4, True, True, True, 5, 5, 1),
    (10, 3, False, False, False, 4, 6, None),
    (7, 7, True, False, True, 3, 2, None),  # one full mini-batch, no tail
]


@pytest.mark.parametrize("T,b,ln,res,bias,Dk,Dv,group", MLP_GRAD_CASES,
                         ids=[f"T{c[0]}-b{c[1]}-{'ln' if c[2] else 'noln'}-"
                              f"{'res' if c[3] else 'nores'}-{'bias' if c[4] else 'nobias'}"
                              for c in MLP_GRAD_CASES])
def test_mlp_kernels_match_naive(launches, exact, T, b, ln, res, bias, Dk, Dv, group):
    """TTT-MLP under autograd in the kernels, forward and backward: output, final state and
    the gradients of q, k, v, eta, W1, b1, W2, b2, the LayerNorm's weight and bias and the
    token scales against autograd through the float64 token loop."""
    args, kw = case(T=T, b=b, ln=ln, bias=bias, Dk=Dk, Dv=Dv, kind="mlp", seed=8)
    kw["residual"] = res
    want = run(ttt_mlp, args, kw, F64, mode="naive")
    got = run(ttt_mlp, args, kw, torch.float32, backend="triton", checkpoint_group=group)
    assert_matches(got, want, TOL32, "mlp triton")
    seg = min(group or 16, T // b)
    starts = range(0, T // b, seg)
    recompute = sum(min(n + seg, T // b) - n > 1 for n in starts)
    segments = len(starts) + (T % b > 0)
    want_launches = Counter(qk=1, mlp_fwd=1, mlp_bwd_a=segments, mlp_bwd_b=segments,
                            mlp_recompute=recompute)
    assert launches == +want_launches, launches


def test_mlp_continues_a_state_inside_a_mini_batch(launches, exact):
    """A TTT-MLP call from a state that ends inside a mini-batch: the first tokens in PyTorch,
    the rest in the kernels; output, state and (under autograd) the gradients, those of the
    carried start weights and sums too, equal the oracle's."""
    args, kw = case(T=12, b=5, kind="mlp", seed=7)
    kw["residual"] = True
    _, mid = ttt_mlp(*(x[:, :2] for x in args), output_final_state=True, mode="naive", **kw)
    rest, kw_mid = [x[:, 2:] for x in args], {**kw, "initial_state": mid}
    want = ttt_mlp(*rest, output_final_state=True, mode="naive", **kw_mid)
    a32, kw32 = leaves(rest, kw_mid, torch.float32)
    with torch.no_grad():
        got = ttt_mlp(*a32, output_final_state=True, backend="triton", **kw32)
    assert launches["mlp_fwd"] == 1
    assert_matches((*got, []), (*want, []), TOL32, "mlp continued")
    want = run(ttt_mlp, rest, kw_mid, F64, mode="naive")
    got = run(ttt_mlp, rest, kw_mid, torch.float32, backend="triton")
    assert_matches(got, want, TOL32, "mlp continued, gradients")
    assert launches["mlp_fwd"] == 2 and launches["mlp_bwd_b"] == 2


def test_mlp_packed_documents(launches, exact):
    """Packed documents (``cu_seqlens``) under autograd: each document runs through the
    kernels, forward and backward, with gradients of every input equal to the float64 token
    loop's (documents of 6 and 5 tokens, b = 4: partial last mini-batches)."""
    args, kw = case(T=11, b=4, Dk=3, Dv=3, kind="mlp", seed=9)
    kw["residual"] = True

    def packed(*a, **k):  # the documents' final states in one tuple (the loss reads them)
        o, states = ttt_mlp(*a, cu_seqlens=torch.tensor([0, 6, 11]), **k)
        return o, tuple(x for st in states for x in st)

    want = run(packed, args, kw, F64, mode="naive")
    got = run(packed, args, kw, torch.float32, backend="triton")
    assert_matches(got, want, TOL32, "mlp packed")
    assert launches["mlp_fwd"] == 2 and launches["mlp_bwd_a"] == 4 and launches["mlp_bwd_b"] == 4


def test_layer_passes_backend_through(launches, exact):
    """TTTLinear(backend=...) hands its choice to the op: "triton" runs the kernels, with the
    output and the gradients of every parameter (the learned initial weights broadcast over a
    batch of two among them) equal to the PyTorch layer's to float32 accuracy; "torch" does not
    run them; a bad name is a ValueError."""
    torch.manual_seed(0)
    x = torch.randn(2, 7, 16)
    layer = TTTLinear(16, 2, mini_batch_size=4, backend="triton")
    ref = TTTLinear(16, 2, mini_batch_size=4, backend="torch")
    ref.load_state_dict(layer.state_dict())
    y, _ = layer(x)
    y_ref, _ = ref(x)
    assert launches[default_fwd(8)] == 1
    assert max_err(y, y_ref) <= TOL32
    w = torch.randn(y.shape)
    (y * w).sum().backward()
    (y_ref * w).sum().backward()
    assert launches["linear_bwd_b"] == 2
    for (name, p), p_ref in zip(layer.named_parameters(), ref.parameters()):
        assert max_err(p.grad, p_ref.grad) <= TOL32 * max(1.0, p_ref.grad.abs().max().item()), name
    with pytest.raises(ValueError, match="backend"):
        TTTLinear(16, 2, backend="cuda")
