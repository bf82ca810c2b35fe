"""The public one-token steps (``fastweights.ops.<op>_step``): token by token from the empty
state, and from a state an op call left mid-sequence, each equals the op's parallel (chunked)
form over the whole sequence, outputs and final state, in float64; bad shapes are refused
naming the argument."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import fastweights.ops as ops
from tests.helpers import assert_close64

B, T, H, D = 2, 11, 3, 5


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_g(seed), dtype=torch.float64)


class Case:
    """One op: per-token inputs (time on dim 1), the op over a span of them from a state
    (returning its final state in the step's form) and the step on one token."""

    def __init__(self, inputs: dict[str, torch.Tensor],
                 op: Callable[..., tuple[torch.Tensor, Any]],
                 step: Callable[..., tuple[torch.Tensor, Any]]) -> None:
        self.inputs, self.op, self.step = inputs, op, step

    def span(self, a: int, b: int) -> dict[str, torch.Tensor]:
        return {n: x[:, a:b] for n, x in self.inputs.items()}


def _fwp(update: str) -> Case:
    q, k = _randn(B, T, H, D, seed=1).sigmoid(), _randn(B, T, H, D, seed=2).sigmoid()
    v, beta = _randn(B, T, H, D + 1, seed=3), _randn(B, T, H, seed=4).sigmoid()
    if update == "sum":
        return Case({"q": q, "k": k, "v": v},
                    lambda s, **x: ops.linear_attn(**x, normalize=True, scale=0.7, chunk_size=4,
                                                   initial_state=s, output_final_state=True),
                    lambda s, **x: ops.linear_attn_step(**x, normalize=True, scale=0.7, state=s))
    return Case({"q": q, "k": k, "v": v, "beta": beta},
                lambda s, **x: ops.delta_rule(**x, scale=0.7, chunk_size=4, initial_state=s,
                                              output_final_state=True),
                lambda s, **x: ops.delta_rule_step(**x, scale=0.7, state=s))


def _gated() -> Case:
    Hk = 1
    q = torch.nn.functional.normalize(_randn(B, T, Hk, D, seed=1), dim=-1)
    k = torch.nn.functional.normalize(_randn(B, T, Hk, D, seed=2), dim=-1)
    x = {"q": q, "k": k, "v": _randn(B, T, H, D + 2, seed=3),
         "beta": _randn(B, T, H, seed=4).sigmoid(), "g": -_randn(B, T, H, seed=5).exp()}
    return Case(x, lambda s, **x: ops.gated_delta_rule(**x, scale=0.6, chunk_size=4,
                                                       initial_state=s, output_final_state=True),
                lambda s, **x: ops.gated_delta_rule_step(**x, scale=0.6, state=s))


def _decay() -> Case:
    lam = torch.tensor([0.9, 0.5, 1.0], dtype=torch.float64)
    x = {"q": _randn(B, T, H, D, seed=1), "k": _randn(B, T, H, D, seed=2),
         "v": _randn(B, T, H, D + 1, seed=3)}
    return Case(x, lambda s, **x: ops.decay_linear_attn(**x, decay=lam, scale=0.8, chunk_size=4,
                                                        initial_state=s, output_final_state=True),
                lambda s, **x: ops.decay_linear_attn_step(**x, decay=lam, scale=0.8, state=s))


def _infini() -> Case:
    gate = _randn(H, seed=6)
    kw = {"segment_len": 4, "update": "delta"}
    x = {"q": _randn(B, T, H, D, seed=1), "k": _randn(B, T, H, D, seed=2),
         "v": _randn(B, T, H, D + 1, seed=3), "q_mem": _randn(B, T, H, D, seed=4),
         "k_mem": _randn(B, T, H, D, seed=5)}

    def op(s, **x):
        o, st = ops.infini_attention(**x, gate=gate, **kw, initial_state=s, output_final_state=True)
        return o, st.open_segment

    return Case(x, op, lambda s, **x: ops.infini_attention_step(**x, gate=gate, **kw, state=s))


def _aft(kind: str) -> Case:
    x = {"q": _randn(B, T, D, seed=1), "k": 3 * _randn(B, T, D, seed=2),
         "v": _randn(B, T, D, seed=3)}
    if kind == "simple":
        return Case(x, lambda s, **x: ops.aft(**x, initial_state=s, output_final_state=True,
                                              chunk_size=4),
                    lambda s, **x: ops.aft_step(**x, state=s))
    if kind == "full":
        w = _randn(T, T, seed=4)

        def full(s, **x):
            p = 0 if s is None else s.k_cache.shape[1]
            return ops.aft(**x, w=w[p:], initial_state=s, output_final_state=True, chunk_size=4)

        return Case(x, full, lambda s, **x: ops.aft_step(
            **x, w=w[0 if s is None else s.k_cache.shape[1]:][:1], state=s))
    if kind == "local":
        s_ = 4
        table = _randn(T, s_, seed=4)  # table[t, o]: the bias of token t at offset o

        def local(s, **x):
            p = 0 if s is None else s.pos
            return ops.aft_local(**x, w=table[p:p + x["q"].shape[1]], window=s_, initial_state=s,
                                 output_final_state=True, chunk_size=3)

        return Case(x, local, lambda s, **x: ops.aft_local_step(
            **x, w=table[0 if s is None else s.pos:][:1], window=s_, state=s))
    Hc, Dh = 2, 3
    xc = {"q": _randn(B, T, Hc, Dh, seed=1), "k": 2 * _randn(B, T, Hc, seed=2),
          "v": _randn(B, T, Hc, Dh, seed=3)}
    w = _randn(Hc, 4, seed=4)
    return Case(xc, lambda s, **x: ops.aft_conv(**x, w=w, initial_state=s, output_final_state=True,
                                                chunk_size=3),
                lambda s, **x: ops.aft_conv_step(**x, w=w, state=s))


def _ttt(kind: str) -> Case:
    Dh = 4 * D if kind == "mlp" else D
    shapes = [(D, D), (D,)] if kind == "linear" else [(D, Dh), (Dh,), (Dh, D), (D,)]
    init = tuple(0.3 * _randn(1, H, *s, seed=10 + i) for i, s in enumerate(shapes))
    x = {"q": _randn(B, T, H, D, seed=1), "k": _randn(B, T, H, D, seed=2),
         "v": _randn(B, T, H, D, seed=3), "eta": 0.05 * _randn(B, T, H, seed=4).sigmoid()}
    kw = {"mini_batch_size": 4, "residual": True, "ln_weight": 1 + 0.2 * _randn(H, D, seed=5),
          "ln_bias": 0.2 * _randn(H, D, seed=6), "token_scale": 0.5 + _randn(4, seed=7).sigmoid()}
    op, step = ((ops.ttt_linear, ops.ttt_linear_step) if kind == "linear"
                else (ops.ttt_mlp, ops.ttt_mlp_step))
    return Case(x, lambda s, **x: op(**x, **kw, initial_state=init if s is None else s,
                                     output_final_state=True),
                lambda s, **x: step(**x, **kw, state=init if s is None else s))


CASES: dict[str, Callable[[], Case]] = {
    "ttt_linear": lambda: _ttt("linear"), "ttt_mlp": lambda: _ttt("mlp"),
    "linear_attn": lambda: _fwp("sum"), "delta_rule": lambda: _fwp("delta"),
    "gated_delta_rule": _gated, "decay_linear_attn": _decay, "infini_attention": _infini,
    "aft": lambda: _aft("simple"), "aft_full": lambda: _aft("full"),
    "aft_local": lambda: _aft("local"), "aft_conv": lambda: _aft("conv"),
}


def _summary(state: Any) -> Any:
    """An AFT state by what it means: (a, n, m) stand for the sums e^a n, e^a m, a being a
    stabilising reference that differs between forms; compared as (a + log m, n / m)."""
    if isinstance(state, (ops.AFTSimpleState, ops.AFTLocalState, ops.AFTConvState)):
        a, n, m = state[:3]
        ratio = n / (m.unsqueeze(-1) if n.dim() > m.dim() else m)
        return (a + m.log(), ratio, *state[3:])
    return state


def _assert_states_close(a: Any, b: Any, what: str) -> None:
    a, b = _summary(a), _summary(b)
    if isinstance(a, torch.Tensor):
        assert_close64(a, b, what=what)
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_states_close(x, y, f"{what}[{i}]")
    else:
        assert a == b, f"{what}: {a} != {b}"


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("start", [0, 6])
def test_steps_equal_the_parallel_form(name, start):
    case = CASES[name]()
    o_whole, s_whole = case.op(None, **case.span(0, T))
    state = None if start == 0 else case.op(None, **case.span(0, start))[1]
    outs = []
    for t in range(start, T):
        o, state = case.step(state, **case.span(t, t + 1))
        outs.append(o)
    assert_close64(torch.cat(outs, 1), o_whole[:, start:], what=f"{name} outputs")
    _assert_states_close(state, s_whole, f"{name} state")


@pytest.mark.parametrize("name", CASES)
def test_a_step_refuses_more_than_one_token(name):
    case = CASES[name]()
    with pytest.raises(ValueError, match="one token"):
        case.step(None, **case.span(0, 2))


def test_a_step_names_a_bad_state():
    x = {"q": _randn(B, 1, H, D, seed=1), "k": _randn(B, 1, H, D, seed=2),
         "v": _randn(B, 1, H, D, seed=3)}
    with pytest.raises(ValueError, match=r"state\[0\] \(S\)"):
        ops.linear_attn_step(**x, state=(torch.zeros(B, H, D, D + 1), torch.zeros(B, H, D)))
    with pytest.raises(ValueError, match="state must have shape"):
        ops.delta_rule_step(**x, beta=torch.zeros(B, 1, H), state=torch.zeros(B, H, D, 2))
    with pytest.raises(ValueError, match="beta"):
        ops.delta_rule_step(**x, beta=torch.zeros(B, 2, H))


def test_every_step_is_public():
    stateful = ["linear_attn", "delta_rule", "gated_delta_rule", "decay_linear_attn",
                "infini_attention", "aft", "aft_local", "aft_conv", "ttt_linear", "ttt_mlp"]
    assert [f"{op}_step" for op in stateful if f"{op}_step" not in ops.__all__] == []


def test_aft_full_steps_on_a_cache_of_fixed_capacity_equal_the_op():
    """``aft_step`` on an ``AFTFullCache`` (buffers of capacity L, the static decoding form):
    rows at their own lengths, each row's outputs equal its own AFT-full run (float64, odd
    sizes); the buffers are the state passed in, written in place."""
    Bc, Dc, L, steps = 3, 5, 11, 4
    q, k, v = (_randn(Bc, L, Dc, seed=s) for s in (11, 12, 13))
    w = _randn(L, L, seed=14)
    starts = [0, 2, 5]  # each row's cached tokens
    kc, vc = torch.zeros(Bc, L, Dc, dtype=torch.float64), torch.zeros(Bc, L, Dc, dtype=torch.float64)
    for b, p in enumerate(starts):
        kc[b, :p], vc[b, :p] = k[b, :p], v[b, :p]
    cache = ops.AFTFullCache(kc, vc, torch.tensor(starts))
    pos = torch.tensor(starts)
    outs = []
    for _ in range(steps):
        rows = torch.arange(Bc)
        o, cache = ops.aft_step(q[rows, pos].unsqueeze(1), k[rows, pos].unsqueeze(1),
                                v[rows, pos].unsqueeze(1), w[pos], state=cache)
        outs.append(o)
        pos = pos + 1
    assert cache.k_cache is kc and cache.lengths.tolist() == [p + steps for p in starts]
    for b, p in enumerate(starts):
        want, _ = ops.aft(q[b:b + 1, :p + steps], k[b:b + 1, :p + steps],
                          v[b:b + 1, :p + steps], w[:p + steps, :p + steps], mode="naive")
        got = torch.cat([o[b:b + 1] for o in outs], 1)
        assert_close64(got, want[:, p:], what=f"row {b}")


def test_aft_full_cache_step_names_bad_arguments():
    q = _randn(2, 1, 3, seed=1)
    cache = ops.AFTFullCache(torch.zeros(2, 6, 3, dtype=torch.float64),
                             torch.zeros(2, 6, 3, dtype=torch.float64), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="w must be given"):
        ops.aft_step(q, q, q, state=cache)
    with pytest.raises(ValueError, match=r"w must have shape \[B, L\] = \[2, 6\]"):
        ops.aft_step(q, q, q, torch.zeros(2, 5, dtype=torch.float64), state=cache)
    with pytest.raises(ValueError, match=r"state\.v_cache must have shape"):
        ops.aft_step(q, q, q, torch.zeros(1, 6, dtype=torch.float64),
                     state=cache._replace(v_cache=torch.zeros(2, 5, 3, dtype=torch.float64)))
    with pytest.raises(ValueError, match=r"state\.lengths must be a long tensor"):
        ops.aft_step(q, q, q, torch.zeros(1, 6, dtype=torch.float64),
                     state=cache._replace(lengths=torch.zeros(2)))
    with pytest.raises(ValueError, match=r"must be torch\.float32"):
        ops.aft_step(q.float(), q.float(), q.float(), torch.zeros(1, 6), state=cache)
