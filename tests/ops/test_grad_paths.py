"""Every op with a state, continued from a carried state, with and without gradients recorded.

Several forms take other code when autograd records a graph (or a program is traced) than
without: TTT's dual scans (ops/ttt/chunk.py), the delta rule's chunk states (double backward and
traced programs, ops/delta_rule/chunk.py), the sum rule's chunk scan (ops/_chunks.py),
Gated DeltaNet's one-token step, TransNormer's and linear attention's chunk forms. The tests of
pieces against the whole run without gradients, and most gradient tests start from no state, so
a twin that mishandled a carried state passed both (issue 45). Here each op runs a prefix (naive
form) to a state inside a chunk / mini-batch / segment / window, then continues, a block of
tokens then single tokens, in every mode: without gradients, and with every input, parameter and
state tensor requiring grad. Outputs and final state equal the naive form's, and so do the
gradients of one loss through the outputs and the final state (float64).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F

from fastweights import state_tree
from fastweights.ops import (
    aft,
    aft_conv,
    aft_local,
    decay_linear_attn,
    delta_rule,
    gated_delta_rule,
    infini_attention,
    linear_attn,
    ttt_linear,
    ttt_mlp,
)
from tests.helpers import assert_close64
from tests.ops.test_aft import band_of, make_conv
from tests.ops.test_ttt import make_case

F64 = torch.float64
B, T, H, D = 2, 13, 2, 3
PREFIX, BLOCK = 5, 4  # the continuation: tokens 5..8 in one call, then 9..12 one at a time


@dataclass
class Case:
    """``seq``: tensors [B, T, ...] cut along time; ``params``: tensors passed whole; ``call(seq
    pieces, params, state, mode, i, j)`` runs tokens i..j-1 and returns (o, state)."""

    seq: list[torch.Tensor]
    params: list[torch.Tensor]
    call: Callable
    modes: tuple[str, ...]


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(*shape, generator=gen, dtype=F64)


def _qkv(gen: torch.Generator) -> list[torch.Tensor]:
    return [_randn(gen, B, T, H, D) for _ in range(3)]


RECURRENT = ("chunk", "recurrent")


def _linear_attn() -> Case:
    gen = torch.Generator().manual_seed(1)
    q, k, v = (F.elu(x) + 1 for x in _qkv(gen))
    return Case([q, k, v], [], lambda s, p, st, mode, i, j: linear_attn(
        *s, normalize=True, initial_state=st, output_final_state=True, mode=mode,
        chunk_size=3), RECURRENT)


def _delta_rule() -> Case:
    gen = torch.Generator().manual_seed(2)
    q, k, v = _qkv(gen)
    k = F.normalize(k, dim=-1)
    beta = torch.rand(B, T, H, generator=gen, dtype=F64)
    return Case([q, k, v, beta], [], lambda s, p, st, mode, i, j: delta_rule(
        *s, initial_state=st, output_final_state=True, mode=mode, chunk_size=3), RECURRENT)


def _gated_delta_rule() -> Case:
    gen = torch.Generator().manual_seed(3)
    q, k, v = _qkv(gen)
    k = F.normalize(k, dim=-1)
    beta = torch.rand(B, T, H, generator=gen, dtype=F64)
    g = -0.5 * torch.rand(B, T, H, generator=gen, dtype=F64)
    return Case([q, k, v, beta, g], [], lambda s, p, st, mode, i, j: gated_delta_rule(
        *s, initial_state=st, output_final_state=True, mode=mode, chunk_size=3), RECURRENT)


def _decay_linear_attn() -> Case:
    gen = torch.Generator().manual_seed(4)
    decay = torch.tensor([0.6, 0.9], dtype=F64)
    return Case(_qkv(gen), [decay], lambda s, p, st, mode, i, j: decay_linear_attn(
        *s, p[0], initial_state=st, output_final_state=True, mode=mode, chunk_size=3), RECURRENT)


def _infini(update: str) -> Callable[[], Case]:
    def make() -> Case:
        gen = torch.Generator().manual_seed(5)

        def call(s, p, st, mode, i, j):
            o, state = infini_attention(*s, p[0], segment_len=4, update=update, initial_state=st,
                                        output_final_state=True, mode=mode)
            return o, state.open_segment  # the open segment continues exactly (InfiniState)

        return Case(_qkv(gen), [_randn(gen, H)], call, RECURRENT)
    return make


def _ttt(kind: str, mode: str) -> Callable[[], Case]:
    def make() -> Case:
        (q, k, v, eta), kw = make_case(kind, B=B, T=T, H=H, Dk=D, Dv=D, b=4, seed=6)
        init, ln_w, ln_b, tau = (kw.pop(n) for n in ("initial_state", "ln_weight", "ln_bias",
                                                      "token_scale"))
        n = len(init)

        def call(s, p, st, mode, i, j):
            state = tuple(p[3:3 + n]) if st is None else st
            return (ttt_linear if kind == "linear" else ttt_mlp)(
                *s, initial_state=state, ln_weight=p[0], ln_bias=p[1], token_scale=p[2],
                output_final_state=True, mode=mode, **kw)

        return Case([q, k, v, eta], [ln_w, ln_b, tau, *init], call, (mode,))
    return make


def _aft_simple() -> Case:
    gen = torch.Generator().manual_seed(7)
    q, k, v = (_randn(gen, B, T, 5) for _ in range(3))
    return Case([q, k, v], [], lambda s, p, st, mode, i, j: aft(
        *s, initial_state=st, output_final_state=True, mode=mode, chunk_size=3), RECURRENT)


def _aft_local() -> Case:
    gen = torch.Generator().manual_seed(8)
    q, k, v = (_randn(gen, B, T, 5) for _ in range(3))
    w = _randn(gen, T + 2, T + 2, scale=0.5)
    return Case([q, k, v], [w], lambda s, p, st, mode, i, j: aft_local(
        *s, band_of(p[0], 4, i, j), window=4, initial_state=st, output_final_state=True,
        mode=mode, chunk_size=3), RECURRENT)


def _aft_conv() -> Case:
    q, k, v, w = make_conv(B, T, 2, 3, 3, seed=9)
    return Case([q, k, v], [w], lambda s, p, st, mode, i, j: aft_conv(
        *s, p[0], initial_state=st, output_final_state=True, mode=mode, chunk_size=3), RECURRENT)


CASES = {
    "linear_attn": _linear_attn, "delta_rule": _delta_rule, "gated_delta_rule": _gated_delta_rule,
    "decay_linear_attn": _decay_linear_attn, "infini-linear": _infini("linear"),
    "infini-delta": _infini("delta"), "ttt_linear-dual": _ttt("linear", "dual"),
    "ttt_linear-primal": _ttt("linear", "primal"), "ttt_mlp-dual": _ttt("mlp", "dual"),
    "ttt_mlp-primal": _ttt("mlp", "primal"), "aft": _aft_simple, "aft_local": _aft_local,
    "aft_conv": _aft_conv,
}


def _floating(x: torch.Tensor) -> bool:
    return x.is_floating_point()


def _canonical(state) -> list[torch.Tensor]:
    """The floating tensors of a state, AFT's running sums as their values e^a n and e^a m (the
    reference a is each form's own choice, docs/maths.md 4.4)."""
    if hasattr(state, "_fields") and {"a", "n", "m"} <= set(state._fields):
        a, n, m = state.a, state.n, state.m
        scale = torch.exp(a).reshape(*a.shape, *(1,) * (n.dim() - a.dim()))
        rest = [x for f, x in zip(state._fields, state) if f not in "anm" and torch.is_tensor(x)]
        return [scale * n, torch.exp(a) * m, *(x for x in rest if _floating(x))]
    return [x for x in state_tree.tensors(state) if _floating(x)]


def _continue(case: Case, state0, mode: str, grad: bool, create_graph: bool = False):
    """Tokens PREFIX.. from ``state0`` (a block, then one token per call): (o, final state,
    gradients of the loss w.r.t. the continuation's inputs, the params and state0's tensors, or
    None without ``grad``). ``create_graph``: the gradients as double backward takes them (the
    delta rule's backward then recomputes its chunk states on the autograd path)."""
    def leaf(x: torch.Tensor) -> torch.Tensor:
        x = x.detach().clone()
        return x.requires_grad_() if grad and _floating(x) else x

    seq = [leaf(x[:, PREFIX:]) for x in case.seq]
    params = [leaf(x) for x in case.params]
    state = state_tree.map_tensors(leaf, state0)
    leaves = seq + params + [x for x in state_tree.tensors(state) if _floating(x)]
    bounds = [PREFIX, PREFIX + BLOCK, *range(PREFIX + BLOCK + 1, T + 1)]
    outs, st = [], state
    with torch.set_grad_enabled(grad):
        for i, j in pairwise(bounds):
            o, st = case.call([x[:, i - PREFIX:j - PREFIX] for x in seq], params, st, mode, i, j)
            outs.append(o)
    o = torch.cat(outs, dim=1)
    if not grad:
        return o, st, None
    loss = o.square().sum() + sum(x.square().sum() for x in _canonical(st))
    grads = torch.autograd.grad(loss, leaves, allow_unused=True, create_graph=create_graph)
    return o, st, [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads)]


@pytest.mark.parametrize("name", list(CASES))
def test_continued_with_and_without_gradients_equals_naive(name):
    case = CASES[name]()
    with torch.no_grad():
        _, state0 = case.call([x[:, :PREFIX] for x in case.seq], case.params, None, "naive", 0,
                              PREFIX)
    o_ref, st_ref, g_ref = _continue(case, state0, "naive", grad=True)
    ref_states = _canonical(st_ref)
    for mode in case.modes:
        for grad, create_graph in ((False, False), (True, False), (True, True)):
            what = (f"{name} {mode} {'with' if grad else 'without'} gradients"
                    f"{' (create_graph)' if create_graph else ''}")
            o, st, g = _continue(case, state0, mode, grad, create_graph)
            assert_close64(o.detach(), o_ref.detach(), what=f"{what}: outputs")
            states = _canonical(st)
            assert len(states) == len(ref_states), what
            for a, b in zip(states, ref_states):
                assert_close64(a.detach(), b.detach(), what=f"{what}: final state")
            for n, (a, b) in enumerate(zip(g or (), g_ref)):
                assert_close64(a.detach(), b, atol=1e-9, what=f"{what}: gradient of leaf {n}")
