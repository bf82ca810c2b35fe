"""The ops without a Triton kernel compile whole (torch.compile(fullgraph=True, dynamic=True)):
no graph break from a Python branch on tensor values. backend="aot_eager" traces exactly what
inductor would get, cheaply on CPU; fullgraph=True raises on any graph break."""

from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

from fastweights import ops
from tests.helpers import assert_close64
from tests.ops.test_ttt import assert_states_close, make_case

B, H, D = 2, 3, 8  # B != H: see the issue 16 report (duck-sized equal dims trip torch.cond)


def _qkv(T: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, T, H, D, generator=g) for _ in range(3))


def _flat(T: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    return tuple(x.flatten(-2) for x in _qkv(T, seed))


CASES = {
    "ttt_linear": lambda T: (lambda q, k, v, eta, W: ops.ttt_linear(
        q, k, v, eta, initial_state=(W, None), mini_batch_size=4, output_final_state=True),
        (*_qkv(T), 0.1 * torch.rand(B, T, H), 0.1 * torch.randn(1, H, D, D))),
    "aft_full": lambda T: (lambda q, k, v, w: ops.aft(q, k, v, w, chunk_size=8),
                           (*_flat(T), torch.randn(T, T))),
    "aft_full_extreme": lambda T: (lambda q, k, v, w: ops.aft(q, k, v, w, chunk_size=8),
                                   (_flat(T)[0], 300 * _flat(T)[1], _flat(T)[2],
                                    300 * torch.randn(T, T))),
    "aft_simple": lambda T: (lambda q, k, v: ops.aft(q, k, v), (*_flat(T),)),
    "aft_local": lambda T: (lambda q, k, v, w: ops.aft_local(q, k, v, w, window=5, chunk_size=8),
                            (*_flat(T), torch.randn(T, 5))),
    "aft_conv": lambda T: (lambda q, k, v, w: ops.aft_conv(q, k, v, w, chunk_size=8),
                           (_qkv(T)[0], 200 * _qkv(T)[1][..., 0], _qkv(T)[2], torch.randn(H, 5))),
    "infini": lambda T: (lambda q, k, v, g: ops.infini_attention(
        q, k, v, g, segment_len=8, output_final_state=True), (*_qkv(T), torch.zeros(H))),
    "block_attention": lambda T: (lambda q, k, v: ops.block_attention(q, k, v, block_size=8),
                                  _qkv(T)),
    "decay_linear_attn": lambda T: (lambda q, k, v, lam: ops.decay_linear_attn(
        q, k, v, lam, chunk_size=8, output_final_state=True),
        (*_qkv(T), torch.tensor([0.5, 0.9, 1.0]))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_compiles_without_graph_breaks_and_matches_eager(name):
    # One length per op (compiling is slow on CPU); dynamic=True traces it symbolically. 21 is
    # no multiple of the chunk / mini-batch / segment sizes, so the padded paths are traced.
    # ttt_linear also runs T = 24, a multiple of its mini-batch (nothing to pad; a second trace,
    # ~10 s): its mini-batch view once failed there at run time with a view-stride error.
    torch._dynamo.reset()
    fn, _ = CASES[name](21)
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    for T in (21, 24) if name == "ttt_linear" else (21,):
        _, args = CASES[name](T)
        got, want = pytree.tree_leaves(compiled(*args)), pytree.tree_leaves(fn(*args))
        assert len(got) == len(want)
        for g, w in zip(got, want):
            if isinstance(w, torch.Tensor):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
                assert torch.isfinite(g).all()


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_ttt_compiled_from_a_mid_minibatch_carry_equals_naive(kind):
    """The traced TTT forms (TTT-MLP's ``_ttt_mlp_dual_traced``, TTT-Linear's autograd scan)
    compiled whole and continued from a state two tokens into a mini-batch (carried gradient
    sums), float64: outputs, final state and input gradients equal the naive form's. The cases
    above start from a mini-batch boundary, where the carried sums are absent. backend="eager":
    dynamo's tracing, which is what selects the traced forms, without code generation."""
    op = ops.ttt_linear if kind == "linear" else ops.ttt_mlp
    args, kw = make_case(kind, B=2, T=15, H=2, Dk=4, Dv=4, b=4, seed=7)
    _, state = op(*(x[:, :6] for x in args), mode="naive", output_final_state=True, **kw)
    assert state[-1] == 2
    kw = {**kw, "initial_state": state}

    def fn(q, k, v, eta, mode="dual"):
        return op(q, k, v, eta, mode=mode, output_final_state=True, **kw)

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    results = []
    for run in (compiled, lambda *xs: fn(*xs, mode="naive")):
        rest = [x[:, 6:].clone().requires_grad_() for x in args]
        o, final = run(*rest)
        results.append((o, final, torch.autograd.grad(o.square().sum(), rest)))
    (o, s, g), (o_ref, s_ref, g_ref) = results
    assert_close64(o, o_ref, what=kind)
    assert_states_close([x.detach() if torch.is_tensor(x) else x for x in s],
                        [x.detach() if torch.is_tensor(x) else x for x in s_ref], what=kind)
    for i, (a, b) in enumerate(zip(g, g_ref)):
        assert_close64(a, b, atol=1e-9, what=f"grad of input {i}")
