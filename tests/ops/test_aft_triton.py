"""AFT-full's Triton kernels (ops/aft/triton.py, docs/kernels.md "AFT-full") run by the Triton CPU
interpreter against the float64 oracle (docs/maths.md 4.1, 4.4), through the public op ``aft``
with ``backend="triton"``, and the op's dispatch.

tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton; the ``kernels``
fixture checks that the kernels really are interpreted, and every kernel launch is counted
(``launches``), so that a call that fell back to PyTorch cannot pass. Sizes are small and odd
(T not a multiple of the 64-row tiles and spanning two of them, D not a multiple of 16).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

pytest.importorskip("triton")

from fastweights.layers import AFTFull, AFTLocal
from fastweights.ops import aft, aft_local
from fastweights.ops import backend as backends
from fastweights.ops.aft.naive import aft_local_naive, aft_naive, full_naive
from tests.helpers import count_launches, interpreted_kernels

F64 = torch.float64
# One forward and backward: (a) and (b), then (c), (a) again, (d), (e).
FWD_BWD = Counter(prep=2, fwd=1, bwd_prep=1, bwd_kv=1, bwd_w=1)


@pytest.fixture(scope="module")
def kernels():
    return interpreted_kernels("fastweights.ops.aft.triton", "_fwd_kernel")


@pytest.fixture
def launches(kernels, monkeypatch) -> Counter:
    """Launches per kernel of ops/aft/triton.py (name without the underscores and ``_kernel``)."""
    return count_launches(kernels, monkeypatch)


@pytest.fixture
def on_gpu(monkeypatch):
    """The dispatcher sees CPU tensors as CUDA ones (the interpreter runs the kernels)."""
    monkeypatch.setattr(backends, "_on_cuda", lambda q: True)
    monkeypatch.setattr(backends, "fla_ops", lambda: None)
    monkeypatch.setattr(backends, "_trials", {})
    monkeypatch.delenv("FASTWEIGHTS_BACKEND", raising=False)
    monkeypatch.delenv("FASTWEIGHTS_TRITON", raising=False)


@pytest.fixture
def exact(kernels, on_gpu, monkeypatch):
    """``on_gpu``, and the kernels also take float32 inputs and odd channel counts (on a GPU
    those go to PyTorch, having no compiled spill-free specialisation; the interpreter runs them
    exactly), so the public op can be compared with the float64 oracle on odd sizes."""
    monkeypatch.setattr(kernels, "supports", lambda op, dtype: True)
    monkeypatch.setattr(kernels, "CHANNEL_MULTIPLE", 1)


def case(B, T, D, first=0, seed=0, scale=1.0):
    """float64 q [B, T, D], k, v [B, first + T, D] and w [T + 2, first + T + 3] (larger than the
    part the op reads)."""
    g = torch.Generator().manual_seed(seed)
    L = first + T
    q = torch.randn(B, T, D, generator=g, dtype=F64)
    k = scale * torch.randn(B, L, D, generator=g, dtype=F64)
    v = torch.randn(B, L, D, generator=g, dtype=F64)
    w = scale * torch.randn(T + 2, L + 3, generator=g, dtype=F64)
    return q, k, v, w


def reference(q, k, v, w, first, causal):
    """The oracle of rows first.., gated: float64."""
    T, L = q.shape[1], k.shape[1]
    return torch.sigmoid(q) * full_naive(k, v.unsqueeze(-1), w[:T, :L], first, causal).squeeze(-1)


def band_of(w, window, T):
    """The causal band [T, window] of the table w: [i, o] = w[i, i - o] (entries before
    position 0 clamped: never read)."""
    i = torch.arange(T)[:, None]
    return w[i, (i - torch.arange(window)).clamp_min(0)]


def local_reference(q, k, v, band, window):
    """The oracle of causal AFT-local from its band, float64."""
    T = q.shape[1]
    i = torch.arange(T)[:, None].expand(T, window)
    j = i - torch.arange(window)
    inside = j >= 0
    table = torch.zeros(T, T, dtype=band.dtype).index_put((i[inside], j[inside]), band[inside])
    return aft_local_naive(q, k, v, table, window, True)


def unread(grad, T, window):
    """A band's gradient with the entries reaching before position 0 (never read) zeroed."""
    return grad.masked_fill(torch.arange(T)[:, None] < torch.arange(window)[None, :], 0.0)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def outputs_and_grads(fn, xs, g):
    """fn(*leaves) and the gradients of sum(fn * g) with respect to the leaves (copies of xs)."""
    leaves = [x.detach().clone().requires_grad_() for x in xs]
    out = fn(*leaves)
    (out.double() * g).sum().backward()
    return out.detach(), [x.grad for x in leaves]


SHAPES = [(2, 37, 5), (1, 70, 19)]  # (B, T, D): one and two query/key blocks


@pytest.mark.parametrize("shape", SHAPES, ids=[f"B{b}-T{t}-D{d}" for b, t, d in SHAPES])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_kernels_match_naive(launches, exact, shape, causal):
    """float32 through the kernels against the float64 oracle: outputs and the gradients of q,
    k, v and w, each launch counted once per pass."""
    q, k, v, w = case(*shape)
    g = torch.randn(shape, dtype=F64)
    got, grads = outputs_and_grads(
        lambda q, k, v, w: aft(q, k, v, w, causal=causal, backend="triton")[0],
        [x.float() for x in (q, k, v, w)], g)
    assert launches == FWD_BWD, launches
    want, wgrads = outputs_and_grads(lambda q, k, v, w: aft_naive(q, k, v, w[:q.shape[1], :q.shape[1]], causal),
                                     (q, k, v, w), g)
    assert got.dtype == torch.float32 and rel(got, want) < 1e-5
    for name, a, b in zip("qkvw", grads, wgrads):
        assert a.dtype == torch.float32 and rel(a, b) < 1e-5, name


def test_cached_past_and_state(launches, exact):
    """A call continuing a cached past (AFTFullState): the kernels read the cache as the first
    keys and give its gradients; the sequence in pieces equals it whole."""
    B, T, D = 2, 29, 6
    q, k, v, w = case(B, T, D, seed=3)
    g = torch.randn(B, T, D, dtype=F64)

    def pieces(q, k, v, w):
        o1, st = aft(q[:, :11], k[:, :11], v[:, :11], w[:11], output_final_state=True,
                     backend="triton")
        o2, st = aft(q[:, 11:], k[:, 11:], v[:, 11:], w[11:T], initial_state=st,
                     output_final_state=True, backend="triton")
        assert st.k_cache.shape == (B, T, D) and st.k_cache.dtype == torch.float32
        return torch.cat([o1, o2], 1)

    got, grads = outputs_and_grads(pieces, [x.float() for x in (q, k, v, w)], g)
    assert launches == FWD_BWD + FWD_BWD, launches
    want, wgrads = outputs_and_grads(lambda q, k, v, w: reference(q, k, v, w, 0, True),
                                     (q, k, v, w), g)
    assert rel(got, want) < 1e-5
    for name, a, b in zip("qkvw", grads, wgrads):
        assert rel(a, b) < 1e-5, name


@pytest.mark.parametrize("form", ["full-causal", "full-bidir", "local"])
def test_lossy_rows_are_redone_exactly(launches, exact, kernels, monkeypatch, form):
    """Keys and biases spread over hundreds: rows whose best K + w lies far below the row
    maximum of w plus the column maximum of K underflow in the products; the kernel flags
    them and the op redoes them (AFT-full in the log-sum-exp form, AFT-local by its PyTorch
    form), gradients included."""
    B, T, D, s = 2, 23, 3, 5
    q, k, v, w = case(B, T, D, seed=31, scale=100.0)
    if form == "local":
        entry, w = "aft_local_triton", band_of(w, s, T)

        def run(q, k, v, w):
            return aft_local(q, k, v, w, window=s, backend="triton")[0]

        def want_of(q, k, v, w):
            return local_reference(q, k, v, w, s)
    else:
        entry, causal = "aft_full_triton", form == "full-causal"

        def run(q, k, v, w):
            return aft(q, k, v, w, causal=causal, backend="triton")[0]

        def want_of(q, k, v, w):
            return reference(q, k, v, w, 0, causal)
    flagged = []
    real = getattr(kernels, entry)

    def spy(*args):
        o, lossy = real(*args)
        flagged.append(int(lossy.sum()))
        return o, lossy

    monkeypatch.setattr(kernels, entry, spy)
    g = torch.randn(B, T, D, dtype=F64)
    got, grads = outputs_and_grads(run, [x.float() for x in (q, k, v, w)], g)
    assert flagged[0] > 0 and launches["fwd"] == 1
    want, wgrads = outputs_and_grads(want_of, (q, k, v, w), g)
    if form == "local":
        wgrads[3] = unread(wgrads[3], T, s)
    assert torch.isfinite(got).all() and rel(got, want) < 1e-5
    for name, a, b in zip("qkvw", grads, wgrads):
        assert torch.isfinite(a).all() and rel(a, b) < 1e-4, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidir"])
def test_half_inputs_within_1e_2(launches, on_gpu, dtype, causal):
    """Half inputs (D = 32: the dispatcher's own choice): outputs in the input dtype, outputs and
    gradients within 1e-2 (max |x - ref| / max |ref|) of the float64 form on the same rounded
    inputs."""
    B, T, D = 2, 70, 32
    xs = [x.to(dtype) for x in case(B, T, D, seed=5)]
    g = torch.randn(B, T, D, dtype=F64)
    got, grads = outputs_and_grads(lambda q, k, v, w: aft(q, k, v, w, causal=causal)[0], xs, g)
    calls = 2 if causal else 1  # a causal call's first: the automatic choice's trial too
    # (whose w is detached: no dw)
    assert launches["fwd"] == launches["bwd_kv"] == calls and launches["bwd_w"] == 1
    want, wgrads = outputs_and_grads(lambda q, k, v, w: reference(q, k, v, w, 0, causal),
                                     [x.double() for x in xs], g)
    assert got.dtype == dtype and rel(got, want) < 1e-2
    for name, a, b in zip("qkvw", grads, wgrads):
        assert a.dtype == dtype and rel(a, b) < 1e-2, name


def test_dispatch(launches, kernels, on_gpu, monkeypatch):
    """The automatic choice takes the kernels for half inputs on "CUDA" with D a multiple of 16
    and PyTorch otherwise (float32, D = 24, one-token calls, mode="naive", backend="torch",
    AFT-simple); packed documents run one document at a time through them; explicit choices
    that cannot run are ValueErrors naming the reason."""
    q, k, v, w = (x.bfloat16() for x in case(1, 9, 16, seed=2))
    aft(q, k, v, w)  # the trial (causal) and the call
    assert launches["fwd"] == 2
    assert backends._trials == {("aft", "triton", torch.bfloat16, "cpu", False): None}
    aft(q, k, v, w, causal=False)  # bidirectional: no trial (it would carry a state)
    assert launches["fwd"] == 3
    aft(q.float(), k.float(), v.float(), w.float())  # float32: PyTorch
    q24, k24, v24, w24 = (x.bfloat16() for x in case(1, 9, 24, seed=2))
    aft(q24, k24, v24, w24)  # D = 24: PyTorch
    aft(q[:, :1], k[:, :1], v[:, :1], w)  # one token
    aft(q, k, v, w, mode="naive")
    aft(q, k, v, w, backend="torch")
    aft(q, k, v)  # AFT-simple
    assert launches["fwd"] == 3
    cu = torch.tensor([0, 4, 9])
    o, states = aft(q, k, v, w[:9], cu_seqlens=cu, output_final_state=True)
    assert launches["fwd"] == 5 and len(states) == 2
    ref = torch.cat([reference(*(x.double() for x in (q[:, a:b], k[:, a:b], v[:, a:b],
                                                      w[a:b, :b - a])), 0, True)
                     for a, b in ((0, 4), (4, 9))], 1)
    assert rel(o, ref) < 1e-2
    with pytest.raises(ValueError, match="float32"):
        aft(q.float(), k.float(), v.float(), w.float(), backend="triton")
    with pytest.raises(ValueError, match="multiples of 16"):
        aft(q24, k24, v24, w24, backend="triton")
    with pytest.raises(ValueError, match="no Triton kernel for aft_simple"):
        aft(q, k, v, backend="triton")
    with pytest.raises(ValueError, match="mode='naive'"):
        aft(q, k, v, w, mode="naive", backend="triton")
    with pytest.raises(ValueError, match="backend must be one of"):
        aft(q, k, v, w, backend="cuda")
    assert launches["fwd"] == 5


def test_layer_runs_on_the_kernels(launches, on_gpu):
    """AFTFull in bfloat16 calls the op's automatic choice: the kernels, forward and backward."""
    torch.manual_seed(0)
    layer = AFTFull(16, 2, max_len=40).bfloat16()
    x = torch.randn(2, 21, 16, dtype=torch.bfloat16, requires_grad=True)
    y, _ = layer(x)
    y.float().sum().backward()
    assert launches["fwd"] == 2 and launches["bwd_w"] == 1  # with the trial's (no dw)
    assert layer.bias.u.grad is not None and torch.isfinite(x.grad).all()


# ------------------------------------------------------------------------------ AFT-local

LOCAL_CASES = [(2, 37, 5, 4), (1, 150, 7, 30), (1, 70, 3, 100), (2, 9, 4, 1)]


@pytest.mark.parametrize("B,T,D,s", LOCAL_CASES, ids=[f"B{b}-T{t}-D{d}-s{s}" for b, t, d, s in LOCAL_CASES])
def test_local_kernels_match_naive(launches, exact, B, T, D, s):
    """Causal AFT-local through the banded kernels, float32, against the float64 oracle:
    outputs, the gradients of q, k, v and the band, and the final state (equal to the PyTorch
    form's); windows shorter than a tile, across tiles and longer than the sequence."""
    q, k, v, w = case(B, T, D, seed=7)
    band = band_of(w, s, T)
    g = torch.randn(B, T, D, dtype=F64)
    states = []

    def run(q, k, v, band):
        o, st = aft_local(q, k, v, band, window=s, output_final_state=True, backend="triton")
        states.append(st)
        return o

    got, grads = outputs_and_grads(run, [x.float() for x in (q, k, v, band)], g)
    assert launches == FWD_BWD, launches
    want, wgrads = outputs_and_grads(lambda q, k, v, band: local_reference(q, k, v, band, s),
                                     (q, k, v, band), g)
    assert rel(got, want) < 1e-5
    for name, a, b in zip("qkvw", grads, wgrads):
        if name == "w":
            b = unread(b, T, s)
        assert rel(a, b) < 1e-5, name
    _, ref_state = aft_local(*(x.float() for x in (q, k, v, band)), window=s,
                             output_final_state=True, backend="torch")
    (a, n, m, kc, vc, pos), (ra, rn, rm, rkc, rvc, rpos) = states[0], ref_state
    assert pos == rpos == T and torch.equal(kc, rkc) and torch.equal(vc, rvc)
    if s <= T:  # sums e^a m and e^a n of the tokens before the cache
        assert rel(torch.exp(a) * m, torch.exp(ra) * rm) < 1e-5
        assert rel(torch.exp(a) * n, torch.exp(ra) * rn) < 1e-5
    else:  # nothing has left the window
        assert bool((m == 0).all()) and bool((rm == 0).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_local_half_inputs_within_1e_2(launches, on_gpu, dtype):
    """Half inputs through the automatic choice (D = 32): within 1e-2 of the float64 form on
    the same rounded inputs, outputs and gradients."""
    B, T, D, s = 2, 70, 32, 20
    q, k, v, w = (x.to(dtype) for x in case(B, T, D, seed=5))
    xs = [q, k, v, band_of(w, s, T)]
    g = torch.randn(B, T, D, dtype=F64)
    got, grads = outputs_and_grads(lambda q, k, v, b: aft_local(q, k, v, b, window=s)[0], xs, g)
    assert launches["fwd"] == 2  # the trial's and the call's
    want, wgrads = outputs_and_grads(lambda q, k, v, b: local_reference(q, k, v, b, s),
                                     [x.double() for x in xs], g)
    assert got.dtype == dtype and rel(got, want) < 1e-2
    for name, a, b in zip("qkvw", grads, wgrads):
        if name == "w":
            b = unread(b, T, s)
        assert rel(a, b) < 1e-2, name


def test_local_dispatch(launches, on_gpu):
    """AFT-local's kernels take causal half calls without a carried state; a carried state, a
    bidirectional call, one token or D = 24 run PyTorch, and an explicit choice of triton there
    is a ValueError naming the reason. The layer runs them, and its decoding continues from the
    state they return."""
    q, k, v, w = (x.bfloat16() for x in case(1, 12, 16, seed=2))
    band = band_of(w, 4, 12)
    _, st = aft_local(q, k, v, band, window=4, output_final_state=True)
    assert launches["fwd"] == 2
    aft_local(q, k, v, band, window=4, initial_state=st)  # a carried state: PyTorch
    aft_local(q, k, v, w[:12, :7], window=4, causal=False)
    aft_local(q[:, :1], k[:, :1], v[:, :1], band[:1], window=4)
    assert launches["fwd"] == 2
    with pytest.raises(ValueError, match="carried state"):
        aft_local(q, k, v, band, window=4, initial_state=st, backend="triton")
    with pytest.raises(ValueError, match="causal=False"):
        aft_local(q, k, v, w[:12, :7], window=4, causal=False, backend="triton")
    torch.manual_seed(0)
    layer = AFTLocal(16, 2, window=5, max_len=40).bfloat16()
    x = torch.randn(2, 21, 16, dtype=torch.bfloat16, requires_grad=True)
    y, state = layer(x[:, :20])
    y.float().sum().backward()
    assert launches["fwd"] == 4 and launches["bwd_w"] == 2  # with the layer's trial
    y_step, _ = layer(x[:, 20:], state)  # decoding: PyTorch's step on the kernels' state
    y_all, _ = layer.float()(x.detach().float())
    assert rel(y_step, y_all[:, 20:]) < 2e-2 and launches["fwd"] == 4
