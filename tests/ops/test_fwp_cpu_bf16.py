"""The CPU bfloat16 product path of linear_attn and delta_rule (ops/_autocast.py): when it is
taken (FASTWEIGHTS_CPU_BF16, CPU capabilities), and what it computes: float32 states, outputs and
states within a bound derived from the operations against the float64 oracle (a bound a
bfloat16 state breaks), gradients, pieces == whole, packed batches.

Error bounds, with u = 2^-8 the unit roundoff of bfloat16 (8 significand bits) and first order
in u. A product with operands rounded to bfloat16 and its result rounded once (the CPU matmul
reduces in float32, then rounds to bfloat16) is within (2u + u) sum |a_i b_i| of the exact one;
float32 sums of n terms add n 2^-24 relative to the same sum of magnitudes.

- linear attention, elementwise: S_prev = S0 + sum of chunk K^T V, each within 3u |K|^T |V|;
  Q S_prev rounds q, S_prev and its result (3u) on top of S_prev's own error (3u); tril(Q K^T) V
  rounds q, k, the scores, v and the result (5u). So |o - o64| <= (6u + T 2^-24) M with M the
  same computation on absolute values (|q|, |k|, |v|, |S0|, and |z0| for the float32
  denominator, which for the positive features used here is the denominator itself), and
  |S - S64| <= (3u + T 2^-24) (|S0| + |K|^T |V|). The normaliser z never meets bfloat16: it
  equals the float32 path's bit for bit.
- delta rule, per head and normwise (the hand-off mixes terms of both signs, so no elementwise
  magnitude bounds it): each chunk's contribution K^T U carries <= 3u (U0 = Tm V), and the
  float32 hand-off S <- (I - K^T W) S + K^T U0 is a contraction for beta in [0, 1] and
  sum-normalised keys (|k|_2 <= 1), so the state stays within 3u of its size; the output path
  adds the same 3u as above: max|o - o64| <= (6u + T 2^-24) max|o64| and max|S - S64| <=
  (3u + T 2^-24) max|S64|.

A bfloat16 state breaks these bounds once it has absorbed enough chunks: adding a chunk's
contribution to a large bfloat16 sum rounds it at the sum's scale, an error that grows with the
number of additions (the tests below show it at T = 4096).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from fastweights.ops import _autocast, delta_rule, elu_plus_one, linear_attn, sum_norm
from fastweights.ops._autocast import CPU_BF16_ENV, cpu_bf16_products, cpu_has_fast_bf16
from fastweights.ops.delta_rule.chunk import delta_rule_chunk
from fastweights.ops.delta_rule.recurrent import delta_rule_recurrent
from fastweights.ops.linear_attn.chunk import linear_attn_chunk

U = 2.0**-8  # bfloat16 unit roundoff
U32 = 2.0**-24  # float32 unit roundoff


def autocast_bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def data(B, T, H, Dk, Dv, seed=0, positive_v=False):
    """float64 q, k (positive features elu+1), v, beta in [0, 1), S0 and z0 >= 0."""
    g = torch.Generator().manual_seed(seed)
    q = elu_plus_one(torch.randn(B, T, H, Dk, generator=g, dtype=torch.float64))
    k = elu_plus_one(torch.randn(B, T, H, Dk, generator=g, dtype=torch.float64))
    v = torch.randn(B, T, H, Dv, generator=g, dtype=torch.float64)
    if positive_v:
        v = v.abs()
    beta = torch.rand(B, T, H, generator=g, dtype=torch.float64)
    S0 = torch.randn(B, H, Dk, Dv, generator=g, dtype=torch.float64)
    z0 = torch.rand(B, H, Dk, generator=g, dtype=torch.float64)
    return q, k, v, beta, S0, z0


def f32(*xs):
    return tuple(x.float() for x in xs)


def ratio(err: torch.Tensor, bound: torch.Tensor) -> float:
    """max(err / bound): <= 1 when the bound holds."""
    return (err / bound).max().item()


def linear_bounds(q, k, v, S0, z0, normalize, C):
    """The float64 oracle (o, S) and the bounds (on o, on S) of the module docstring."""
    T = q.shape[1]
    kw = {"normalize": normalize, "chunk_size": C, "output_final_state": True}
    o64, (S64, _) = linear_attn(q, k, v, initial_state=(S0, z0), **kw)
    M, (SM, _) = linear_attn(q.abs(), k.abs(), v.abs(), initial_state=(S0.abs(), z0.abs()), **kw)
    return o64, S64, (6 * U + T * U32) * M, (3 * U + T * U32) * SM


def delta_bounds(o64, S64, T):
    """Per-head normwise bounds (on o, on S) of the module docstring: [B, 1, H, 1], [B, H, 1, 1]."""
    return ((6 * U + T * U32) * o64.abs().amax(dim=(1, 3), keepdim=True),
            (3 * U + T * U32) * S64.abs().amax(dim=(2, 3), keepdim=True))


# --- when the path is taken ------------------------------------------------------------------


def test_policy_needs_cpu_bfloat16_autocast(monkeypatch):
    monkeypatch.setenv(CPU_BF16_ENV, "on")
    assert not cpu_bf16_products()  # no autocast
    with torch.autocast("cpu", dtype=torch.float16):
        assert not cpu_bf16_products()
    with autocast_bf16():
        assert cpu_bf16_products()
        monkeypatch.setenv(CPU_BF16_ENV, "off")
        assert not cpu_bf16_products()


@pytest.mark.parametrize("flags,fast", [
    ({}, False), ({"avx512_f": True, "avx512_vnni": True}, False),
    ({"amx_bf16": True, "amx_tile": True}, True), ({"avx512_bf16": True}, True),
    ({"avx512_bf16": False, "amx_bf16": False}, False),
], ids=["avx2", "avx512-no-bf16", "amx", "avx512-bf16", "flags-false"])
@pytest.mark.parametrize("env", [None, "", "auto"], ids=["unset", "empty", "auto"])
def test_auto_follows_the_cpu_capabilities(monkeypatch, flags, fast, env):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True, **flags})
    if env is None:
        monkeypatch.delenv(CPU_BF16_ENV, raising=False)
    else:
        monkeypatch.setenv(CPU_BF16_ENV, env)
    assert cpu_has_fast_bf16() is fast
    with autocast_bf16():
        assert cpu_bf16_products() is fast


def test_capability_check_without_get_capabilities(monkeypatch):
    # torch before 2.10 has only the private per-feature checks.
    monkeypatch.delattr(torch.cpu, "get_capabilities")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False, raising=False)
    assert not cpu_has_fast_bf16()
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert cpu_has_fast_bf16()


def test_auto_on_this_machine(monkeypatch):
    """auto takes the path exactly where this CPU reports AMX-BF16 or AVX512-BF16; where it
    does not (the AVX2 machines this was written on), results are the float32 path's bit for
    bit."""
    caps = torch.cpu.get_capabilities()
    fast = bool(caps.get("amx_bf16") or caps.get("avx512_bf16"))
    assert cpu_has_fast_bf16() is fast
    monkeypatch.delenv(CPU_BF16_ENV, raising=False)
    q, k, v, *_ = f32(*data(1, 40, 2, 8, 8))
    want, _ = linear_attn(q, k, v, chunk_size=16)
    with autocast_bf16():
        assert cpu_bf16_products() is fast
        got, _ = linear_attn(q, k, v, chunk_size=16)
    assert torch.equal(got, want) is not fast


@pytest.mark.parametrize("value", ["yes", "ON", "1", "bf16"])
def test_bad_env_value_is_an_error_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(CPU_BF16_ENV, value)
    q, k, v, beta, *_ = f32(*data(1, 9, 1, 4, 4))
    with pytest.raises(ValueError, match=f"{CPU_BF16_ENV} must be one of auto, on, off"):
        cpu_bf16_products()
    with autocast_bf16():
        with pytest.raises(ValueError, match=CPU_BF16_ENV):
            linear_attn(q, k, v)
        with pytest.raises(ValueError, match=CPU_BF16_ENV):
            delta_rule(q, k, v, beta)


def _all_outputs(q, k, v, beta, S0, z0, autocast=False, C=8):
    """Outputs, final states and input gradients of both ops (both normalisations), the
    forward under CPU bfloat16 autocast or not. The backward runs outside autocast, as torch
    advises: the autograd engine runs a backward pass with the autocast state of the
    ``backward()`` call, so one called inside the context would run the ops' backward products
    in bfloat16 whatever path their forward took."""
    got = []
    for op in ("linear", "linear-norm", "delta"):
        xs = [x.detach().clone().requires_grad_() for x in (q, k, v, beta, S0, z0)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if op == "delta":
                o, S = delta_rule(sum_norm(xs[0]), sum_norm(xs[1]), xs[2], xs[3],
                                  initial_state=xs[4], output_final_state=True, chunk_size=C)
                states = (S,)
            else:
                o, states = linear_attn(*xs[:3], normalize=op == "linear-norm", chunk_size=C,
                                        initial_state=(xs[4], xs[5]), output_final_state=True)
        (o.float().square().sum() + sum(s.sum() for s in states)).backward()
        got += [o, *states, *(x.grad for x in xs if x.grad is not None)]
    return got


@pytest.mark.parametrize("setting", ["off", "auto-without-fast-bf16"])
def test_forced_off_and_auto_without_flags_are_the_float32_path_bit_for_bit(monkeypatch, setting):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True})
    monkeypatch.setenv(CPU_BF16_ENV, "off" if setting == "off" else "auto")
    xs = f32(*data(2, 37, 3, 5, 7))
    want = _all_outputs(*xs)
    got = _all_outputs(*xs, autocast=True)
    assert len(got) == len(want) == 23  # 8 + 8 + 7 tensors
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_auto_with_fast_bf16_is_the_forced_path(monkeypatch):
    xs = f32(*data(2, 37, 3, 5, 7))
    monkeypatch.setenv(CPU_BF16_ENV, "on")
    forced = _all_outputs(*xs, autocast=True)
    monkeypatch.setenv(CPU_BF16_ENV, "auto")
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"amx_bf16": True})
    auto = _all_outputs(*xs, autocast=True)
    assert all(torch.equal(a, b) for a, b in zip(auto, forced))
    plain = _all_outputs(*xs)
    assert not torch.equal(forced[0], plain[0])  # the path was taken


def test_float64_inputs_stay_float64(monkeypatch):
    monkeypatch.setenv(CPU_BF16_ENV, "on")
    xs = data(1, 30, 2, 4, 4)
    want = _all_outputs(*xs)
    got = _all_outputs(*xs, autocast=True)
    assert all(g.dtype == torch.float64 and torch.equal(g, w) for g, w in zip(got, want))


def test_the_choice_does_not_leak_past_the_call(monkeypatch):
    monkeypatch.setenv(CPU_BF16_ENV, "on")
    q, k, v, *_ = f32(*data(1, 9, 1, 4, 4))
    with autocast_bf16():
        linear_attn(q, k, v)
        assert not _autocast.bf16_products()
        with pytest.raises(ValueError, match="chunk_size"):
            linear_attn(q, k, v, chunk_size=0)
        assert not _autocast.bf16_products()
    assert not _autocast.bf16_products()


# --- what it computes ------------------------------------------------------------------------


@pytest.mark.parametrize("normalize", [False, True], ids=["unnorm", "norm"])
@pytest.mark.parametrize("shape,C,positive_v", [
    ((2, 203, 3, 12, 7), 16, False), ((1, 300, 2, 16, 16), 64, True), ((1, 45, 1, 5, 3), 8, False),
], ids=["B2-T203-H3-Dk12-Dv7-C16", "B1-T300-H2-D16-C64-positive-v", "B1-T45-H1-Dk5-Dv3-C8"])
def test_linear_attn_within_the_bound_with_float32_states(monkeypatch, shape, C, positive_v, normalize):
    monkeypatch.setenv(CPU_BF16_ENV, "on")
    q, k, v, _, S0, z0 = data(*shape, positive_v=positive_v)
    o64, S64, bound_o, bound_S = linear_bounds(q, k, v, S0, z0, normalize, C)
    want, (_, z32) = linear_attn(*f32(q, k, v), normalize=normalize, chunk_size=C,
                                 initial_state=f32(S0, z0), output_final_state=True)
    with autocast_bf16():
        o, (S, z) = linear_attn(*f32(q, k, v), normalize=normalize, chunk_size=C,
                                initial_state=f32(S0, z0), output_final_state=True)
    assert o.dtype == S.dtype == z.dtype == torch.float32
    assert not torch.equal(o, want)  # the bfloat16 path ran
    assert ratio((o.double() - o64).abs(), bound_o) <= 1
    assert ratio((S.double() - S64).abs(), bound_S) <= 1
    assert torch.equal(z, z32)


@pytest.mark.parametrize("shape,C", [((2, 203, 3, 12, 7), 16), ((1, 300, 2, 16, 16), 64)],
                         ids=["B2-T203-H3-Dk12-Dv7-C16", "B1-T300-H2-D16-C64"])
def test_delta_rule_within_the_bound_with_float32_state(monkeypatch, shape, C):
    monkeypatch.setenv(CPU_BF16_ENV, "on")
    q, k, v, beta, S0, _ = data(*shape)
    q, k = sum_norm(q), sum_norm(k)
    o64, S64 = delta_rule(q, k, v, beta, initial_state=S0, output_final_state=True, chunk_size=C)
    bound_o, bound_S = delta_bounds(o64, S64, shape[1])
    want, _ = delta_rule(*f32(q, k, v, beta), initial_state=S0.float(), chunk_size=C)
    with autocast_bf16():
        o, S = delta_rule(*f32(q, k, v, beta), initial_state=S0.float(), output_final_state=True,
                          chunk_size=C)
    assert o.dtype == S.dtype == torch.float32
    assert not torch.equal(o, want)
    assert ratio((o.double() - o64).abs(), bound_o) <= 1
    assert ratio((S.double() - S64).abs(), bound_S) <= 1


@pytest.mark.parametrize("normalize", [False, True], ids=["unnorm", "norm"])
def test_linear_attn_bound_is_broken_by_a_bfloat16_state(monkeypatch, normalize):
    """At T = 4096 in chunks of 16 (256 additions to the state) with positive values, the same
    chunked algorithm with everything in bfloat16, states included, is outside the bound the
    float32-state path keeps."""
    monkeypatch.setenv(CPU_BF16_ENV, "on")
    q, k, v, _, S0, z0 = data(1, 4096, 2, 16, 16, seed=1, positive_v=True)
    S0, z0 = S0.abs(), z0
    o64, S64, bound_o, bound_S = linear_bounds(q, k, v, S0, z0, normalize, 16)
    with autocast_bf16():
        o, (S, _) = linear_attn(*f32(q, k, v), normalize=normalize, chunk_size=16,
                                initial_state=f32(S0, z0), output_final_state=True)
    assert ratio((o.double() - o64).abs(), bound_o) <= 1
    assert ratio((S.double() - S64).abs(), bound_S) <= 1
    bf = tuple(x.bfloat16() for x in (q, k, v, S0, z0))
    o_all, S_all, _ = linear_attn_chunk(*bf, normalize=normalize, eps=1e-6, chunk_size=16)
    assert S_all.dtype == torch.bfloat16
    assert ratio((o_all.double() - o64).abs(), bound_o) > 1.5
    assert ratio((S_all.double() - S64).abs(), bound_S) > 1.5


def test_delta_rule_bound_is_broken_by_a_bfloat16_state(monkeypatch):
    """The delta rule with a bfloat16 state (its token recurrence, all in bfloat16; the chunked
    form cannot run in bfloat16 on CPU: no bfloat16 triangular solve) at T = 4096 with
    sum-normalised keys, whose small |k|^2 makes the state remember many chunks, is outside
    the bound; the float32-state path is inside."""
    monkeypatch.setenv(CPU_BF16_ENV, "on")
    q, k, v, beta, S0, _ = data(1, 4096, 2, 16, 16, seed=0, positive_v=True)
    q, k, S0 = sum_norm(q), sum_norm(k), torch.zeros_like(S0)
    o64, S64 = delta_rule(q, k, v, beta, initial_state=S0, output_final_state=True, chunk_size=16)
    bound_o, bound_S = delta_bounds(o64, S64, 4096)
    with autocast_bf16():
        o, S = delta_rule(*f32(q, k, v, beta), initial_state=S0.float(), output_final_state=True,
                          chunk_size=16)
    assert ratio((o.double() - o64).abs(), bound_o) <= 1
    assert ratio((S.double() - S64).abs(), bound_S) <= 1
    o_all, S_all = delta_rule_recurrent(*(x.bfloat16() for x in (q, k, v, beta, S0)))
    assert S_all.dtype == torch.bfloat16
    assert ratio((o_all.double() - o64).abs(), bound_o) > 1.2
    assert ratio((S_all.double() - S64).abs(), bound_S) > 1.5


def test_bfloat16_inputs_return_bfloat16_outputs_and_float32_states(monkeypatch):
    monkeypatch.setenv(CPU_BF16_ENV, "on")
    q, k, v, beta, *_ = data(2, 50, 2, 8, 8)
    qb, kb, vb = (x.bfloat16() for x in (q, k, v))
    with autocast_bf16():
        o, (S, z) = linear_attn(qb, kb, vb, normalize=True, chunk_size=16, output_final_state=True)
        od, Sd = delta_rule(sum_norm(qb), sum_norm(kb), vb, beta, chunk_size=16,
                            output_final_state=True)
    assert o.dtype == od.dtype == torch.bfloat16
    assert S.dtype == z.dtype == Sd.dtype == torch.float32
    want, _ = linear_attn(qb, kb, vb, normalize=True, chunk_size=16)
    assert (o.float() - want.float()).abs().max() <= 8 * U * want.float().abs().max()


@pytest.mark.parametrize("op", ["linear", "linear-norm", "delta"])
def test_gradients_flow_and_agree_loosely_with_float32(monkeypatch, op):
    """Backward (called outside autocast, see ``_all_outputs``) runs through the bfloat16
    products (the delta rule's hand-written backward takes them too) and gives float32
    gradients for every input and the initial state, within 10u (normwise, per tensor) of the
    float32 path's."""
    q, k, v, beta, S0, z0 = f32(*data(2, 77, 2, 12, 10, seed=4))

    def grads(autocast):
        xs = [x.clone().requires_grad_() for x in (q, k, v, beta, S0, z0)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            if op == "delta":
                o, S = delta_rule(sum_norm(xs[0]), sum_norm(xs[1]), xs[2], xs[3],
                                  initial_state=xs[4], output_final_state=True, chunk_size=16)
                xs = xs[:5]
            else:
                o, (S, _) = linear_attn(*xs[:3], normalize=op == "linear-norm", chunk_size=16,
                                        initial_state=(xs[4], xs[5]), output_final_state=True)
                xs = xs[:3] + xs[4:5]
        w = torch.cos(torch.arange(o.numel(), dtype=torch.float32)).view_as(o)
        ((o * w).sum() + S.sin().sum()).backward()
        return [x.grad for x in xs]

    want = grads(False)
    monkeypatch.setenv(CPU_BF16_ENV, "on")
    got = grads(True)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32
        assert not torch.equal(g, w)
        assert (g - w).norm() <= 10 * U * w.norm()


def test_gated_chunk_form_takes_the_products_too():
    """The chunked form is one for the delta rule and the gated delta rule (ops/delta_rule/chunk.py):
    with gates its bfloat16 products stay within 10u (normwise) of its float32 result, output,
    state and every gradient. (gated_delta_rule itself does not opt into the path.)"""
    q, k, v, beta, S0, _ = f32(*data(2, 77, 2, 12, 10, seed=6))
    g = -torch.rand(beta.shape, generator=torch.Generator().manual_seed(7))

    def run(products):
        xs = [x.clone().requires_grad_() for x in (sum_norm(q), sum_norm(k), v, beta, g, S0)]
        o, S = delta_rule_chunk(*xs[:4], S=xs[5], chunk_size=16, g=xs[4], products=products)
        w = torch.cos(torch.arange(o.numel(), dtype=torch.float32)).view_as(o)
        ((o * w).sum() + S.sin().sum()).backward()
        return [o.detach(), S.detach()] + [x.grad for x in xs]

    for got, want in zip(run(torch.bfloat16), run(None)):
        assert got.dtype == torch.float32
        assert not torch.equal(got, want)
        assert (got - want).norm() <= 10 * U * want.norm()


def test_delta_rule_double_backward_runs(monkeypatch):
    monkeypatch.setenv(CPU_BF16_ENV, "on")
    q, k, v, beta, *_ = f32(*data(1, 20, 2, 6, 5, seed=5))
    xs = [x.requires_grad_() for x in (sum_norm(q), sum_norm(k), v, beta)]
    with autocast_bf16():
        o, _ = delta_rule(*xs, chunk_size=8)
    g = torch.autograd.grad(o.square().sum(), xs, create_graph=True)
    sum(x.square().sum() for x in g).backward()
    assert all(x.grad is not None and x.grad.isfinite().all() for x in xs)


@pytest.mark.parametrize("op", ["linear-norm", "delta"])
@pytest.mark.parametrize("splits", [(50, 123), (1, 64, 65)], ids=str)
def test_pieces_equal_whole_within_the_bound(monkeypatch, op, splits):
    """Streamed pieces (a one-token piece included: the float32 recurrent step) with the state
    carried between calls stay within the same bounds of the float64 whole as the whole call."""
    monkeypatch.setenv(CPU_BF16_ENV, "on")
    T = 200
    q, k, v, beta, S0, z0 = data(1, T, 2, 12, 9, seed=6)
    if op == "delta":
        q, k = sum_norm(q), sum_norm(k)

    def run(sl, state):
        xs = f32(q[:, sl], k[:, sl], v[:, sl], beta[:, sl])
        if op == "delta":
            return delta_rule(*xs, initial_state=state, output_final_state=True, chunk_size=16)
        return linear_attn(*xs[:3], normalize=True, initial_state=state, output_final_state=True,
                           chunk_size=16)

    if op == "delta":
        o64, S64 = delta_rule(q, k, v, beta, initial_state=S0, output_final_state=True,
                              chunk_size=16)
        bound_o, bound_S = delta_bounds(o64, S64, T)
        state = S0.float()
    else:
        o64, S64, bound_o, bound_S = linear_bounds(q, k, v, S0, z0, True, 16)
        state = f32(S0, z0)
    with autocast_bf16():
        whole, _ = run(slice(None), state)
        pieces, cuts = [], (0, *splits, T)
        for a, b in itertools.pairwise(cuts):
            o, state = run(slice(a, b), state)
            pieces.append(o)
    S = state if op == "delta" else state[0]
    assert S.dtype == torch.float32
    for got in (whole, torch.cat(pieces, dim=1)):
        assert ratio((got.double() - o64).abs(), bound_o) <= 1
    assert ratio((S.double() - S64).abs(), bound_S) <= 1


@pytest.mark.parametrize("op", ["linear", "delta"])
def test_packed_documents_take_the_path_each(monkeypatch, op):
    """A packed batch (cu_seqlens) runs each document through the op again inside the first
    call: the choice made on entry holds for every document."""
    monkeypatch.setenv(CPU_BF16_ENV, "on")
    q, k, v, beta, *_ = f32(*data(1, 60, 2, 8, 8, seed=7))
    cu = torch.tensor([0, 25, 60])

    def run(sl, **kw):
        if op == "delta":
            return delta_rule(sum_norm(q[:, sl]), sum_norm(k[:, sl]), v[:, sl], beta[:, sl],
                              chunk_size=16, **kw)[0]
        return linear_attn(q[:, sl], k[:, sl], v[:, sl], chunk_size=16, **kw)[0]

    plain = run(slice(None), cu_seqlens=cu)
    with autocast_bf16():
        packed = run(slice(None), cu_seqlens=cu)
        docs = torch.cat([run(slice(0, 25)), run(slice(25, 60))], dim=1)
    assert torch.equal(packed, docs)
    assert not torch.equal(packed, plain)


@pytest.mark.parametrize("name", ["linear", "delta", "norm"])
def test_layers_under_autocast_take_the_path_with_float32_states(monkeypatch, name):
    """The layers built on linear_attn / delta_rule inherit the choice: a training step under
    CPU bfloat16 autocast, the sequence in two pieces with the state carried, has finite
    gradients and float32 states, and differs from the float32 path (forced off)."""
    from fastweights import build_mixer

    def step(setting):
        monkeypatch.setenv(CPU_BF16_ENV, setting)
        torch.manual_seed(0)
        layer = build_mixer(name, 16, 2, chunk_size=4)
        x = torch.randn(2, 11, 16)
        with autocast_bf16():
            y1, state = layer(x[:, :6])
            y2, state = layer(x[:, 6:], state)
        y = torch.cat([y1, y2], 1)
        y.float().square().mean().backward()
        grads = [p.grad for p in layer.parameters() if p.grad is not None]
        assert grads and all(g.isfinite().all() for g in grads)
        states = [s for s in state if isinstance(s, torch.Tensor) and s.is_floating_point()]
        assert states and all(s.dtype == torch.float32 for s in states)
        return y

    assert not torch.equal(step("on"), step("off"))
