"""The tile model of the TTT-MLP cluster backward's sequential pass (ops/ttt/cluster_bwd_model.py;
docs/gpu_ttt_kernels.md, "The backward's tile model (`ops/ttt/cluster_bwd_model.py`)") in place
of ops/ttt/triton.py's ``_mlp_bwd_b_kernel`` on the full segments of a whole ``ttt_mlp``
backward (the rest runs in the Triton kernels under the CPU interpreter): with float32
operands every input's gradient equals autograd through the float64 token loop, 1, 2 and 4
slices, several segments, every flag on and off; the model equals the kernel's own output per
launch (float32: the order of sums only); with bfloat16 operands the gradients stay within the
issue's bound of the float64 loop on the same rounded inputs.
"""

from __future__ import annotations

import pytest
import torch

from fastweights.ops import ttt_mlp
from fastweights.ops.ttt.cluster_bwd_model import bwd_b_model, mlp_bwd_b_cluster_model
from tests.ops.test_ttt_triton import (  # noqa: F401 (fixtures)
    TOL32,
    assert_matches,
    case,
    exact,
    kernels,
    launches,
    max_err,
    on_gpu,
    run,
)

F64 = torch.float64
BF16_GRAD = 2e-2  # the bound, max |x - ref| / max |ref|


def mlp_case(T, b, D, H=1, ln=True, ln_bias=True, b1=True, b2=True, residual=True, seed=3):
    """float64 inputs and keyword arguments of one TTT-MLP call (Dk = Dv = D, Dh = 4 D)."""
    args, kw = case(T=T, H=H, b=b, Dk=D, Dv=D, ln=ln, bias=True, seed=seed, kind="mlp")
    W1, c1, W2, c2 = kw["initial_state"]
    kw["initial_state"] = (W1, c1 if b1 else None, W2, c2 if b2 else None)
    if ln and not ln_bias:
        del kw["ln_bias"]
    kw["residual"] = residual
    # tau_b > 0: with tau_b = 0 the weights never change and most of the pass multiplies by 0
    assert kw["token_scale"][:, -1].min() > 0.1
    return args, kw


# (T, b, D, slice_units, checkpoint_group, H, flags): several full segments and a partial last
# mini-batch (on the kernel) except where said; C = 4 D / slice_units in 1, 2, 4
CASES = [
    (10, 3, 16, 16, 2, 2, {}),
    (17, 4, 16, 64, 3, 1, {"ln": False, "b1": False, "b2": False, "residual": False}),
    (7, 3, 32, 32, 1, 1, {"ln_bias": False, "b2": False}),
    (8, 4, 16, 32, 1, 1, {"b1": False, "residual": False}),  # no partial mini-batch
]
IDS = [f"T{c[0]}b{c[1]}D{c[2]}U{c[3]}g{c[4]}H{c[5]}-" + "-".join(f"no_{k}" for k in c[6])
       for c in CASES]


def _segments(T, b, group):
    NF = T // b
    seg = min(group, NF)
    return [(n, min(n + seg, NF)) for n in range(0, NF, seg)]


@pytest.mark.parametrize("T, b, D, U, group, H, flags", CASES, ids=IDS)
def test_model_is_the_token_loop_and_the_kernel(launches, exact, T, b, D, U, group, H,  # noqa: F811
                                                flags):
    """float32 operands, the model in place of the kernel on every full segment: the output,
    final state and every input's gradient (q, k, v, eta, W1, b1, W2, b2, the LayerNorm's
    weight and bias, the token scales) equal autograd through the float64 token loop within
    1e-4; and launch by launch, the kernel run on the same inputs gives the model's outputs
    (carried gradients, acc, dtau, the segment's dk, dv, deta) within 1e-5 of max(1, max |x|):
    in float32 the two differ only in the order of the sums."""
    args, kw = mlp_case(T, b, D, H, **flags)
    want = run(ttt_mlp, args, kw, F64, mode="naive")
    diffs: list = []
    with bwd_b_model(torch.float32, U, compare=diffs) as calls:
        got = run(ttt_mlp, args, kw, torch.float32, backend="triton", checkpoint_group=group)
    assert sorted(calls) == _segments(T, b, group)  # every full segment ran in the model
    assert launches["mlp_bwd_b"] == (T % b > 0) + len(calls)  # (the comparisons' launches)
    assert_matches(got, want, TOL32, "cluster bwd model")
    assert len(diffs) == len(calls)
    worst = {n: max(d[n] for d in diffs) for n in diffs[0]}
    assert max(worst.values()) <= 1e-5, worst


def test_bfloat16_operands(exact):  # noqa: F811
    """bfloat16 operands (q, k, v rounded to bfloat16 values first, given as float32), 2
    slices: every gradient within 2e-2 of max |ref| of the float64 token loop on the same
    inputs, and farther than float32 operands' 1e-4 (the roundings are there)."""
    args, kw = mlp_case(13, 4, 16, seed=7)
    q, k, v, eta = args
    args = (*(x.to(torch.bfloat16).to(F64) for x in (q, k, v)), eta)
    want = run(ttt_mlp, args, kw, F64, mode="naive")
    with bwd_b_model(torch.bfloat16, 32):
        got = run(ttt_mlp, args, kw, torch.float32, backend="triton", checkpoint_group=2)
    errs = [max_err(x, y) / y.abs().max().item() for x, y in zip(got[2], want[2])]
    assert max(errs) <= BF16_GRAD, errs
    assert max(errs) > TOL32, errs


def test_cluster_sums_run_in_slice_order_then_the_rest():
    """Both cluster sums add the slices' shares in order 0..C-1, then the terms every CTA holds:
    one token, 4 slices, X2 = gelu(16) = 16 and gelu'(16) = 1 exactly, shares 0, 1, 2^25,
    -2^25 of X2 D2 (with d2 = 2) and of dk's -(eta G1) D1^T (with the residual's dG2 = -2).
    In that order float32 gives xD2 = 2 (deta = -tau_b eta G2 xD2 = -2) and dk = -2; the
    rest first gives 4 (-4), slices in reverse 3 (-3)."""
    D, Dh, U, BB = 4, 16, 4, 16
    f = {"dtype": torch.float32}
    z = torch.zeros
    shares = torch.tensor([0.0, 1.0, 2.0 ** 25, -2.0 ** 25])
    dw1, dw2, db2 = z(1, D, Dh, **f), z(1, Dh, D, **f), z(1, D, **f)
    dw1[0, 0, ::U] = shares  # ce = -1, G1 = 1: dk's shares -D1
    dw2[0, ::U, 0] = shares / 16  # X2 = 16: xD2's shares
    db2[0, 0] = 2.0
    hs, vs = z(1, 1, 4, Dh, BB, **f), z(1, 1, 5, D, BB, **f)
    hs[0, 0, 0] = 16.0  # Z1
    hs[0, 0, 1, ::U, 0] = 1.0  # A (G1 = A gelu'(Z1))
    vs[0, 0, 0, 0, 0] = 1.0  # G2
    dk, deta = z(1, 1, 1, D, **f), z(1, 1, 1, **f)
    x = z(1, 1, 1, D, **f)
    mlp_bwd_b_cluster_model(
        x, x, x, torch.ones(1, 1, 1), torch.ones(1, 1), z(1, 1, BB, BB), None, None,
        z(1, D, Dh, **f), z(1, Dh, D, **f), dw1, z(1, Dh, **f), dw2, db2, hs, vs, z(1, 1, BB),
        z(1, 1, BB, BB), z(1, 2, D, **f), z(1, BB, **f), dk, z(1, 1, 1, D, **f), deta,
        1, 1, D, D, Dh, 1, 1, 0, 1, 1, 1, 0, has_b1=False, has_b2=True, has_ln=False,
        has_lnb=False, residual=True, operand_dtype=torch.float32, slice_units=U)
    assert deta.item() == -2.0 and dk[0, 0, 0, 0].item() == -2.0, (deta, dk)


def test_bad_arguments():
    """An operand dtype the kernel does not have, slices that do not divide Dh, a tensor of
    the wrong shape: an error naming the argument, before any work."""
    t = torch.zeros(1)
    kw = {"has_b1": True, "has_b2": True, "has_ln": False, "has_lnb": False, "residual": False}
    with pytest.raises(ValueError, match="operand_dtype"):
        mlp_bwd_b_cluster_model(*([t] * 23), 4, 1, 4, 4, 16, 4, 1, 0, 1, 1, 2, 1,
                                operand_dtype=torch.float64, **kw)
    with pytest.raises(ValueError, match="slice_units"):
        mlp_bwd_b_cluster_model(*([t] * 23), 4, 1, 4, 4, 16, 4, 1, 0, 1, 1, 2, 1,
                                operand_dtype=torch.float32, slice_units=12, **kw)
    with pytest.raises(ValueError, match="q must be a tensor of 4 dims"):
        mlp_bwd_b_cluster_model(*([t] * 23), 4, 1, 4, 4, 16, 4, 1, 0, 1, 1, 2, 1,
                                operand_dtype=torch.float32, slice_units=4, **kw)
