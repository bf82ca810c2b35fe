"""gated_delta_rule (Gated DeltaNet, docs/maths.md 5b): every form against the naive oracle in
float64 (outputs, final states, gradients), the equivalences it must keep (g = 0 is delta_rule, the
delta term removed is decay_linear_attn, grouped heads are expanded heads, pieces are the
whole, packed documents are separate ones), hard resets (g = -inf) and torch.compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastweights.ops import decay_linear_attn, delta_rule, gated_delta_rule, gated_delta_rule_step
from tests.helpers import assert_close64

F64 = torch.float64
# (B, T, Hk, H, Dk, Dv): T = 37 and 65 divide no chunk size; (2, 4) and (1, 3) grouped heads.
SHAPES = [(2, 37, 2, 4, 5, 7), (1, 1, 1, 1, 4, 4), (3, 16, 2, 2, 8, 3), (1, 65, 1, 3, 6, 6)]
IDS = [f"B{b}-T{t}-Hk{hk}-H{h}-Dk{dk}-Dv{dv}" for b, t, hk, h, dk, dv in SHAPES]
CHUNKS = [1, 5, 16, 64]
# Per-token log-decays: near 1 (the usual regime), strong (down to -50 per token, so a chunk's
# span reaches -6400 at C = 128) and mixed (exact zeros, -50 and everything in between).
GATES = {
    "mild": lambda u: -0.1 * u,
    "strong": lambda u: -50.0 * u,
    "mixed": lambda u: torch.where(u < 0.2, torch.zeros_like(u), torch.where(u > 0.8, -50.0, -5.0 * u)),
}


def make(B, T, Hk, H, Dk, Dv, seed=0, dtype=F64, gates="mild"):
    """q, k (k L2-normalised, as Gated DeltaNet's layer feeds them), v, beta in (0, 1), g <= 0."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hk, Dk, generator=gen, dtype=F64)
    k = F.normalize(torch.randn(B, T, Hk, Dk, generator=gen, dtype=F64), dim=-1)
    v = torch.randn(B, T, H, Dv, generator=gen, dtype=F64)
    beta = torch.rand(B, T, H, generator=gen, dtype=F64)
    g = GATES[gates](torch.rand(B, T, H, generator=gen, dtype=F64))
    return tuple(x.to(dtype) for x in (q, k, v, beta, g))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 for empty or all-zero b equal to a)."""
    scale = b.abs().max().item() if b.numel() else 0.0
    err = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    return err / scale if scale > 0 else err


def state0(B, H, Dk, Dv, seed=1):
    return torch.randn(B, H, Dk, Dv, generator=torch.Generator().manual_seed(seed), dtype=F64)


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
@pytest.mark.parametrize("chunk", CHUNKS, ids=lambda c: f"C{c}")
def test_forms_agree(shape, chunk):
    q, k, v, beta, g = make(*shape)
    B, _T, _Hk, H, Dk, Dv = shape
    S0 = state0(B, H, Dk, Dv)
    ref, Sr = gated_delta_rule(q, k, v, beta, g, scale=0.8, initial_state=S0,
                               output_final_state=True, mode="naive")
    for mode in ("recurrent", "chunk"):
        o, S = gated_delta_rule(q, k, v, beta, g, scale=0.8, initial_state=S0,
                                output_final_state=True, mode=mode, chunk_size=chunk)
        assert_close64(o, ref, what=f"{mode} o")
        assert_close64(S, Sr, what=f"{mode} S")


@pytest.mark.parametrize("gates", list(GATES))
@pytest.mark.parametrize("chunk", [16, 32, 64, 128], ids=lambda c: f"C{c}")
def test_chunk_equals_recurrence_to_1e12_relative(gates, chunk):
    """float64, T = 300 (several chunks of every size, a short last one), gates down to -50
    per token: the chunked form equals the literal recurrence to 1e-12 relative."""
    q, k, v, beta, g = make(1, 300, 2, 4, 16, 12, seed=3, gates=gates)
    S0 = state0(1, 4, 16, 12)
    ref, Sr = gated_delta_rule(q, k, v, beta, g, initial_state=S0, output_final_state=True,
                               mode="naive")
    o, S = gated_delta_rule(q, k, v, beta, g, initial_state=S0, output_final_state=True,
                            chunk_size=chunk)
    assert rel_err(o, ref) <= 1e-12
    assert rel_err(S, Sr) <= 1e-12


def _grads(mode, xs, chunk, wo, wS):
    xs = [x.clone().requires_grad_() for x in xs]
    o, S = gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True, mode=mode,
                            chunk_size=chunk, scale=0.9)
    loss = (o * wo).sum() + (S * wS).sum() if wS is not None else (o * wo).sum()
    got = torch.autograd.grad(loss, xs, allow_unused=True)
    return [torch.zeros_like(x) if d is None else d for x, d in zip(xs, got)]


@pytest.mark.parametrize("chunk", [1, 5, 16, 64], ids=lambda c: f"C{c}")
@pytest.mark.parametrize("gates", ["mild", "mixed"])
@pytest.mark.parametrize("use", ["o", "S", "both"])
def test_chunk_backward_matches_naive_autograd(chunk, gates, use):
    """The hand-written backward against autograd through the naive loop: B = 2, T = 37 (no
    multiple of the chunk), grouped heads (Hk 2, H 4), Dk != Dv, some beta exactly 0 or 1, a
    random initial state, losses on o only, the final state only, or both."""
    q, k, v, beta, g = make(2, 37, 2, 4, 5, 3, seed=21, gates=gates)
    beta = beta.clone()
    beta[0, :3], beta[1, 5:8] = 0.0, 1.0
    S0 = state0(2, 4, 5, 3)
    gen = torch.Generator().manual_seed(5)
    wo = torch.randn(2, 37, 4, 3, generator=gen, dtype=F64)
    wS = torch.randn(2, 4, 5, 3, generator=gen, dtype=F64)
    if use == "S":
        wo = torch.zeros_like(wo)
    xs = (q, k, v, beta, g, S0)
    chunked = _grads("chunk", xs, chunk, wo, None if use == "o" else wS)
    naive = _grads("naive", xs, chunk, wo, None if use == "o" else wS)
    for name, a, b in zip(["q", "k", "v", "beta", "g", "S0"], chunked, naive):
        assert rel_err(a, b) <= 1e-12, f"d{name}: {rel_err(a, b):.2e}"


@pytest.mark.parametrize("mode,T,chunk,Hk,H", [
    ("naive", 9, 1, 1, 1), ("recurrent", 9, 1, 1, 1), ("chunk", 9, 4, 1, 1), ("chunk", 37, 16, 1, 2),
], ids=["naive-T9", "recurrent-T9", "chunk-T9-C4", "chunk-T37-C16-grouped"])
def test_gradcheck(mode, T, chunk, Hk, H):
    """gradcheck in float64 for q, k, v, beta, g and the initial state (g kept below -0.05,
    so gradcheck's perturbations stay inside the valid range g <= 0)."""
    q, k, v, beta, g = make(1, T, Hk, H, 3, 2, seed=6)
    g = -0.05 - 2.0 * torch.rand(g.shape, generator=torch.Generator().manual_seed(7), dtype=F64)
    S0 = state0(1, H, 3, 2)
    args = [x.requires_grad_() for x in (q, k, v, beta, g, S0)]

    def f(q, k, v, beta, g, S0):
        return gated_delta_rule(q, k, v, beta, g, initial_state=S0, output_final_state=True,
                                mode=mode, chunk_size=chunk, scale=0.7)

    assert torch.autograd.gradcheck(f, args)


def test_chunk_backward_is_twice_differentiable():
    q, k, v, beta, g = make(1, 7, 1, 2, 3, 2, seed=22)
    g = -0.1 - torch.rand(g.shape, generator=torch.Generator().manual_seed(8), dtype=F64)
    S0 = state0(1, 2, 3, 2)
    args = [x.requires_grad_() for x in (q, k, v, beta, g, S0)]

    def f(q, k, v, beta, g, S0):
        return gated_delta_rule(q, k, v, beta, g, initial_state=S0, output_final_state=True,
                                chunk_size=3)

    assert torch.autograd.gradgradcheck(f, args)


@pytest.mark.parametrize("mode,chunk", [("chunk", 8), ("chunk", 64), ("recurrent", 1), ("naive", 1)])
def test_gate_zero_is_delta_rule(mode, chunk):
    """g = 0 (no decay) is the delta rule: outputs, final state and gradients."""
    q, k, v, beta, _ = make(2, 29, 3, 3, 5, 4, seed=9)
    S0 = state0(2, 3, 5, 4)
    g = torch.zeros_like(beta)
    xs = [x.clone().requires_grad_() for x in (q, k, v, beta, S0)]
    o, S = gated_delta_rule(*xs[:4], g, initial_state=xs[4], output_final_state=True, mode=mode,
                            chunk_size=chunk, scale=1.3)
    ys = [x.clone().requires_grad_() for x in (q, k, v, beta, S0)]
    od, Sd = delta_rule(*ys[:4], initial_state=ys[4], output_final_state=True, mode=mode,
                        chunk_size=chunk, scale=1.3)
    assert_close64(o, od, what="o")
    assert_close64(S, Sd, what="S")
    w = torch.randn_like(o)
    for a, b in zip(torch.autograd.grad((o * w).sum() + S.sum(), xs),
                    torch.autograd.grad((od * w).sum() + Sd.sum(), ys)):
        assert_close64(a, b, what="gradient")


@pytest.mark.parametrize("mode,chunk", [("chunk", 4), ("chunk", 64), ("recurrent", 1), ("naive", 1)])
def test_without_delta_term_is_decay_linear_attn(mode, chunk):
    """The delta term k_t^T (k_t S'_t) vanishes when k_t is orthogonal to everything the state
    holds: mutually orthogonal keys (any norms; T <= Dk) and an initial state whose rows lie
    orthogonal to all of them. Then, with a per-head constant gate g = log(lambda_h),
    S_t = lambda_h S_{t-1} + beta_t k_t^T v_t: decay_linear_attn (docs/maths.md 3.5, decay [H], no
    normaliser) with values beta_t v_t, including the initial state's decayed read-out."""
    B, T, H, Dk, Dv = 2, 9, 3, 12, 5
    gen = torch.Generator().manual_seed(10)
    basis = torch.linalg.qr(torch.randn(B, H, Dk, Dk, generator=gen, dtype=F64))[0]  # columns
    norms = 0.5 + torch.rand(B, H, T, 1, generator=gen, dtype=F64)
    k = (basis[..., :T].transpose(-1, -2) * norms).permute(0, 2, 1, 3)  # [B, T, H, Dk]
    rest = basis[..., T:]  # [B, H, Dk, Dk - T]: orthogonal to every key
    S0 = rest @ torch.randn(B, H, Dk - T, Dv, generator=gen, dtype=F64)
    q = torch.randn(B, T, H, Dk, generator=gen, dtype=F64)
    v = torch.randn(B, T, H, Dv, generator=gen, dtype=F64)
    beta = torch.rand(B, T, H, generator=gen, dtype=F64)
    lam = torch.tensor([0.3, 0.9, 1.0], dtype=F64)
    g = lam.log().expand(B, T, H)
    o, S = gated_delta_rule(q, k, v, beta, g, scale=0.6, initial_state=S0,
                            output_final_state=True, mode=mode, chunk_size=chunk)
    od, Sd = decay_linear_attn(q, k, beta.unsqueeze(-1) * v, lam, scale=0.6, initial_state=S0,
                               output_final_state=True, mode=mode, chunk_size=chunk)
    assert_close64(o, od, what="o")
    assert_close64(S, Sd, what="S")


@pytest.mark.parametrize("mode,chunk", [("chunk", 5), ("chunk", 64), ("recurrent", 1), ("naive", 1)])
def test_grouped_heads_equal_expanded_heads(mode, chunk):
    """Hk = 2 key heads serving H = 6 value heads equals q, k repeated to 6 heads with
    repeat_interleave (value head h reads key head h // 3, transformers' Qwen3.5 layout);
    the grouped gradients of q, k are the expanded ones summed over each group."""
    q, k, v, beta, g = make(2, 23, 2, 6, 4, 5, seed=11, gates="mixed")
    S0 = state0(2, 6, 4, 5)
    xs = [x.clone().requires_grad_() for x in (q, k)]
    o, S = gated_delta_rule(*xs, v, beta, g, initial_state=S0, output_final_state=True,
                            mode=mode, chunk_size=chunk)
    ys = [x.clone().requires_grad_() for x in (q, k)]
    oe, Se = gated_delta_rule(*(y.repeat_interleave(3, dim=2) for y in ys), v, beta, g,
                              initial_state=S0, output_final_state=True, mode=mode,
                              chunk_size=chunk)
    assert_close64(o, oe, what="o")
    assert_close64(S, Se, what="S")
    w = torch.randn_like(o)
    for a, b in zip(torch.autograd.grad((o * w).sum() + S.sum(), xs),
                    torch.autograd.grad((oe * w).sum() + Se.sum(), ys)):
        assert_close64(a, b, what="gradient")


@pytest.mark.parametrize("splits", [(5,), (1, 2, 3), (20, 21), (16, 32)], ids=str)
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_pieces_equal_whole(splits, mode):
    q, k, v, beta, g = make(2, 41, 1, 2, 5, 4, seed=12, gates="mixed")

    def run(sl, state):
        return gated_delta_rule(q[:, sl], k[:, sl], v[:, sl], beta[:, sl], g[:, sl],
                                initial_state=state, output_final_state=True, mode=mode,
                                chunk_size=16)

    whole, Sw = run(slice(None), None)
    outs, state, start = [], None, 0
    for stop in [*splits, 41]:
        o, state = run(slice(start, stop), state)
        outs.append(o)
        start = stop
    assert_close64(torch.cat(outs, 1), whole)
    assert_close64(state, Sw)


def test_one_token_steps_equal_chunked():
    """One-token calls of mode="chunk" (the decoding step) and gated_delta_rule_step called
    directly, state carried, equal the chunked form over the whole sequence."""
    q, k, v, beta, g = make(2, 19, 2, 4, 5, 3, seed=13, gates="mixed")
    S0 = state0(2, 4, 5, 3)
    whole, Sw = gated_delta_rule(q, k, v, beta, g, scale=0.5, initial_state=S0,
                                 output_final_state=True, chunk_size=8)
    outs, S = [], S0
    for t in range(19):
        sl = slice(t, t + 1)
        o, S = gated_delta_rule(q[:, sl], k[:, sl], v[:, sl], beta[:, sl], g[:, sl], scale=0.5,
                                initial_state=S, output_final_state=True)
        outs.append(o)
    assert_close64(torch.cat(outs, 1), whole)
    assert_close64(S, Sw)
    outs, S = [], S0
    for t in range(19):
        sl = slice(t, t + 1)
        o, S = gated_delta_rule_step(q[:, sl], k[:, sl], v[:, sl], beta[:, sl], g[:, sl],
                                     state=S, scale=0.5)
        outs.append(o)
    assert_close64(torch.cat(outs, 1), whole)
    assert_close64(S, Sw)


def test_step_leaves_the_carried_state_unchanged():
    q, k, v, beta, g = make(1, 1, 1, 2, 4, 4, seed=14)
    S0 = state0(1, 2, 4, 4)
    before = S0.clone()
    gated_delta_rule(q, k, v, beta, g, initial_state=S0, output_final_state=True)
    assert torch.equal(S0, before)
    gated_delta_rule_step(q, k, v, beta, g, state=S0)
    assert torch.equal(S0, before)


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_causality(mode):
    q, k, v, beta, g = make(1, 20, 1, 2, 4, 4, seed=15)
    base = gated_delta_rule(q, k, v, beta, g, mode=mode, chunk_size=8)[0]
    q2, k2, v2, b2, g2 = (x.clone() for x in (q, k, v, beta, g))
    for x in (q2, k2, v2):
        x[:, 12:] += 5.0
    b2[:, 12:], g2[:, 12:] = 0.9, -3.0
    pert = gated_delta_rule(q2, k2, v2, b2, g2, mode=mode, chunk_size=8)[0]
    assert_close64(pert[:, :12], base[:, :12])
    assert (pert[:, 12:] - base[:, 12:]).abs().max() > 1e-3


# --- hard resets (g = -inf) and extreme gates ------------------------------------------------

RESETS = [0, 7, 8, 15, 16, 30]  # chunk starts and ends for C = 8 and 16, and the middle


@pytest.mark.parametrize("chunk", [8, 16, 64], ids=lambda c: f"C{c}")
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["float32", "float64"])
def test_minus_inf_gate_is_a_hard_reset(chunk, dtype):
    """g_t = -inf forgets everything before token t: from t on, outputs equal a fresh run of
    the tokens t.. from the zero state; every output and gradient stays finite, float32 too."""
    q, k, v, beta, g = make(2, 37, 1, 2, 6, 5, seed=16, gates="mild", dtype=dtype)
    g = g.clone()
    g[:, RESETS] = float("-inf")
    S0 = state0(2, 2, 6, 5).to(dtype)
    xs = [x.clone().requires_grad_() for x in (q, k, v, beta, g)]
    o, S = gated_delta_rule(*xs, initial_state=S0, output_final_state=True, chunk_size=chunk)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    (o.square().sum() + S.sum()).backward()
    for x in xs:
        assert torch.isfinite(x.grad).all()
    ref, Sr = gated_delta_rule(*(x.double() for x in (q, k, v, beta, g)),
                               initial_state=S0.double(), output_final_state=True, mode="naive")
    tol = 1e-12 if dtype == F64 else 1e-5
    assert rel_err(o, ref) <= tol and rel_err(S, Sr) <= tol
    t = RESETS[-1]
    fresh, _ = gated_delta_rule(*(x[:, t:].double() for x in (q, k, v, beta, g)), mode="naive")
    assert rel_err(o[:, t:], fresh) <= tol


def test_minus_inf_gradients_match_naive_autograd():
    q, k, v, beta, g = make(1, 29, 1, 2, 4, 3, seed=17, gates="mixed")
    g = g.clone()
    g[0, [0, 9, 10, 20]] = float("-inf")
    S0 = state0(1, 2, 4, 3)
    wo = torch.randn(1, 29, 2, 3, generator=torch.Generator().manual_seed(2), dtype=F64)
    chunked = _grads("chunk", (q, k, v, beta, g, S0), 8, wo, torch.ones_like(S0))
    naive = _grads("naive", (q, k, v, beta, g, S0), 8, wo, torch.ones_like(S0))
    for name, a, b in zip(["q", "k", "v", "beta", "g", "S0"], chunked, naive):
        assert torch.isfinite(a).all(), f"d{name} not finite"
        assert rel_err(a, b) <= 1e-12, f"d{name}: {rel_err(a, b):.2e}"


@pytest.mark.parametrize("chunk", [64, 128], ids=lambda c: f"C{c}")
def test_strong_gates_float32_long_chunks(chunk):
    """-50 per token over chunks of 128 (exponents to -6400) and a reset at -1e4 followed by
    gentle gates: float32 stays finite and close to float64, the gentle decays after the large
    gate exact to float32 rounding (segment sums, no cancellation of large running sums)."""
    q, k, v, beta, g = make(1, 300, 1, 2, 16, 8, seed=18, gates="strong")
    g = g.clone()
    g[:, 150:] = -0.01
    g[:, 150] = -1e4
    ref, Sr = gated_delta_rule(q, k, v, beta, g, output_final_state=True, mode="naive")
    o, S = gated_delta_rule(*(x.float() for x in (q, k, v, beta, g)), output_final_state=True,
                            chunk_size=chunk)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert rel_err(o, ref) <= 2e-5 and rel_err(S, Sr) <= 2e-5


# --- dtypes ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)],
                         ids=["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_low_precision_close_to_float64(dtype, tol, mode):
    q, k, v, beta, g = make(2, 70, 2, 4, 8, 8, seed=19)
    ref, _ = gated_delta_rule(q, k, v, beta, g, output_final_state=True, chunk_size=16)
    low, S = gated_delta_rule(*(x.to(dtype) for x in (q, k, v, beta, g)), mode=mode,
                              output_final_state=True, chunk_size=16)
    assert low.dtype == dtype and S.dtype == torch.float32
    assert rel_err(low, ref) <= tol


def test_float32_gates_drive_bfloat16_inputs():
    """beta and g may be wider than q, k, v: used in the compute dtype, like the state."""
    q, k, v, beta, g = make(1, 20, 1, 2, 4, 4, seed=20)
    o, S = gated_delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), beta.float(), g.float(),
                            output_final_state=True, initial_state=torch.zeros(1, 2, 4, 4))
    ref, _ = gated_delta_rule(*(x.bfloat16().double() for x in (q, k, v)), beta, g)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    assert rel_err(o, ref) <= 1e-2


def test_autocast_does_not_reach_inside():
    q, k, v, beta, g = (x.float() for x in make(1, 33, 1, 2, 8, 8, seed=23))
    ref, Sr = gated_delta_rule(q, k, v, beta, g, output_final_state=True, chunk_size=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, S = gated_delta_rule(q, k, v, beta, g, output_final_state=True, chunk_size=16)
    assert o.dtype == torch.float32 and S.dtype == torch.float32
    torch.testing.assert_close(o, ref)
    torch.testing.assert_close(S, Sr)


# --- packed documents and torch.compile --------------------------------------------------------

CU = torch.tensor([0, 5, 6, 17, 23])


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_packed_equals_separate(mode):
    q, k, v, beta, g = make(1, 23, 1, 2, 4, 4, seed=24, gates="mixed")
    inits = [state0(1, 2, 4, 4, seed=s) for s in range(4)]
    o, states = gated_delta_rule(q, k, v, beta, g, cu_seqlens=CU, initial_state=inits,
                                 output_final_state=True, mode=mode, chunk_size=4)
    assert isinstance(states, list) and len(states) == 4
    for (a, b), init, st in zip([(0, 5), (5, 6), (6, 17), (17, 23)], inits, states):
        o_doc, st_doc = gated_delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], beta[:, a:b],
                                         g[:, a:b], initial_state=init,
                                         output_final_state=True, mode=mode, chunk_size=4)
        assert_close64(o[:, a:b], o_doc, what=f"doc {a}:{b}")
        assert_close64(st, st_doc, what=f"state {a}:{b}")


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward-backward"])
def test_compiles_without_graph_breaks_and_matches_eager(backward):
    """As tests/ops/test_compile.py: torch.compile(fullgraph=True, dynamic=True) with
    backend="aot_eager" (what inductor would get), T = 21 (no multiple of the chunk size),
    grouped heads; with ``backward`` also the compiled graph's backward (the hand-written one,
    traced by AOT autograd) against eager gradients."""
    torch._dynamo.reset()
    q, k, v, beta, g = (x.float() for x in make(2, 21, 1, 3, 8, 8, seed=25, gates="mixed"))
    S0 = state0(2, 3, 8, 8).float()

    def fn(q, k, v, beta, g, S0):
        return gated_delta_rule(q, k, v, beta, g, initial_state=S0, output_final_state=True,
                                chunk_size=8)

    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    results = []
    for f in (compiled, fn):
        args = [x.clone().requires_grad_(backward) for x in (q, k, v, beta, g, S0)]
        o, S = f(*args)
        out = [o, S]
        if backward:
            out += torch.autograd.grad((o * o).sum() + S.sum(), args)
        results.append(out)
    got, want = results
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert torch.isfinite(a).all()


# --- bad arguments -------------------------------------------------------------------------------

Q = torch.randn(2, 5, 2, 4)
V = torch.randn(2, 5, 4, 6)
B_ = torch.rand(2, 5, 4)
G_ = -torch.rand(2, 5, 4)

BAD = [
    ("q rank", lambda: gated_delta_rule(Q[0], Q[0], V, B_, G_), ValueError, "q must be a 4-D"),
    ("k shape", lambda: gated_delta_rule(Q, Q[:, :4], V, B_, G_), ValueError, "k must have the same shape"),
    ("v length", lambda: gated_delta_rule(Q, Q, V[:, :4], B_, G_), ValueError, "v must have shape"),
    ("v heads", lambda: gated_delta_rule(Q, Q, V[:, :, :3], B_[..., :3], G_[..., :3]), ValueError, "multiple of"),
    ("dtype mix", lambda: gated_delta_rule(Q, Q.double(), V, B_, G_), TypeError, "dtype"),
    ("beta shape", lambda: gated_delta_rule(Q, Q, V, B_[..., :2], G_), ValueError, "beta must have shape"),
    ("g shape", lambda: gated_delta_rule(Q, Q, V, B_, G_[..., :2]), ValueError, "g must have shape"),
    ("g not tensor", lambda: gated_delta_rule(Q, Q, V, B_, -0.5), TypeError, "g must be a torch.Tensor"),
    ("g positive", lambda: gated_delta_rule(Q, Q, V, B_, G_.index_put((torch.tensor([1]),) * 3, torch.tensor(0.5))), ValueError, "g must be <= 0"),
    ("g nan", lambda: gated_delta_rule(Q, Q, V, B_, torch.full_like(G_, float("nan"))), ValueError, "g must be <= 0"),
    ("state heads", lambda: gated_delta_rule(Q, Q, V, B_, G_, initial_state=torch.zeros(2, 2, 4, 6)), ValueError, "initial_state"),
    ("mode", lambda: gated_delta_rule(Q, Q, V, B_, G_, mode="parallel"), ValueError, "mode must be one of"),
    ("chunk 0", lambda: gated_delta_rule(Q, Q, V, B_, G_, chunk_size=0), ValueError, "chunk_size must be >= 1"),
    ("scale inf", lambda: gated_delta_rule(Q, Q, V, B_, G_, scale=float("inf")), ValueError, "scale"),
    ("packed state", lambda: gated_delta_rule(Q[:1], Q[:1], V[:1], B_[:1], G_[:1], cu_seqlens=torch.tensor([0, 2, 5]), initial_state=torch.zeros(1, 4, 4, 6)), ValueError, "one state per document"),
]


@pytest.mark.parametrize("call,exc,words", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    assert words in str(info.value)


def test_minus_inf_and_zero_gates_are_accepted():
    g = G_.clone()
    g[0, 0, 0], g[1, 2, 3] = float("-inf"), 0.0
    o, _ = gated_delta_rule(Q, Q, V, B_, g)
    assert torch.isfinite(o).all()
