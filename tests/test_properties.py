"""Property-based tests: for every op, over random shapes, chunk / block / segment /
mini-batch sizes, split points and dtypes, the fast forms equal the naive (float64) form and a
sequence run in two pieces with the state carried equals the sequence run whole.

Hypothesis runs derandomised (the same examples on every run) with at most 25 examples per
property; ``EXAMPLES`` counts the examples each property actually ran, and the last test checks
and prints the total (``python -m pytest tests/test_properties.py -s``).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastweights.ops import (
    aft,
    aft_conv,
    aft_local,
    block_attention,
    decay_linear_attn,
    delta_rule,
    infini_attention,
    linear_attn,
    softmax_attention,
    sum_norm,
    ttt_linear,
    ttt_mlp,
)
from fastweights.ops.aft.naive import aft_conv_naive, aft_local_naive, aft_naive
from fastweights.ops.transnormer.naive import block_attention_naive

FAST = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])
EXAMPLES: Counter[str] = Counter()
# Tolerance of a form run in ``dtype`` against the float64 oracle.
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


@st.composite
def problems(draw, max_t: int = 12, even_dk: bool = False):
    """Sizes (B, T, H, Dk, Dv), a block size, a split point 0 <= t0 <= T, a dtype and a seed."""
    B, T, H = draw(st.integers(1, 2)), draw(st.integers(1, max_t)), draw(st.integers(1, 2))
    Dk = draw(st.integers(1, 3)) * (2 if even_dk else 1)
    Dv = draw(st.integers(1, 4))
    return dict(B=B, T=T, H=H, Dk=Dk, Dv=Dv, size=draw(st.integers(1, 6)),
                split=draw(st.integers(0, T)), dtype=draw(st.sampled_from(list(TOL))),
                seed=draw(st.integers(0, 2**16)))


def randn(p: dict, *shape: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(p["seed"] + len(shape) * 7919 + sum(shape))
    p["seed"] += 1
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def close(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol, msg=name)


def cast(dtype: torch.dtype, *xs):
    return tuple(x.to(dtype) if isinstance(x, torch.Tensor) else x for x in xs)


def halves(t0: int, *xs: torch.Tensor):
    return tuple(x[:, :t0] for x in xs), tuple(x[:, t0:] for x in xs)


# ---------------------------------------------------------------- fast-weight programmers
@FAST
@given(problems(), st.booleans())
def test_linear_attn(p, normalize):
    EXAMPLES["linear_attn"] += 1
    B, T, H, Dk, Dv = p["B"], p["T"], p["H"], p["Dk"], p["Dv"]
    q, k, v = randn(p, B, T, H, Dk).exp(), randn(p, B, T, H, Dk).exp(), randn(p, B, T, H, Dv)
    want, (S, z) = linear_attn(q, k, v, normalize=normalize, mode="naive", output_final_state=True)
    d, t0 = p["dtype"], p["split"]
    for mode in ("chunk", "recurrent"):
        o, (S2, z2) = linear_attn(*cast(d, q, k, v), normalize=normalize, mode=mode,
                                  chunk_size=p["size"], output_final_state=True)
        close(mode, o, want, d), close("S", S2, S, d), close("z", z2, z, d)
    first, second = halves(t0, q, k, v)
    if t0 in (0, T):
        return
    o1, st1 = linear_attn(*first, normalize=normalize, chunk_size=p["size"], output_final_state=True)
    o2, _ = linear_attn(*second, normalize=normalize, chunk_size=p["size"], initial_state=st1)
    close("pieces", torch.cat([o1, o2], 1), want, torch.float64)


@FAST
@given(problems())
def test_delta_rule(p):
    EXAMPLES["delta_rule"] += 1
    B, T, H, Dk, Dv = p["B"], p["T"], p["H"], p["Dk"], p["Dv"]
    q, k = sum_norm(randn(p, B, T, H, Dk).exp()), sum_norm(randn(p, B, T, H, Dk).exp())
    v, beta = randn(p, B, T, H, Dv), torch.sigmoid(randn(p, B, T, H))
    want, S = delta_rule(q, k, v, beta, mode="naive", output_final_state=True)
    d, t0 = p["dtype"], p["split"]
    for mode in ("chunk", "recurrent"):
        o, S2 = delta_rule(*cast(d, q, k, v, beta), mode=mode, chunk_size=p["size"],
                           output_final_state=True)
        close(mode, o, want, d), close("S", S2, S, d)
    if t0 in (0, T):
        return
    first, second = halves(t0, q, k, v, beta)
    o1, S1 = delta_rule(*first, chunk_size=p["size"], output_final_state=True)
    o2, _ = delta_rule(*second, chunk_size=p["size"], initial_state=S1)
    close("pieces", torch.cat([o1, o2], 1), want, torch.float64)


# ---------------------------------------------------------------- TransNormer
@FAST
@given(problems())
def test_decay_linear_attn(p):
    EXAMPLES["decay_linear_attn"] += 1
    B, T, H, Dk, Dv = p["B"], p["T"], p["H"], p["Dk"], p["Dv"]
    q, k, v = randn(p, B, T, H, Dk), randn(p, B, T, H, Dk), randn(p, B, T, H, Dv)
    decay = torch.sigmoid(randn(p, H)) * 0.5 + 0.5
    want, S = decay_linear_attn(q, k, v, decay, mode="naive", output_final_state=True)
    d, t0 = p["dtype"], p["split"]
    for mode in ("chunk", "recurrent"):
        o, S2 = decay_linear_attn(*cast(d, q, k, v, decay), mode=mode, chunk_size=p["size"],
                                  output_final_state=True)
        close(mode, o, want, d), close("S", S2, S, d)
    if t0 in (0, T):
        return
    first, second = halves(t0, q, k, v)
    o1, S1 = decay_linear_attn(*first, decay, chunk_size=p["size"], output_final_state=True)
    o2, _ = decay_linear_attn(*second, decay, chunk_size=p["size"], initial_state=S1)
    close("pieces", torch.cat([o1, o2], 1), want, torch.float64)


@FAST
@given(problems(), st.sampled_from(["softmax", "relu"]))
def test_block_attention(p, kernel):
    EXAMPLES["block_attention"] += 1
    B, T, H, Dk, Dv = p["B"], p["T"], p["H"], p["Dk"], p["Dv"]
    q, k, v = randn(p, B, T, H, Dk), randn(p, B, T, H, Dk), randn(p, B, T, H, Dv)
    scale = Dk ** -0.5
    want = block_attention_naive(q, k, v, p["size"], scale, kernel)
    d = p["dtype"]
    o = block_attention(*cast(d, q, k, v), block_size=p["size"], kernel=kernel)
    close("block", o, want, d)


# ---------------------------------------------------------------- softmax attention
@FAST
@given(problems(), st.booleans())
def test_softmax_attention(p, causal):
    EXAMPLES["softmax_attention"] += 1
    B, T, H, Dk, Dv = p["B"], p["T"], p["H"], p["Dk"], p["Dv"]
    q, k, v = randn(p, B, T, H, Dk), randn(p, B, T, H, Dk), randn(p, B, T, H, Dv)
    logits = torch.einsum("bihd,bjhd->bhij", q, k) * Dk ** -0.5
    if causal:
        logits = logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    want = torch.einsum("bhij,bjhd->bihd", logits.softmax(-1), v)
    d, t0 = p["dtype"], p["split"]
    close("softmax", softmax_attention(*cast(d, q, k, v), causal=causal), want, d)
    if causal and t0 < T:  # the last T - t0 queries against the whole cache (Tq <= Tk, aligned to the end)
        close("kv-cache", softmax_attention(q[:, t0:], k, v), want[:, t0:], torch.float64)


# ---------------------------------------------------------------- TTT
@FAST
@given(problems(), st.sampled_from(["linear", "mlp"]), st.booleans(), st.booleans())
def test_ttt(p, kind, bias, residual):
    EXAMPLES["ttt_" + kind] += 1
    B, T, H, D = p["B"], p["T"], p["H"], p["Dk"]
    q, k, v = randn(p, B, T, H, D), randn(p, B, T, H, D), randn(p, B, T, H, D)
    eta = 0.1 * torch.sigmoid(randn(p, B, T, H))
    ln_w, ln_b = 1 + 0.1 * randn(p, H, D), 0.1 * randn(p, H, D)
    if kind == "linear":
        op, state = ttt_linear, (0.3 * randn(p, 1, H, D, D), 0.1 * randn(p, 1, H, D) if bias else None)
    else:
        op = ttt_mlp
        state = (0.3 * randn(p, 1, H, D, 4 * D), 0.1 * randn(p, 1, H, 4 * D) if bias else None,
                 0.3 * randn(p, 1, H, 4 * D, D), 0.1 * randn(p, 1, H, D) if bias else None)
    opts = dict(ln_weight=ln_w, ln_bias=ln_b, residual=residual, mini_batch_size=p["size"])
    want, _ = op(q, k, v, eta, initial_state=state, mode="naive", **opts)
    d, t0 = p["dtype"], p["split"]
    opts_d = dict(opts, ln_weight=ln_w.to(d), ln_bias=ln_b.to(d))
    for mode in ("dual", "primal"):
        o, _ = op(*cast(d, q, k, v, eta), initial_state=cast(d, *state), mode=mode, **opts_d)
        close(mode, o, want, d)
    if t0 in (0, T):
        return
    first, second = halves(t0, q, k, v, eta)
    o1, s1 = op(*first, initial_state=state, output_final_state=True, **opts)
    o2, _ = op(*second, initial_state=s1, **opts)
    close("pieces", torch.cat([o1, o2], 1), want, torch.float64)


# ---------------------------------------------------------------- AFT
def band(W: torch.Tensor, window: int, causal: bool = True) -> torch.Tensor:
    """The window biases aft_local takes: causal band[t, o] = W[t, t - o]; bidirectional
    band[t, j] = W[t, t - j + window - 1] (the bias at offset j - (window - 1)); entries outside
    W are 0 (never read)."""
    T = W.shape[0]
    offsets = torch.arange(window) if causal else torch.arange(2 * window - 1) - (window - 1)
    cols = torch.arange(T)[:, None] - offsets[None, :]
    inside = (cols >= 0) & (cols < T)
    return torch.where(inside, W[torch.arange(T)[:, None], cols.clamp(0, T - 1)], 0.0)


@FAST
@given(problems(max_t=10), st.booleans())
def test_aft_full_and_simple(p, causal):
    EXAMPLES["aft"] += 1
    B, T, D = p["B"], p["T"], p["Dv"]
    q, k, v, W = randn(p, B, T, D), 3 * randn(p, B, T, D), randn(p, B, T, D), randn(p, T, T)
    d, t0 = p["dtype"], p["split"]
    for w in (W, None):
        want = aft_naive(q, k, v, w, causal)
        for mode in ("chunk", "naive"):
            o, _ = aft(*cast(d, q, k, v, w), causal=causal, chunk_size=p["size"], mode=mode)
            close(f"aft-{mode}", o, want, d)
    if not causal:
        return
    want_full, want_simple = aft_naive(q, k, v, W, True), aft_naive(q, k, v, None, True)
    o, _ = aft(*cast(d, q, k, v), mode="recurrent")
    close("simple-recurrent", o, want_simple, d)
    if t0 in (0, T):
        return
    (q1, k1, v1), (q2, k2, v2) = halves(t0, q, k, v)
    o1, s1 = aft(q1, k1, v1, output_final_state=True)
    o2, _ = aft(q2, k2, v2, initial_state=s1)
    close("simple-pieces", torch.cat([o1, o2], 1), want_simple, torch.float64)
    o1, s1 = aft(q1, k1, v1, W[:t0, :t0], output_final_state=True, chunk_size=p["size"])
    o2, _ = aft(q2, k2, v2, W[t0:], initial_state=s1, chunk_size=p["size"])
    close("full-pieces", torch.cat([o1, o2], 1), want_full, torch.float64)


@FAST
@given(problems(max_t=10), st.integers(1, 5), st.booleans())
def test_aft_local(p, window, causal):
    EXAMPLES["aft_local"] += 1
    B, T, D = p["B"], p["T"], p["Dv"]
    q, k, v, W = randn(p, B, T, D), 3 * randn(p, B, T, D), randn(p, B, T, D), randn(p, T, T)
    want = aft_local_naive(q, k, v, W, window, causal)
    d, t0 = p["dtype"], p["split"]
    bw = band(W, window, causal)
    for mode in ("chunk", "recurrent", "naive") if causal else ("chunk", "naive"):
        o, _ = aft_local(*cast(d, q, k, v, bw), window=window, causal=causal, mode=mode,
                         chunk_size=p["size"])
        close(f"local-{mode}", o, want, d)
    if not causal or t0 in (0, T):
        return
    (q1, k1, v1, b1), (q2, k2, v2, b2) = halves(t0, q, k, v, bw[None])
    o1, s1 = aft_local(q1, k1, v1, b1[0], window=window, output_final_state=True)
    o2, _ = aft_local(q2, k2, v2, b2[0], window=window, initial_state=s1)
    close("local-pieces", torch.cat([o1, o2], 1), want, torch.float64)


@FAST
@given(problems(max_t=10), st.integers(0, 2), st.booleans())
def test_aft_conv(p, half, causal):
    EXAMPLES["aft_conv"] += 1
    B, T, H, Dh = p["B"], p["T"], p["H"], p["Dv"]
    s = 2 * half + 1  # odd, so the bidirectional kernel has a centre
    q, k, v, w = randn(p, B, T, H, Dh), 3 * randn(p, B, T, H), randn(p, B, T, H, Dh), randn(p, H, s)
    want = aft_conv_naive(q, k, v, w, causal)
    d, t0 = p["dtype"], p["split"]
    for mode in ("chunk", "recurrent", "naive") if causal else ("chunk", "naive"):
        o, _ = aft_conv(*cast(d, q, k, v, w), causal=causal, mode=mode, chunk_size=p["size"])
        close(f"conv-{mode}", o, want, d)
    if not causal or t0 in (0, T):
        return
    (q1, k1, v1), (q2, k2, v2) = halves(t0, q, k, v)
    o1, s1 = aft_conv(q1, k1, v1, w, output_final_state=True)
    o2, _ = aft_conv(q2, k2, v2, w, initial_state=s1)
    close("conv-pieces", torch.cat([o1, o2], 1), want, torch.float64)


# ---------------------------------------------------------------- Infini-attention
@FAST
@given(problems(), st.sampled_from(["linear", "delta"]))
def test_infini_attention(p, update):
    EXAMPLES["infini_attention"] += 1
    B, T, H, Dk, Dv = p["B"], p["T"], p["H"], p["Dk"], p["Dv"]
    q, k, v = randn(p, B, T, H, Dk), randn(p, B, T, H, Dk), randn(p, B, T, H, Dv)
    gate = randn(p, H)
    opts = dict(segment_len=p["size"], update=update)
    want, (M, z, *_) = infini_attention(q, k, v, gate, mode="naive", output_final_state=True, **opts)
    d, t0 = p["dtype"], p["split"]
    for mode in ("chunk", "recurrent"):
        o, (M2, z2, *_) = infini_attention(*cast(d, q, k, v, gate), mode=mode,
                                           output_final_state=True, **opts)
        close(mode, o, want, d), close("M", M2, M, d), close("z", z2, z, d)
    if t0 in (0, T):
        return
    first, second = halves(t0, q, k, v)
    o1, s1 = infini_attention(*first, gate, output_final_state=True, **opts)
    o2, _ = infini_attention(*second, gate, initial_state=s1, **opts)
    close("pieces", torch.cat([o1, o2], 1), want, torch.float64)


PROPERTIES = ["linear_attn", "delta_rule", "decay_linear_attn", "block_attention",
              "softmax_attention", "ttt_linear", "ttt_mlp", "aft", "aft_local", "aft_conv",
              "infini_attention"]


def test_examples_ran():
    """Runs last in this file: every property ran examples (ttt_linear and ttt_mlp share one
    test, so each gets part of its 25). Prints the total for the report."""
    if not EXAMPLES:
        pytest.skip("run together with the properties above")
    print(f"\nproperty-test examples run: {sum(EXAMPLES.values())} {dict(EXAMPLES)}")
    for name in PROPERTIES:
        assert EXAMPLES[name] >= 3, (name, EXAMPLES[name])
