"""The fused ops around the gated-delta layer's op (ops/fused, docs/kernels.md "The gated-delta
layer's fused elementwise kernels"): ``short_conv_silu`` and ``rms_norm_gated``, their PyTorch
forms and their Triton kernels (run by the Triton CPU interpreter) against independent float64
oracles, forward and every gradient, with a carried convolution state; the layer on the
kernels; the dispatch.

tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton; every kernel launch
is counted (``launches``), so a call that fell back to PyTorch cannot pass. Sizes are small and
odd: T not a multiple of the row tiles and spanning two, C odd, heads of 5 channels, norm rows
of 150 columns (two column steps of 128), W = 3 and 4.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from fastweights.ops import backend as backends
from fastweights.ops import rms_norm_gated, short_conv_silu
from tests.helpers import assert_close64, count_launches, interpreted_kernels
from tests.ops.test_aft_triton import on_gpu  # noqa: F401 (fixture: CPU tensors seen as CUDA)

F64 = torch.float64
OPS = ("short_conv_silu", "rms_norm_gated")


@pytest.fixture(scope="module")
def kernels():
    return interpreted_kernels("fastweights.ops.fused.triton", "_conv_fwd_kernel")


@pytest.fixture
def launches(kernels, monkeypatch) -> Counter:
    """Launches per kernel of ops/fused/triton.py (name without the underscores and
    ``_kernel``)."""
    return count_launches(kernels, monkeypatch)


@pytest.fixture
def exact(kernels, on_gpu, monkeypatch):  # noqa: F811
    """``on_gpu``, and the fused ops' kernels also take float32 and float64 inputs (on a GPU
    those keep the PyTorch forms; the interpreter runs them exactly), so the public ops can be
    compared with float64 oracles. Only these two ops: the recurrent ops keep their kernels'
    dtypes."""
    dtypes = (torch.float16, torch.bfloat16, torch.float32, F64)
    monkeypatch.setattr(backends, "KERNEL_DTYPES", dtypes)
    monkeypatch.setattr(kernels, "supports", lambda op, dtype: True)
    for op in OPS:
        reg = backends._REGISTRY[op]
        wide = {name: tuple(dataclasses.replace(k, dtypes=dtypes) for k in ks)
                for name, ks in reg.kernels.items()}
        monkeypatch.setitem(backends._REGISTRY, op, dataclasses.replace(reg, kernels=wide))


def _randn(*shape, seed: int, dtype=F64, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g, dtype=F64)).to(dtype)


def conv_oracle(x, weight, bias, past, n, head_dim, eps=1e-6):
    """The convolution as nn.Conv1d computes it over [past, x] (channels first), SiLU, then
    each of the first n / head_dim heads divided by sqrt(|.|^2 + eps): plain autograd."""
    B, _, C = x.shape
    W = weight.shape[-1]
    past = x.new_zeros(B, C, W - 1) if past is None else past
    full = torch.cat([past, x.transpose(1, 2)], dim=2)
    y = F.silu(F.conv1d(full, weight.reshape(C, 1, W), bias, groups=C)).transpose(1, 2)
    if not n:
        return y
    heads = y[..., :n].unflatten(-1, (-1, head_dim))
    heads = heads / torch.sqrt(heads.square().sum(-1, keepdim=True) + eps)
    return torch.cat([heads.flatten(-2), y[..., n:]], dim=-1)


def conv_case(B, T, C, W, bias: bool, past: bool, seed: int = 0):
    x = _randn(B, T, C, seed=seed)
    weight = _randn(C, 1, W, seed=seed + 1, scale=0.7)
    b = _randn(C, seed=seed + 2, scale=0.3) if bias else None
    p = _randn(B, C, W - 1, seed=seed + 3) if past else None
    return [t if t is None else t.requires_grad_() for t in (x, weight, b, p)]


def grads(y, inputs, dy):
    used = [t for t in inputs if t is not None]
    got = iter(torch.autograd.grad(y, used, dy))
    return [None if t is None else next(got) for t in inputs]


CONV_CASES = {  # B, T, C, W, bias, past; two heads of 5 normalised
    "two-row-tiles-W4-bias-past": (2, 67, 17, 4, True, True),
    "W3-no-bias-no-past": (1, 9, 13, 3, False, False),
    "T-below-W": (2, 2, 11, 4, True, True),
}


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", CONV_CASES.values(), ids=CONV_CASES.keys())
def test_short_conv_matches_the_oracle(case, backend, launches, exact):
    B, T, C, W, _, _ = case
    x, weight, b, p = conv_case(*case)
    y, final = short_conv_silu(x, weight, b, initial_state=p, norm_heads=2, head_dim=5,
                               output_final_state=True, backend=backend)
    want = conv_oracle(x, weight, b, p, 10, 5)
    assert y.dtype == F64 and final.shape == (B, C, W - 1)
    assert_close64(y, want, what="y")
    full = torch.cat([x.new_zeros(B, C, W - 1) if p is None else p, x.transpose(1, 2)], 2)
    assert_close64(final, full[..., -(W - 1):], what="final state")
    dy = _randn(B, T, C, seed=9)
    for g, w, name in zip(grads(y, (x, weight, b, p), dy), grads(want, (x, weight, b, p), dy),
                          ("dx", "dweight", "dbias", "dpast")):
        if w is not None:
            assert_close64(g, w, what=name)
    assert launches == (Counter(conv_fwd=1, conv_bwd=1) if backend == "triton" else Counter())


def test_short_conv_backward_in_steps(kernels, launches, exact, monkeypatch):
    """A backward program running several row blocks (``steps``): the same gradients."""
    monkeypatch.setattr(kernels, "_backward_steps", lambda blocks, programs: 2)
    x, weight, b, p = conv_case(1, 150, 9, 4, True, True, seed=3)  # five 32-row blocks
    y, _ = short_conv_silu(x, weight, b, initial_state=p, norm_heads=1, head_dim=5)
    want = conv_oracle(x, weight, b, p, 5, 5)
    dy = _randn(*y.shape, seed=4)
    for g, w in zip(grads(y, (x, weight, b, p), dy), grads(want, (x, weight, b, p), dy)):
        assert_close64(g, w, what="gradient")
    assert launches == Counter(conv_fwd=1, conv_bwd=1)


def test_short_conv_pieces_carry_the_state(launches, exact):
    """Two calls with the state carried are the whole call, forward and gradients (through the
    state), on the kernels; without a norm the channels are only convolved and SiLU'd."""
    x, weight, b, p = conv_case(2, 23, 12, 4, True, True, seed=5)
    whole, final = short_conv_silu(x, weight, b, initial_state=p, output_final_state=True)
    y1, s = short_conv_silu(x[:, :10], weight, b, initial_state=p, output_final_state=True)
    y2, s2 = short_conv_silu(x[:, 10:], weight, b, initial_state=s, output_final_state=True)
    y = torch.cat([y1, y2], 1)
    assert_close64(y, whole, what="pieces")
    assert_close64(s2, final, what="final state")
    assert_close64(whole, conv_oracle(x, weight, b, p, 0, 1), what="no norm")
    dy = _randn(*y.shape, seed=6)
    for g, w in zip(grads(y, (x, weight, b, p), dy), grads(whole, (x, weight, b, p), dy)):
        assert_close64(g, w, what="gradient")
    assert launches == Counter(conv_fwd=3, conv_bwd=3)


def within_one_ulp(y: torch.Tensor, ref: torch.Tensor) -> bool:
    """bfloat16 y within one unit in the last place of ref: the interpreter rounds float32 to
    bfloat16 toward zero (Triton 3.6 to 3.9), the GPU and PyTorch to nearest."""
    return bool(((y.double() - ref.double()).abs() <= 2 ** -7 * ref.double().abs()).all())


def test_short_conv_half_inputs_round_once(launches, on_gpu):  # noqa: F811
    """bfloat16 x read in place (a slice of a wider tensor): the kernel's output is the float32
    computation rounded once, as the PyTorch form's (up to float32 summation order and the
    interpreter's rounding)."""
    x = _randn(2, 19, 40, seed=7, dtype=torch.bfloat16)[:, 3:, 5:31]
    weight = _randn(26, 1, 4, seed=8, scale=0.5)
    p = _randn(2, 26, 3, seed=9)
    y, _ = short_conv_silu(x, weight, None, initial_state=p, norm_heads=2, head_dim=8)
    ref, _ = short_conv_silu(x, weight, None, initial_state=p, norm_heads=2, head_dim=8,
                             backend="torch")
    assert y.dtype == torch.bfloat16 and launches == Counter(conv_fwd=1)
    assert within_one_ulp(y, ref)


def norm_oracle(x, weight, gate, eps, activation):
    y = x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps)
    y = y if weight is None else y * weight
    if gate is None:
        return y
    return y * (torch.sigmoid(gate) if activation == "sigmoid" else gate * torch.sigmoid(gate))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(("activation", "gated", "weighted"), [
    ("swish", True, True), ("sigmoid", True, False), ("silu", False, True)])
def test_rms_norm_gated_matches_the_oracle(activation, gated, weighted, backend, launches,
                                           exact):
    """x [2, 5, 3, 150] and the gate a [B, T, H, D] view of a wider tensor (the layer's slice
    of its projections), read in place."""
    B, T, H, D = 2, 5, 3, 150
    x = _randn(B, T, H, D, seed=1).requires_grad_()
    wide = _randn(B, T, H * D + 7, seed=2).requires_grad_()
    gate = wide[..., 7:].unflatten(-1, (H, D)) if gated else None
    weight = _randn(D, seed=3).requires_grad_() if weighted else None
    y = rms_norm_gated(x, weight, gate, eps=1e-5, activation=activation, backend=backend)
    want = norm_oracle(x, weight, gate, 1e-5, activation)
    assert_close64(y, want, what="y")
    dy = _randn(B, T, H, D, seed=4)
    inputs = (x, weight, wide if gated else None)
    for g, w, name in zip(grads(y, inputs, dy), grads(want, inputs, dy),
                          ("dx", "dweight", "dgate")):
        if w is not None:
            assert_close64(g, w, what=name)
    assert launches == (Counter(norm_fwd=1, norm_bwd=1) if backend == "triton" else Counter())


def test_rms_norm_gated_out_dtype_and_half(launches, on_gpu):  # noqa: F811
    """bfloat16 x and gate with a float32 output (an autocast model's): the float32 result,
    unrounded; with the default, rounded once to bfloat16 (``within_one_ulp``)."""
    x = _randn(3, 2, 40, seed=5, dtype=torch.bfloat16)
    gate = _randn(3, 2, 40, seed=6, dtype=torch.bfloat16)
    weight = _randn(40, seed=7, dtype=torch.float32)
    y32 = rms_norm_gated(x, weight, gate, out_dtype=torch.float32)
    ref = rms_norm_gated(x, weight, gate, out_dtype=torch.float32, backend="torch")
    assert y32.dtype == torch.float32 and (y32 - ref).abs().max() < 1e-5
    y16 = rms_norm_gated(x, weight, gate)
    assert y16.dtype == torch.bfloat16 and within_one_ulp(y16, y32)
    assert launches == Counter(norm_fwd=2)


# ----------------------------------------------------------------------------- the layer


@pytest.mark.parametrize("options", ["defaults", "conv-bias-w2-headdim",
                                     pytest.param("grouped-heads", marks=pytest.mark.slow),
                                     pytest.param("negeig-sigmoid-gate", marks=pytest.mark.slow)])
def test_layer_on_the_kernels(options, launches, exact):
    """The gated-delta layer with its fused ops on the kernels: the written-out recurrence, its
    pieces and one-token steps with the state carried, and every gradient equal to the layer
    on the PyTorch forms (backend="torch")."""
    from tests.layers.test_gated_delta_layer import OPTIONS, inputs, layer, reference

    m, x = layer(**OPTIONS[options]), inputs()
    with torch.no_grad():
        assert_close64(m(x)[0], reference(m, x), what="y")
    assert launches["conv_fwd"] == 1 and launches["norm_fwd"] == 1
    from tests.helpers import assert_pieces_and_steps_equal_whole

    assert_pieces_and_steps_equal_whole(m, x, 5)
    ref = layer(**OPTIONS[options], backend="torch")
    s0 = tuple(t.detach() for t in m(x[:, :4])[1])
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    before = Counter(launches)
    (ya, sa), (yb, sb) = m(xa, s0), ref(xb, s0)
    assert launches["conv_fwd"] == before["conv_fwd"] + 1
    loss = (ya * _randn(*ya.shape, seed=3)).sum() + sa[0].sum() + sa[1].sum()
    loss_ref = (yb * _randn(*yb.shape, seed=3)).sum() + sb[0].sum() + sb[1].sum()
    loss.backward()
    loss_ref.backward()
    assert launches["conv_bwd"] == 1 and launches["norm_bwd"] == 1
    assert_close64(xa.grad, xb.grad, what="dx")
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        assert_close64(p.grad, q.grad, what=name)


def test_layer_packed_documents_on_the_kernels(launches, exact):
    """Packed documents (cu_seqlens): one fused convolution per document, each from its own
    past, as the PyTorch forms."""
    from tests.layers.test_gated_delta_layer import layer

    m, ref = layer(), layer(backend="torch")
    x = _randn(1, 13, 24, seed=2)
    cu = torch.tensor([0, 4, 13])
    y, states = m(x, cu_seqlens=cu)
    y_ref, states_ref = ref(x, cu_seqlens=cu)
    assert_close64(y, y_ref, what="y")
    for a, b in zip(states, states_ref):
        for u, v in zip(a, b):
            assert_close64(u, v, what="state")
    assert launches["conv_fwd"] == 2 and launches["norm_fwd"] == 1


# ----------------------------------------------------------------------------- dispatch


def _cuda(dtype, shape=(1, 8, 64, 1)):
    return SimpleNamespace(is_cuda=True, dtype=dtype, shape=shape, device="cuda:0",
                           requires_grad=False)


@pytest.mark.parametrize("op", OPS)
def test_dispatch(op, monkeypatch):
    """Half CUDA inputs run the kernels (one-token calls too), float32 the PyTorch forms; an
    explicit "triton" that cannot run is an error; FASTWEIGHTS_BACKEND=fla, which has no such
    kernel, leaves the choice automatic, =torch keeps PyTorch."""
    monkeypatch.setattr(backends, "fla_ops", lambda: None)
    monkeypatch.delenv("FASTWEIGHTS_BACKEND", raising=False)
    monkeypatch.delenv("FASTWEIGHTS_TRITON", raising=False)
    choose = backends.choose_backend
    for dtype in (torch.float16, torch.bfloat16):
        assert choose(op, _cuda(dtype), None, "fused", 1) == "triton"
        assert choose(op, _cuda(dtype, (1, 1, 64, 1)), None, "fused", 1) == "triton"
    assert choose(op, _cuda(torch.float32), None, "fused", 1) == "torch"
    with pytest.raises(ValueError, match="float32 runs the PyTorch forms"):
        choose(op, _cuda(torch.float32), "triton", "fused", 1)
    with pytest.raises(ValueError, match="fla"):
        choose(op, _cuda(torch.bfloat16), "fla", "fused", 1)
    monkeypatch.setenv("FASTWEIGHTS_BACKEND", "fla")
    assert choose(op, _cuda(torch.bfloat16), None, "fused", 1) == "triton"
    monkeypatch.setenv("FASTWEIGHTS_BACKEND", "torch")
    assert choose(op, _cuda(torch.bfloat16), None, "fused", 1) == "torch"
    monkeypatch.setenv("FASTWEIGHTS_BACKEND", "fla")  # the ops that have fla kernels keep it
    with pytest.raises(ValueError, match="FASTWEIGHTS_BACKEND='fla' cannot run aft"):
        choose("aft", _cuda(torch.bfloat16), None, "chunk", 64)


def test_wide_heads_stay_in_pytorch(monkeypatch):
    monkeypatch.setattr(backends, "fla_ops", lambda: None)
    monkeypatch.delenv("FASTWEIGHTS_BACKEND", raising=False)
    q = _cuda(torch.bfloat16)
    assert backends.choose_backend("short_conv_silu", q, None, "fused", 1,
                                   facts={"head_dim": 512}) == "torch"
    with pytest.raises(ValueError, match="head_dim=512"):
        backends.choose_backend("short_conv_silu", q, "triton", "fused", 1,
                                facts={"head_dim": 512})


def test_offsets_past_32_bits_stay_in_pytorch(monkeypatch):
    monkeypatch.setattr(backends, "fla_ops", lambda: None)
    monkeypatch.delenv("FASTWEIGHTS_BACKEND", raising=False)
    for op in OPS:
        assert backends.choose_backend(op, _cuda(torch.bfloat16), None, "fused", 1,
                                       facts={"span": 2 ** 31}) == "torch"
        assert backends.choose_backend(op, _cuda(torch.bfloat16), None, "fused", 1,
                                       facts={"span": 2 ** 31 - 1}) == "triton"


def test_cpu_explicit_triton_is_refused():
    x = torch.zeros(1, 3, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        short_conv_silu(x, torch.zeros(8, 1, 4), backend="triton")
    with pytest.raises(ValueError, match="CUDA"):
        rms_norm_gated(x, backend="triton")


@pytest.mark.parametrize(("call", "match"), [
    (lambda x: short_conv_silu(x, torch.zeros(7, 1, 4)), r"weight must have shape \[C, 1, W\]"),
    (lambda x: short_conv_silu(x, torch.zeros(8, 4), torch.zeros(7)), r"bias must have shape"),
    (lambda x: short_conv_silu(x, torch.zeros(8, 4), initial_state=torch.zeros(2, 8, 3)),
     r"initial_state must have shape \[B, C, W - 1\]"),
    (lambda x: short_conv_silu(x, torch.zeros(8, 4), norm_heads=3, head_dim=3),
     "norm_heads \\* head_dim"),
    (lambda x: short_conv_silu(x[0], torch.zeros(8, 4)), r"x must .*\[B, T, C\]"),
    (lambda x: rms_norm_gated(x, torch.zeros(7)), r"weight must have shape \[D\]"),
    (lambda x: rms_norm_gated(x, gate=x[:, :2]), "gate must have x's shape"),
    (lambda x: rms_norm_gated(x, activation="relu"), "activation"),
    (lambda x: rms_norm_gated(x, eps=0.0), "eps"),
])
def test_bad_input_is_named(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call(torch.zeros(1, 3, 8))


@pytest.mark.parametrize("options", [{"use_gate": True}, {"qk_activation": "relu"},
                                     {"qk_norm": "sum", "conv_bias": True}])
def test_fla_deltanet_on_the_kernels(options, launches, exact):
    """fla's DeltaNet under the contract with its fused ops on the kernels: q's and k's
    convolutions fused with the L2 norm where the features are SiLU + L2 (else the norm stays
    in the layer, and a non-SiLU q/k convolution in PyTorch), v's convolution and the output
    norm (with its gate) fused; outputs, states and every gradient equal to the PyTorch forms,
    packed documents included."""
    from tests.fla.test_deltanet import layer

    m, ref = layer(**options), layer(**options, backend="torch")
    silu = options.get("qk_activation", "silu") == "silu"
    x = _randn(1, 13, 24, seed=2)
    cu = torch.tensor([0, 4, 13])
    for kw, docs in (({}, 1), ({"cu_seqlens": cu}, 2)):
        before = Counter(launches)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        (ya, sa), (yb, sb) = m(xa, **kw), ref(xb, **kw)
        assert launches["conv_fwd"] - before["conv_fwd"] == docs * (3 if silu else 1)
        assert launches["norm_fwd"] - before["norm_fwd"] == 1
        assert_close64(ya, yb, what="y")
        for a, b in zip(sa if docs > 1 else [sa], sb if docs > 1 else [sb]):
            for u, v in zip(a, b):
                assert_close64(u, v, what="state")
        (ya * _randn(*ya.shape, seed=3)).sum().backward()
        (yb * _randn(*yb.shape, seed=3)).sum().backward()
        assert_close64(xa.grad, xb.grad, what="dx")
        for (name, p), q in zip(m.named_parameters(), ref.parameters()):
            assert_close64(p.grad, q.grad, what=name)
            p.grad, q.grad = None, None


def test_fla_retnet_norm_on_the_kernels(launches, exact):
    """fla's RetNet under the contract: its output norm (fused with the swish gate) on the
    kernel, equal to the PyTorch form."""
    from fastweights.layers.fla_retnet import FlaMultiScaleRetention as FlaRetNet

    torch.manual_seed(0)
    m = FlaRetNet(24, 3).double()
    ref = FlaRetNet(24, 3, backend="torch").double()
    ref.load_state_dict(m.state_dict())
    x = _randn(2, 7, 24, seed=4)
    assert_close64(m(x)[0], ref(x)[0], what="y")
    assert launches["norm_fwd"] == 1
