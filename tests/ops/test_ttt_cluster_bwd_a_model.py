"""The tile model of the TTT-MLP cluster backward's read-out pass (ops/ttt/cluster_bwd_model.py's
``mlp_bwd_a_cluster_model``; docs/gpu_ttt_kernels.md, "The read-out backward's tile model"):
launch by launch against ops/ttt/triton.py's ``_mlp_bwd_a_kernel`` under the CPU interpreter
(float32 operands: every piece it writes, 1 and 2 slices, the flags on, off and mixed), and the
whole ``ttt_mlp`` forward and backward in the three tile models (the forward model as the
forward and the recompute, this one, the sequential pass's) against autograd through the
float64 token loop, with float32 and with bfloat16 operands.
"""

from __future__ import annotations

import pytest
import torch

from fastweights.ops import ttt_mlp
from fastweights.ops.ttt.cluster_bwd_model import (
    bwd_a_model,
    bwd_b_model,
    fwd_model,
    mlp_bwd_a_cluster_model,
)
from tests.ops.test_ttt_cluster_bwd_model import BF16_GRAD, mlp_case
from tests.ops.test_ttt_triton import (  # noqa: F401 (fixtures)
    TOL32,
    assert_matches,
    exact,
    kernels,
    launches,
    max_err,
    on_gpu,
    run,
)

F64 = torch.float64
TOL_KERNEL = 1e-5  # model against kernel, float32 operands: max |x - ref| / max |ref|


def _segments(T, b, group):
    """The launches of the backward's read-out pass: the partial last mini-batch, then the
    full segments last first."""
    NF, N = T // b, -(-T // b)
    seg = min(group, NF) if NF else 1
    return ([(NF, N)] if NF < N else []) + [(n, min(n + seg, NF))
                                            for n in reversed(range(0, NF, seg))]


# (T, b, D, slice_units, checkpoint_group, H, flags): C = 4 D / slice_units slices; segments
# of several mini-batches, partial last mini-batches except where said
CASES = [
    (8, 3, 32, 128, 2, 2, {}),  # every flag on, C 1
    (9, 4, 32, 128, 3, 1, {"ln": False, "b1": False, "b2": False, "residual": False}),  # none
    (8, 4, 64, 128, 2, 1, {"ln_bias": False, "b2": False}),  # C 2, no partial mini-batch
    (10, 3, 16, 32, 4, 1, {"b1": False, "residual": False}),  # C 2
    (7, 2, 16, 16, 3, 1, {"ln": False}),  # C 4
]
IDS = [f"T{c[0]}b{c[1]}D{c[2]}U{c[3]}g{c[4]}H{c[5]}-" + "-".join(f"no_{k}" for k in c[6]) for c in CASES]


@pytest.mark.parametrize("T, b, D, U, group, H, flags", CASES, ids=IDS)
def test_model_is_the_kernel_and_the_token_loop(launches, exact, T, b, D, U, group, H,  # noqa: F811
                                                flags):
    """float32 operands, ``ttt_mlp`` forward and backward in the tile models (the forward
    model as the forward and the recompute, this one on every launch of the read-out pass,
    the sequential pass's on the full segments): launch by launch, ``_mlp_bwd_a_kernel`` on
    the same inputs writes every piece (hs's Z1, A, Zbar1, dZbar1; vs's G2, dZbar2, dG2,
    x_hat, g; rr, at, acc, dtau, the segment's dq, dk, deta) within 1e-5 of max |kernel| (the
    order of the sums only); the output, final state and every input's gradient equal
    autograd through the float64 token loop within 1e-4."""
    args, kw = mlp_case(T, b, D, H, **flags)
    want = run(ttt_mlp, args, kw, F64, mode="naive")
    diffs: list = []
    with fwd_model(torch.float32, U) as fwd, bwd_b_model(torch.float32, U) as rb, \
            bwd_a_model(torch.float32, U, compare=diffs) as calls:
        got = run(ttt_mlp, args, kw, torch.float32, backend="triton", checkpoint_group=group)
    assert calls == _segments(T, b, group) and fwd[0] == ("forward", 0, -(-T // b))
    assert rb == [c for c in calls if c[1] <= T // b]
    # the kernel ran only for the comparisons (and the sequential pass's partial mini-batch)
    assert launches["mlp_bwd_a"] == len(calls) and launches["mlp_fwd"] == 0
    assert_matches(got, want, TOL32, "cluster models")
    assert len(diffs) == len(calls)
    assert set(diffs[0]) >= {"hs.Z1", "hs.A", "hs.Zbar1", "hs.dZbar1", "vs.G2", "vs.dZbar2",
                             "vs.dG2", "at", "dtau", "dq", "dk", "deta"}
    assert ("acc" in diffs[0]) == flags.get("ln", True)
    worst = {n: max(d[n] for d in diffs) for n in diffs[0]}
    assert max(worst.values()) <= TOL_KERNEL, worst


def test_model_in_the_triton_backward(launches, exact):  # noqa: F811
    """The model alone in the kernel's place (the forward, the recompute's slots and the
    sequential pass in the Triton kernels): every gradient within 1e-4 of the float64 token
    loop, and within 1e-5 of the kernel launch by launch."""
    args, kw = mlp_case(10, 3, 16, ln_bias=False, b1=False)
    want = run(ttt_mlp, args, kw, F64, mode="naive")
    diffs: list = []
    with bwd_a_model(torch.float32, 32, compare=diffs) as calls:
        got = run(ttt_mlp, args, kw, torch.float32, backend="triton", checkpoint_group=2)
    assert calls == _segments(10, 3, 2) and launches["mlp_recompute"] == 1
    assert_matches(got, want, TOL32, "cluster bwd_a model")
    assert max(max(d.values()) for d in diffs) <= TOL_KERNEL, diffs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32],
                         ids=["bfloat16-inputs", "float32-inputs"])
def test_whole_backward_bfloat16_operands(launches, exact, dtype):  # noqa: F811
    """bfloat16 operands at D 64 (2 slices; q, k, v rounded to bfloat16 values first, given
    as bfloat16 or as float32), the forward and backward in the tile models: every gradient
    within the issue's 2e-2 of max |ref| of the float64 token loop on the same inputs, and
    farther than float32 operands' 1e-4 (the roundings are there)."""
    args, kw = mlp_case(16, 4, 64, seed=5)
    q, k, v, eta = args
    args = (*(x.to(torch.bfloat16).to(F64) for x in (q, k, v)), eta)
    want = run(ttt_mlp, args, kw, F64, mode="naive")
    bf = torch.bfloat16
    with fwd_model(bf, 128), bwd_a_model(bf, 128) as ra, bwd_b_model(bf, 128) as rb:
        got = run(ttt_mlp, args, kw, dtype, backend="triton", checkpoint_group=2)
    assert ra == rb == [(2, 4), (0, 2)]
    assert launches["mlp_fwd"] == launches["mlp_bwd_a"] == launches["mlp_bwd_b"] == 0
    errs = [max_err(x, y) / y.abs().max().item() for x, y in zip(got[2], want[2])]
    assert max(errs) <= BF16_GRAD, errs
    assert max(errs) > TOL32, errs


def test_cluster_sums_run_in_slice_order_then_the_rest():
    """Cluster sums 1 and 3 add the slices' shares in order 0..C-1, then the terms every CTA
    holds: one token, 4 slices, q = k = v = 0, eta = 0 (E = 0), b1 = 16 on unit 0 of each
    slice (gelu(16) = 16, gelu'(16) = 1 exactly), W1's row 0 one there, W2's column 0 the
    shares 0, 1, 2^25, -2^25, b2 = 2, dO = e_0 with the residual. Z2's shares 16 W2: in that
    order float32 gives G2 = 2 (the bias first 0, reverse 18); dQ's shares W2 W1: dQ = 1 (the
    residual's dO first 0, reverse 2)."""
    D, Dh, U, BB = 4, 16, 4, 16
    z, f = torch.zeros, {"dtype": torch.float32}
    w1, b1, w2, b2 = z(1, D, Dh, **f), z(1, Dh, **f), z(1, Dh, D, **f), z(1, D, **f)
    w1[0, 0, ::U], b1[0, ::U], b2[0, 0] = 1.0, 16.0, 2.0
    w2[0, ::U, 0] = torch.tensor([0.0, 1.0, 2.0 ** 25, -2.0 ** 25])
    x, do = z(1, 1, 1, D, **f), z(1, 1, 1, D, **f)
    do[..., 0] = 1.0
    hs, vs, dq = z(1, 1, 4, Dh, BB, **f), z(1, 1, 5, D, BB, **f), z(1, 1, 1, D, **f)
    mlp_bwd_a_cluster_model(
        x, x, x, z(1, 1, 1, **f), torch.ones(1, 1), z(1, 1, BB, BB), None, None, w1, b1, w2, b2,
        do, hs, vs, z(1, 1, BB, **f), z(1, 1, BB, BB, **f), z(1, 1, 2, D, **f), z(1, 1, BB, **f),
        dq, z(1, 1, 1, D, **f), z(1, 1, 1, **f), 1, 1, D, D, Dh, 1, 1, 0, 1, 1, 1, 0,
        has_b1=True, has_b2=True, has_ln=False, has_lnb=False, residual=True,
        operand_dtype=torch.float32, slice_units=U)
    assert vs[0, 0, 0, 0, 0].item() == 2.0 and dq[0, 0, 0, 0].item() == 1.0, (vs[0, 0, 0, 0],
                                                                              dq)


def test_bad_arguments():
    """An operand dtype the kernel does not have, slices that do not divide Dh, a tensor of
    the wrong shape, a segment outside the sequence: an error naming the argument, before any
    work."""
    t = torch.zeros(1)
    kw = {"has_b1": True, "has_b2": True, "has_ln": False, "has_lnb": False, "residual": False}
    sizes = (4, 1, 4, 4, 16, 4, 1, 0, 1, 1, 2, 1)  # T H Dk Dv Dh b N n0 n1 seg w_bh w_j
    with pytest.raises(ValueError, match="operand_dtype"):
        mlp_bwd_a_cluster_model(*([t] * 22), *sizes, operand_dtype=torch.float64, **kw)
    with pytest.raises(ValueError, match="slice_units"):
        mlp_bwd_a_cluster_model(*([t] * 22), *sizes, operand_dtype=torch.float32,
                                slice_units=12, **kw)
    with pytest.raises(ValueError, match="n0, n1"):
        mlp_bwd_a_cluster_model(*([t] * 22), *sizes[:7], 0, 2, *sizes[9:],
                                operand_dtype=torch.float32, slice_units=4, **kw)
    with pytest.raises(ValueError, match="q must be a tensor of 4 dims"):
        mlp_bwd_a_cluster_model(*([t] * 22), *sizes, operand_dtype=torch.float32,
                                slice_units=4, **kw)
