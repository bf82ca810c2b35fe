"""TTT-Linear's resident forward (ops/ttt/triton_resident.py, ``FASTWEIGHTS_TTT_FWD=resident``:
W^T float32 in registers for the whole sequence, products with operands in the inputs' dtype)
and its resident backward kernels (``FASTWEIGHTS_TTT_BWD=resident``: the recompute/read-out
kernel with W^T resident, the sequential pass with dW resident) run by Triton's CPU interpreter, every launch counted (tests/ops/test_ttt_triton.py's
fixtures): against the float64 token loop with float32 inputs (float32 products, tight), with
bfloat16 inputs within the issue's bounds (outputs 1e-2, gradients 2e-2 of max |ref|), and
against a float64 model of its rounding (every operand rounded to bfloat16 as the kernel
rounds it), to which it must be much closer than to the oracle: that is what shows the
interpreter multiplies the operands the tensor cores would.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

pytest.importorskip("triton")

from fastweights.ops import ttt_linear
from fastweights.ops.ttt.common import LN_EPS
from tests.ops.test_ttt_triton import (  # noqa: F401 (fixtures)
    F64,
    LINEAR_CASES,
    TOL32,
    _Counted,
    assert_matches,
    case,
    exact,
    kernels,
    leaves,
    max_err,
    on_gpu,
    run,
)

BF16_OUT, BF16_GRAD = 1e-2, 2e-2  # the bounds, max |x - ref| / max |ref|


@pytest.fixture
def launches(kernels, on_gpu, monkeypatch) -> Counter:  # noqa: F811
    """Launches per kernel of ops/ttt/triton.py, triton_regs.py and triton_resident.py (the
    resident forward counts as ``linear_fwd_res``); FASTWEIGHTS_TTT_FWD=resident."""
    from fastweights.ops.ttt import triton_regs, triton_resident

    counts: Counter = Counter()
    for module in (kernels, triton_regs, triton_resident):
        for name in [n for n in vars(module) if n.endswith("_kernel")]:
            monkeypatch.setattr(module, name, _Counted(getattr(module, name),
                                                       name.strip("_").removesuffix("_kernel"),
                                                       counts))
    monkeypatch.setenv("FASTWEIGHTS_TTT_FWD", "resident")
    return counts


@pytest.fixture(params=["stream", "resident"])
def bwd(request, launches, monkeypatch) -> tuple[str, str]:
    """Each backward in turn, chosen by FASTWEIGHTS_TTT_BWD: the names its recompute/read-out
    kernel and its sequential pass count under (the resident ones: ops/ttt/triton_resident.py
    ``_linear_bwd_a_res_kernel``, ``_linear_bwd_b_res_kernel``)."""
    monkeypatch.setenv("FASTWEIGHTS_TTT_BWD", request.param)
    return {"stream": ("linear_bwd_a", "linear_bwd_b"),
            "resident": ("linear_bwd_a_res", "linear_bwd_b_res")}[request.param]


def backward_launches(bwd: tuple[str, str], n: int) -> Counter:
    """The launches of a backward in n segments (``bwd`` as the fixture's)."""
    return Counter({bwd[0]: n, bwd[1]: n, "linear_bwd_c": n})


def segments(T: int, b: int, group: int | None) -> int:
    return -(-(T // b) // (group or 16)) + (T % b > 0)


@pytest.mark.parametrize("T,b,ln,res,bias,Dk,Dv,group", LINEAR_CASES,
                         ids=[f"T{c[0]}-b{c[1]}-{'ln' if c[2] else 'noln'}-"
                              f"{'res' if c[3] else 'nores'}-{'bias' if c[4] else 'nobias'}"
                              for c in LINEAR_CASES])
def test_resident_matches_naive_float32(launches, exact, bwd, T, b, ln, res, bias,  # noqa: F811
                                        Dk, Dv, group):
    """Float32 inputs (float32 products): output, final state and every input's gradient (the
    backward kernels read the resident forward's checkpoints; either sequential backward
    pass, the streamed one or the resident one) against the float64 loop."""
    args, kw = case(T=T, b=b, ln=ln, bias=bias, Dk=Dk, Dv=Dv)
    kw["residual"] = res
    want = run(ttt_linear, args, kw, F64, mode="naive")
    got = run(ttt_linear, args, kw, torch.float32, backend="triton", checkpoint_group=group)
    assert_matches(got, want, TOL32, "resident")
    n = segments(T, b, group)
    assert launches == Counter({"qk": 1, "linear_fwd_res": 1}) + backward_launches(bwd, n), \
        launches


@pytest.mark.parametrize("fwd", ["resident", "stream"])
@pytest.mark.parametrize("D", [64, 128])
def test_resident_backward_head_sizes_float32(launches, exact, monkeypatch, fwd, D):  # noqa: F811
    """Both resident backward kernels (FASTWEIGHTS_TTT_BWD=resident) at the layers' head
    sizes, float32 inputs, b = 16, two full mini-batches and a partial one (T odd), every flag
    on, one mini-batch per checkpoint segment and two: output, state and every input's
    gradient against the float64 loop within 1e-4, from the checkpoints of either forward
    (the resident one, or the streamed one of ops/ttt/triton.py)."""
    monkeypatch.setenv("FASTWEIGHTS_TTT_FWD", fwd)
    monkeypatch.setenv("FASTWEIGHTS_TTT_BWD", "resident")
    args, kw = case(T=37, b=16, Dk=D, Dv=D, seed=3)
    kw["residual"] = True
    want = run(ttt_linear, args, kw, F64, mode="naive")
    forward = {"resident": "linear_fwd_res", "stream": "linear_fwd"}[fwd]
    for group, n in ((1, 3), (2, 2)):
        launches.clear()
        got = run(ttt_linear, args, kw, torch.float32, backend="triton", checkpoint_group=group)
        assert_matches(got, want, TOL32, f"resident backward, D {D}, group {group}")
        assert launches == Counter({"qk": 1, forward: 1}) + backward_launches(
            ("linear_bwd_a_res", "linear_bwd_b_res"), n), launches


def _bf16_case(D: int, T: int, seed: int, **kw_case):
    """A case with q, k, v, eta rounded to bfloat16 (the float64 oracle gets the same values)
    and weights scaled so that the products are not dominated by one term."""
    args, kw = case(T=T, b=16, Dk=D, Dv=D, seed=seed, **kw_case)
    kw["residual"] = True
    args = [x.bfloat16().double() for x in args]
    return args, kw


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return max_err(x, ref) / ref.abs().max().item()


@pytest.mark.parametrize("D", [16, 64, 128])
def test_resident_bfloat16_within_bounds(launches, on_gpu, bwd, D):  # noqa: F811
    """bfloat16 inputs, b = 16, two full mini-batches and a partial one, every flag on, at head
    sizes 16, 64 and 128 (the layers' tiles), either backward (streamed, or both resident
    kernels): outputs within 1e-2, final state within 1e-2 and every input's
    gradient within 2e-2 of max |ref| of the float64 loop on the same rounded inputs."""
    args, kw = _bf16_case(D, 40, seed=11)
    want = run(ttt_linear, args, kw, F64, mode="naive")
    got = run(ttt_linear, args, kw, torch.bfloat16, backend="triton", checkpoint_group=1)
    (o, state, grads), (ro, rstate, rgrads) = got, want
    assert o.dtype == torch.bfloat16 and _rel(o, ro) <= BF16_OUT, _rel(o, ro)
    for x, y in zip(state, rstate):
        if isinstance(y, torch.Tensor):
            assert x.dtype == torch.float32 and _rel(x, y) <= BF16_OUT, _rel(x, y)
    assert len(grads) == len(rgrads)
    for i, (x, y) in enumerate(zip(grads, rgrads)):
        assert _rel(x, y) <= BF16_GRAD, (i, _rel(x, y))
    assert launches == Counter({"qk": 1, "linear_fwd_res": 1}) + backward_launches(bwd, 3), \
        launches


def _r(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the kernel rounds an operand: to float32, then to the nearest bfloat16."""
    return x.float().bfloat16().double()


def resident_model(q, k, v, eta, W, bias, lnw, lnb, tau, b: int):
    """Float64 model of the resident forward's rounding, TTT-Linear's dual form with every
    product operand rounded to bfloat16 as the kernel rounds it (W each mini-batch, G, the
    scores E * A, -tau_b eta G; q and k are bfloat16 values already): (o, W, bias, S, s) for
    one head's [T, D] q, k, v (residual, LayerNorm and bias on), eta [T], W [D, D], bias [D],
    the LayerNorm's lnw, lnb [D], tau [b]; S, s the sums of a partial last mini-batch, as the
    state forms them: in float32 from the unrounded start weights."""
    T = q.shape[0]
    outs, S, s = [], None, None
    for n0 in range(0, T, b):
        K, Q, V, e = k[n0:n0 + b], q[n0:n0 + b], v[n0:n0 + b], eta[n0:n0 + b]
        m = K.shape[0]
        Wr = _r(W)
        zk = K @ Wr + bias
        mu = zk.mean(-1, keepdim=True)
        r = 1.0 / torch.sqrt((zk - mu).square().mean(-1, keepdim=True) + LN_EPS)
        xh = (zk - mu) * r
        g = lnw * (lnw * xh + lnb - (V - K))  # the LayerNorm's backward, as the kernel's
        G = r * (g - g.mean(-1, keepdim=True) - xh * (g * xh).mean(-1, keepdim=True))
        E = torch.tril(tau[:m, None] * e[None, :])
        A = Q @ K.T + 1.0
        zbar = Q @ Wr + bias - _r(E * A) @ _r(G)
        mu = zbar.mean(-1, keepdim=True)
        xo = (zbar - mu) / torch.sqrt((zbar - mu).square().mean(-1, keepdim=True) + LN_EPS)
        outs.append(Q + lnw * xo + lnb)
        hm = G * e[:, None]
        if m == b:
            W = W + K.T @ _r(-tau[b - 1] * hm)
            bias = bias - tau[b - 1] * hm.sum(0)
        else:  # the state's rows: formed in float32 from the start weights, unrounded
            zk = K @ W + bias
            mu = zk.mean(-1, keepdim=True)
            r = 1.0 / torch.sqrt((zk - mu).square().mean(-1, keepdim=True) + LN_EPS)
            xh = (zk - mu) * r
            g = lnw * (lnw * xh + lnb - (V - K))
            hm = r * (g - g.mean(-1, keepdim=True) - xh * (g * xh).mean(-1, keepdim=True))
            hm = hm * e[:, None]
            S, s = K.T @ hm, hm.sum(0)
    return torch.cat(outs), W, bias, S, s


def test_resident_bfloat16_is_its_rounding_model(launches, on_gpu):  # noqa: F811
    """bfloat16 inputs, D 128, two full mini-batches and a partial one:
    the kernel's state equals ``resident_model``'s (the same operand roundings in float64) to
    float32 accuracy, at least 30 times closer than to the float64 loop without them (a
    kernel that skipped or misplaced a rounding fails this; measured: 1e-7 against 2e-5 to
    3e-3), and its output is within one bfloat16 step of the model's."""
    D, T = 128, 40
    args, kw = _bf16_case(D, T, seed=12)
    q, k, v, eta = args
    W0, b0 = kw["initial_state"]
    lnw, lnb, tau = kw["ln_weight"], kw["ln_bias"], kw["token_scale"]
    with torch.no_grad():
        o, state = ttt_linear(*(x.bfloat16() if x.dim() == 4 else x.float() for x in args),
                              backend="triton", output_final_state=True,
                              **{**kw, "initial_state": tuple(x.float() for x in kw[
                                  "initial_state"]), "ln_weight": lnw.float(),
                                 "ln_bias": lnb.float(), "token_scale": tau.float()})
        ro, rstate = ttt_linear(*args, output_final_state=True, mode="naive", **kw)
    assert launches["linear_fwd_res"] == 1

    for h in range(q.shape[2]):
        mo, mW, mb, mS, ms = resident_model(q[0, :, h], k[0, :, h], v[0, :, h], eta[0, :, h],
                                            W0[0, h], b0[0, h], lnw[h], lnb[h], tau[h], 16)
        # the open mini-batch's start weights (W_0, b_0) and gradient sums (S, s)
        got = (o[0, :, h], *(x[0, h] for x in (*state.start, *state.sums())))
        want = (mo, mW, mb, mS, ms)
        oracle = (ro[0, :, h], *(x[0, h] for x in (*rstate.start, *rstate.sums())))
        # the output: bfloat16, stored with the interpreter's truncating cast: within one
        # bfloat16 step (2^-7 of the largest value) of the model's
        assert _rel(got[0].double(), want[0]) <= 2 ** -7, (h, _rel(got[0].double(), want[0]))
        # the float32 state: the model's to float32 accuracy, far closer than the oracle's
        for what, x, y, z in zip(("W", "bias", "S", "s"), got[1:], want[1:], oracle[1:]):
            assert _rel(x, y) <= 1e-6, (what, h, _rel(x, y))
            assert _rel(x, y) * 30 < _rel(x, z), (what, h, _rel(x, y), _rel(x, z))


def test_resident_backward_switch(monkeypatch):
    """FASTWEIGHTS_TTT_BWD: "resident" or "stream" (also unset or empty); another value is a
    ValueError naming it; "resident" on an sm_80 GPU is a ValueError saying why (the kernels'
    compiles spill there), before either resident backward kernel runs."""
    import triton

    from fastweights.ops.ttt import triton_resident as res

    for value, want in (("", "stream"), ("stream", "stream"), ("resident", "resident")):
        monkeypatch.setenv("FASTWEIGHTS_TTT_BWD", value)
        assert res.bwd_variant() == want
    monkeypatch.setenv("FASTWEIGHTS_TTT_BWD", "fast")
    with pytest.raises(ValueError, match="FASTWEIGHTS_TTT_BWD"):
        res.bwd_variant()
    monkeypatch.setenv("FASTWEIGHTS_TTT_BWD", "resident")
    monkeypatch.setattr(res, "_arch", lambda device: 80)
    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    with pytest.raises(ValueError, match=r"sm_90 or newer \(on sm_80"):
        res.launch_backward_a(None, torch.zeros(1))
    with pytest.raises(ValueError, match=r"sm_90 or newer \(on sm_80"):
        res.launch_backward_b(None, False, torch.zeros(1))
    monkeypatch.setenv("FASTWEIGHTS_TTT_BWD", "stream")
    assert res.launch_backward_a(None, torch.zeros(1)) is False
    assert res.launch_backward_b(None, False, torch.zeros(1)) is False
