"""Triton kernels of linear_attn / delta_rule / gated_delta_rule (ops/*/triton.py) run by the
Triton CPU interpreter against the naive oracles (docs/maths.md 1.3, 1.4, 5b), and the mode="chunk"
dispatcher.

Triton reads TRITON_INTERPRET when ``@triton.jit`` decorates a function, including its own
library functions at ``import triton``; tests/conftest.py therefore sets it before anything
imports triton, and the ``kernels`` fixture checks that the kernels really are interpreted.
"""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from fastweights.ops import backend as backends
from fastweights.ops import delta_rule, gated_delta_rule, linear_attn, sum_norm
from fastweights.ops.delta_rule.chunk import delta_rule_chunk
from fastweights.ops.delta_rule.naive import delta_rule_naive
from fastweights.ops.gated_delta_rule.naive import gated_delta_rule_naive
from fastweights.ops.linear_attn import triton_kernels
from fastweights.ops.linear_attn.chunk import linear_attn_chunk
from fastweights.ops.linear_attn.naive import linear_attn_naive
from tests.helpers import CountedKernel as _Counted

# The ops' modules (fastweights.ops.linear_attn etc. are the op functions as attributes).
OPS = {name: importlib.import_module(f"fastweights.ops.{name}")
       for name in ("linear_attn", "delta_rule", "gated_delta_rule")}

# (B, T, H, Dk, Dv): odd sizes; T never a multiple of the chunk; Dv 70 spans two value blocks.
SHAPES = [(2, 37, 3, 5, 7), (1, 20, 2, 16, 16), (1, 9, 1, 7, 70)]
IDS = [f"B{b}-T{t}-H{h}-Dk{dk}-Dv{dv}" for b, t, h, dk, dv in SHAPES]
TOL32 = 1e-4


@pytest.fixture(scope="module")
def kernels():
    from triton.runtime.interpreter import InterpretedFunction

    modules = SimpleNamespace(**{name: importlib.import_module(f"fastweights.ops.{name}.triton")
                                 for name in OPS})
    if not isinstance(modules.delta_rule._state_fwd_kernel, InterpretedFunction):
        pytest.fail("triton was imported before tests/conftest.py set TRITON_INTERPRET=1 "
                    "(or it is set to 0): these CPU tests need the Triton interpreter")
    return modules  # each op's triton.py: the module its dispatcher calls


def inputs(B, T, H, Dk, Dv, seed=0):
    """Positive q, k (the normaliser stays away from zero); sum-normalised keys for the delta
    rule are made by the delta tests. All float64; states as well."""
    g = torch.Generator().manual_seed(seed)
    q = torch.rand(B, T, H, Dk, generator=g, dtype=torch.float64)
    k = torch.rand(B, T, H, Dk, generator=g, dtype=torch.float64)
    v = torch.randn(B, T, H, Dv, generator=g, dtype=torch.float64)
    beta = torch.rand(B, T, H, generator=g, dtype=torch.float64)
    S0 = torch.randn(B, H, Dk, Dv, generator=g, dtype=torch.float64)
    z0 = torch.rand(B, H, Dk, generator=g, dtype=torch.float64)
    return q, k, v, beta, S0, z0


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
@pytest.mark.parametrize("normalize", [False, True], ids=["unnorm", "norm"])
@pytest.mark.parametrize("chunk", [16, 32], ids=lambda c: f"C{c}")
def test_linear_attn_kernel_matches_naive(kernels, shape, normalize, chunk):
    q, k, v, _, S0, z0 = inputs(*shape)
    args32 = [x.float() for x in (q, k, v, S0, z0)]
    o, S, z = kernels.linear_attn.linear_attn_triton(*args32, normalize, 1e-6, chunk)
    ref, Sr, zr = linear_attn_naive(*(x.double() for x in args32), normalize, 1e-6)
    assert o.dtype == S.dtype == z.dtype == torch.float32
    for name, got, want in (("o", o, ref), ("S", S, Sr), ("z", z, zr)):
        assert max_err(got, want) <= TOL32, f"{name}: {max_err(got, want):.2e}"


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
@pytest.mark.parametrize("chunk", [16, 32], ids=lambda c: f"C{c}")
def test_delta_rule_kernel_matches_naive(kernels, shape, chunk):
    q, k, v, beta, S0, _ = inputs(*shape)
    args32 = [x.float() for x in (q, sum_norm(k), v, beta, S0)]
    o, S = kernels.delta_rule.delta_rule_triton(*args32, chunk)
    ref, Sr = delta_rule_naive(*(x.double() for x in args32))
    assert o.dtype == S.dtype == torch.float32
    assert max_err(o, ref) <= TOL32, f"o: {max_err(o, ref):.2e}"
    assert max_err(S, Sr) <= TOL32, f"S: {max_err(S, Sr):.2e}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_half_inputs_keep_float32_states(kernels, dtype):
    """Half inputs, float32 states: the states match the float64 oracle on the same (rounded)
    inputs to float32 accuracy; the outputs, stored in the input dtype, to its rounding."""
    B, T, H, Dk, Dv = SHAPES[0]
    q, k, v, beta, S0, z0 = inputs(B, T, H, Dk, Dv)
    q, k, v, beta = (x.to(dtype) for x in (q, sum_norm(k), v, beta))
    S0, z0 = S0.float(), z0.float()
    eps = torch.finfo(dtype).eps
    o, S, z = kernels.linear_attn.linear_attn_triton(q, k, v, S0, z0, True, 1e-6, 16)
    ref, Sr, zr = linear_attn_naive(*(x.double() for x in (q, k, v, S0, z0)), True, 1e-6)
    assert o.dtype == dtype and S.dtype == z.dtype == torch.float32
    assert max_err(o, ref) <= eps * ref.abs().max().item()
    assert max_err(S, Sr) <= TOL32 and max_err(z, zr) <= TOL32
    o, S = kernels.delta_rule.delta_rule_triton(q, k, v, beta, S0, 16)
    ref, Sr = delta_rule_naive(*(x.double() for x in (q, k, v, beta, S0)))
    assert o.dtype == dtype and S.dtype == torch.float32
    assert max_err(o, ref) <= eps * ref.abs().max().item()
    assert max_err(S, Sr) <= TOL32


@pytest.mark.parametrize("use_state", [True, False], ids=["loss-o-and-state", "loss-o-only"])
def test_gradients_match_naive(kernels, use_state):
    """The autograd.Function's backward (PyTorch chunk recompute) against autograd of the oracle."""
    B, T, H, Dk, Dv = SHAPES[0]
    q, k, v, beta, S0, z0 = inputs(B, T, H, Dk, Dv)
    k = sum_norm(k)
    g = torch.Generator().manual_seed(5)
    wo = torch.randn(B, T, H, Dv, generator=g, dtype=torch.float64)
    wS = torch.randn(B, H, Dk, Dv, generator=g, dtype=torch.float64)
    wz = torch.randn(B, H, Dk, generator=g, dtype=torch.float64)

    def loss(o, S, z=None):
        total = (o * wo).sum()
        if use_state:
            total = total + (S * wS).sum() + (0.0 if z is None else (z * wz).sum())
        return total

    cases = [
        (kernels.linear_attn.linear_attn_triton, linear_attn_naive, (q, k, v, S0, z0), (True, 1e-6)),
        (kernels.delta_rule.delta_rule_triton, delta_rule_naive, (q, k, v, beta, S0), ()),
    ]
    for fast, naive, tensors, extra in cases:
        x32 = [x.float().requires_grad_() for x in tensors]
        x64 = [x.detach().clone().requires_grad_() for x in tensors]
        if fast is kernels.linear_attn.linear_attn_triton:
            loss(*fast(*x32, *extra, 16)).backward()
        else:
            loss(*fast(*x32, 16)).backward()
        loss(*naive(*x64, *extra)).backward()
        for i, (a, b) in enumerate(zip(x32, x64)):
            assert a.grad is not None and a.grad.dtype == torch.float32
            scale = max(1.0, b.grad.abs().max().item())
            assert max_err(a.grad, b.grad) <= TOL32 * scale, f"{fast.__name__} grad {i}"


def test_dispatch_uses_pytorch_on_cpu(kernels, monkeypatch):
    calls = []
    monkeypatch.setattr(OPS["linear_attn"], "linear_attn_chunk",
                        lambda **kw: calls.append("la") or linear_attn_chunk(**kw))
    monkeypatch.setattr(OPS["delta_rule"], "delta_rule_chunk",
                        lambda **kw: calls.append("dr") or delta_rule_chunk(**kw))

    def forbidden(*args):
        raise AssertionError("the Triton path ran for a CPU tensor")

    monkeypatch.setattr(kernels.linear_attn, "linear_attn_triton", forbidden)
    monkeypatch.setattr(kernels.delta_rule, "delta_rule_triton", forbidden)
    monkeypatch.delenv("FASTWEIGHTS_BACKEND", raising=False)
    q, k, v, beta, _, _ = inputs(1, 9, 1, 4, 4)
    for dtype in (torch.float32, torch.bfloat16):
        linear_attn(q.to(dtype), k.to(dtype), v.to(dtype), chunk_size=4)
        delta_rule(q.to(dtype), k.to(dtype), v.to(dtype), beta.to(dtype), chunk_size=4)
    assert calls == ["la", "dr", "la", "dr"]
    assert backends.choose_backend("linear_attn", q.float(), None, "chunk", 64) == "torch"


def cuda_like(dtype, T=8, Dk=16):
    """A stand-in for a CUDA tensor [1, T, 1, Dk] (``_on_cuda`` reads ``is_cuda``)."""
    return SimpleNamespace(is_cuda=True, dtype=dtype, shape=(1, T, 1, Dk), device="cuda:0")


def test_use_triton_decision(kernels, monkeypatch, caplog):
    """CUDA float16/bfloat16/float32 -> Triton (fla absent); float64, FASTWEIGHTS_TRITON=0 or no
    triton -> PyTorch, each reason logged once; Dk > 128 or chunk_size > 64 -> PyTorch; the
    float32 delta rule -> PyTorch (no spill-free tiling)."""
    monkeypatch.setattr(backends, "_logged", set())
    monkeypatch.setattr(backends, "fla_ops", lambda: None)
    monkeypatch.delenv("FASTWEIGHTS_TRITON", raising=False)
    monkeypatch.delenv("FASTWEIGHTS_BACKEND", raising=False)

    def choose(x, chunk=64):
        return backends.choose_backend("linear_attn", x, None, "chunk", chunk)

    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        assert choose(cuda_like(dtype)) == "triton"
    cuda16 = cuda_like(torch.float16)
    assert choose(cuda_like(torch.float64)) == "torch"
    assert choose(SimpleNamespace(is_cuda=False, dtype=torch.float16, shape=(1, 8, 1, 16),
                                  device="cpu")) == "torch"
    assert choose(cuda_like(torch.float16, Dk=128)) == "triton"
    assert choose(cuda_like(torch.float16, Dk=129)) == "torch"
    for dtype, want in ((torch.bfloat16, "triton"), (torch.float32, "torch")):
        got = backends.choose_backend("delta_rule", cuda_like(dtype), None, "chunk", 64)
        assert got == want, (dtype, got)
    assert choose(cuda16, chunk=65) == "torch"
    assert choose(cuda_like(torch.float16, T=1)) == "torch"  # decoding step
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fastweights.ops.backend"):
        monkeypatch.setenv("FASTWEIGHTS_TRITON", "0")
        assert choose(cuda16) == "torch" and choose(cuda16) == "torch"
        monkeypatch.setenv("FASTWEIGHTS_TRITON", "1")
        monkeypatch.setitem(sys.modules, "fastweights.ops.linear_attn.triton", None)  # not installed
        monkeypatch.delattr(OPS["linear_attn"], "triton", raising=False)
        assert choose(cuda16) == "torch" and choose(cuda16) == "torch"
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "FASTWEIGHTS_TRITON=0" in messages[0] and "triton is not installed" in messages[1]


def test_dispatcher_wiring_through_the_kernels(kernels, monkeypatch):
    """With the device check forced, the public ops run the (interpreted) kernels, scale q,
    carry states and return outputs in the input dtype, matching mode="naive". The first
    automatic choice per op and dtype runs a trial call first (ops/backend.py)."""
    ran = []
    monkeypatch.setattr(backends, "_trials", {})
    for name in ("linear_attn_triton", "delta_rule_triton"):
        module = getattr(kernels, name.removesuffix("_triton"))
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, fn=fn, name=name: ran.append(name) or fn(*a))
    monkeypatch.setattr(backends, "_on_cuda", lambda q: True)
    monkeypatch.setattr(backends, "fla_ops", lambda: None)
    monkeypatch.delenv("FASTWEIGHTS_BACKEND", raising=False)
    monkeypatch.delenv("FASTWEIGHTS_TRITON", raising=False)
    B, T, H, Dk, Dv = SHAPES[0]
    q, k, v, beta, S0, z0 = inputs(B, T, H, Dk, Dv)
    k = sum_norm(k)
    q32, k32, v32, b32 = (x.float() for x in (q, k, v, beta))
    kw = {"scale": 0.7, "output_final_state": True}
    o, (S, z) = linear_attn(q32, k32, v32, normalize=True, initial_state=(S0.float(), z0.float()),
                            chunk_size=16, **kw)
    ref, (Sr, zr) = linear_attn(*(x.double() for x in (q32, k32, v32)), normalize=True,
                                initial_state=(S0, z0), mode="naive", **kw)
    assert o.dtype == torch.float32
    assert max(max_err(o, ref), max_err(S, Sr), max_err(z, zr)) <= TOL32
    # The delta rule takes Triton for half inputs (float32 ones have no spill-free tiling).
    delta_rule(q32, k32, v32, b32, initial_state=S0.float(), chunk_size=16, **kw)
    assert ran == ["linear_attn_triton"] * 2
    q16, k16, v16 = (x.half() for x in (q32, k32, v32))
    o, S = delta_rule(q16, k16, v16, b32, initial_state=S0.float(), chunk_size=16, **kw)
    ref, Sr = delta_rule(*(x.double() for x in (q16, k16, v16, b32)), initial_state=S0,
                         mode="naive", **kw)
    assert o.dtype == torch.float16
    assert max_err(o, ref) <= torch.finfo(torch.float16).eps * ref.abs().max().item()
    assert max_err(S, Sr) <= TOL32
    done = ["linear_attn_triton"] * 2 + ["delta_rule_triton"] * 2
    assert ran == done
    # A decoding step (T = 1) stays on the recurrent form.
    linear_attn(q32[:, :1], k32[:, :1], v32[:, :1])
    assert ran == done
    # backend="torch" and FASTWEIGHTS_BACKEND=torch keep the kernels out.
    linear_attn(q32, k32, v32, backend="torch")
    monkeypatch.setenv("FASTWEIGHTS_BACKEND", "torch")
    delta_rule(q32, k32, v32, b32)
    assert ran == done


def test_works_without_triton(monkeypatch):
    """Without triton the kernels module is None for the dispatcher, and the package imports
    (checked in a fresh interpreter where ``import triton`` fails)."""
    monkeypatch.setitem(sys.modules, "fastweights.ops.linear_attn.triton", None)
    # `from . import triton` reads the package's attribute first
    monkeypatch.delattr(OPS["linear_attn"], "triton", raising=False)
    assert triton_kernels() is None
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, fastweights\n"
            "from fastweights.ops.linear_attn import triton_kernels\n"
            "from fastweights.ops import linear_attn\n"
            "assert triton_kernels() is None\n"
            "linear_attn(*torch.rand(3, 1, 5, 1, 4).unbind(0))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("case", ["two-value-blocks-C64", "bfloat16"])
def test_backward_kernels_match_naive(kernels, case):
    """The backward kernels (local dU, reverse state pass, dQ/dK, the UT-solve backward) against
    autograd of the float64 oracle: Dv = 70 spans three value blocks with one partial chunk;
    bfloat16 inputs give bfloat16 gradients within bfloat16 rounding of the oracle's."""
    shape, chunk, dtype = (((1, 9, 2, 7, 70), 64, torch.float32) if case.startswith("two")
                           else ((1, 21, 1, 6, 5), 8, torch.bfloat16))
    q, k, v, beta, S0, z0 = inputs(*shape, seed=3)
    k = sum_norm(k)
    g = torch.Generator().manual_seed(7)
    wo = torch.randn(*shape[:3], shape[4], generator=g, dtype=torch.float64)
    wS = torch.randn(shape[0], shape[2], shape[3], shape[4], generator=g, dtype=torch.float64)
    tol = TOL32 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    for name in ("linear", "linear_norm", "delta"):
        base = (q, k, v, beta, S0) if name == "delta" else (q, k, v, S0, z0)
        xd = [x.to(dtype) if i < (4 if name == "delta" else 3) else x.float()
              for i, x in enumerate(base)]
        x_fast = [x.detach().clone().requires_grad_() for x in xd]
        x_ref = [x.detach().double().requires_grad_() for x in xd]
        if name == "delta":
            o, S = kernels.delta_rule.delta_rule_triton(*x_fast, chunk)
            ro, rS = delta_rule_naive(*x_ref)
        else:
            o, S, _ = kernels.linear_attn.linear_attn_triton(*x_fast, name == "linear_norm", 1e-6, chunk)
            ro, rS, _ = linear_attn_naive(*x_ref, name == "linear_norm", 1e-6)
        ((o.double() * wo).sum() + (S.double() * wS).sum()).backward()
        ((ro * wo).sum() + (rS * wS).sum()).backward()
        for i, (a, b) in enumerate(zip(x_fast, x_ref)):
            if b.grad is None:  # z0 of unnormalised linear attention: unused by this loss
                assert a.grad is None or not a.grad.any()
                continue
            assert a.grad.dtype == a.dtype
            scale = max(1.0, b.grad.abs().max().item())
            assert max_err(a.grad, b.grad) <= tol * scale, f"{name} grad {i}: {max_err(a.grad, b.grad)}"


def test_kernel_limits_are_errors(kernels):
    q, k, v, beta, S0, z0 = (x.float() for x in inputs(1, 5, 1, 4, 4))
    with pytest.raises(ValueError, match=r"chunk_size must be in 1\.\.64"):
        kernels.linear_attn.linear_attn_triton(q, k, v, S0, z0, False, 1e-6, 65)
    big = torch.zeros(1, 5, 1, 129)
    with pytest.raises(ValueError, match="Dk <= 128"):
        kernels.delta_rule.delta_rule_triton(big, big, v, beta, torch.zeros(1, 1, 129, 4), 16)


@pytest.mark.parametrize("op", ["delta", "linear_norm"])
def test_two_key_blocks_match_naive(kernels, op):
    """Dk = 128, the head size of most released DeltaNet models: two key blocks of 64 (the delta
    rule's state passes hold both in one program, linear attention runs one program per block),
    Dv = 40 spanning value blocks; forward and gradients against the float64 oracle."""
    B, T, H, Dk, Dv = 1, 11, 1, 128, 40
    q, k, v, beta, S0, z0 = inputs(B, T, H, Dk, Dv, seed=4)
    k = sum_norm(k)
    g = torch.Generator().manual_seed(9)
    wo = torch.randn(B, T, H, Dv, generator=g, dtype=torch.float64)
    wS = torch.randn(B, H, Dk, Dv, generator=g, dtype=torch.float64)
    base = (q, k, v, beta, S0) if op == "delta" else (q, k, v, S0, z0)
    x32 = [x.float().requires_grad_() for x in base]
    x64 = [x.detach().clone().requires_grad_() for x in base]
    if op == "delta":
        (o, S), (ro, rS) = kernels.delta_rule.delta_rule_triton(*x32, 8), delta_rule_naive(*x64)
    else:
        o, S, _ = kernels.linear_attn.linear_attn_triton(*x32, True, 1e-6, 8)
        ro, rS, _ = linear_attn_naive(*x64, True, 1e-6)
    assert max(max_err(o, ro), max_err(S, rS)) <= TOL32
    ((o.double() * wo).sum() + (S.double() * wS).sum()).backward()
    ((ro * wo).sum() + (rS * wS).sum()).backward()
    for i, (a, b) in enumerate(zip(x32, x64)):
        if b.grad is None:
            continue
        scale = max(1.0, b.grad.abs().max().item())
        assert max_err(a.grad, b.grad) <= TOL32 * scale, f"{op} grad {i}: {max_err(a.grad, b.grad)}"


# (B, T, Hk, H, Dk, Dv): grouped heads (two value heads per key head); Dk = 128, two key blocks,
# with Dv = 70 over several value blocks; T never a multiple of the chunk.
GATED_SHAPES = [(2, 21, 1, 2, 5, 7), (1, 9, 1, 2, 128, 70)]
GATED_IDS = [f"B{b}-T{t}-Hk{hk}-H{h}-Dk{dk}-Dv{dv}" for b, t, hk, h, dk, dv in GATED_SHAPES]


def gated_inputs(B, T, Hk, H, Dk, Dv, seed=0):
    """Gated DeltaNet inputs in float64: L2-normalised q, k (Hk heads), v, beta, g (H heads),
    the log-gates down to -50 per token with a hard reset (g = -inf) in the first sequence."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(B, T, Hk, Dk, generator=gen, dtype=torch.float64), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, Hk, Dk, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, Dv, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    g = torch.nn.functional.logsigmoid(3 * torch.randn(B, T, H, generator=gen, dtype=torch.float64))
    g[0, 3, 0], g[0, T // 2, H - 1] = -50.0, -float("inf")
    S0 = torch.randn(B, H, Dk, Dv, generator=gen, dtype=torch.float64)
    return q, k, v, beta, g, S0


@pytest.fixture
def launches(kernels, monkeypatch) -> Counter:
    """Launches per kernel of ops/delta_rule/triton.py (name without the leading underscore
    and ``_kernel``): a call that ran PyTorch instead cannot pass."""
    counts: Counter = Counter()
    module = kernels.delta_rule
    for name in [n for n in vars(module) if n.startswith("_") and n.endswith("_kernel")]:
        monkeypatch.setattr(module, name, _Counted(getattr(module, name),
                                                   name.strip("_").removesuffix("_kernel"),
                                                   counts))
    return counts


# Forward (a) to (c), then the backward's recomputed (a) and (b) and (d) to (g): one launch each.
GATED_LAUNCHES = Counter(ut_fwd=2, state_fwd=2, output=1, local_du=1, state_bwd=1, ut_bwd=1,
                         grad=1)


def gated_grads_match(o, S, ro, rS, x_fast, x_ref, tol, seed=11) -> None:
    """Back-propagate one random weighting of (o, S) through the kernels and through the
    oracle; every input's gradient (q, k, v, beta, g, S0) in its dtype and within ``tol`` times
    the oracle's largest (at least 1)."""
    gen = torch.Generator().manual_seed(seed)
    wo = torch.randn(ro.shape, generator=gen, dtype=torch.float64)
    wS = torch.randn(rS.shape, generator=gen, dtype=torch.float64)
    ((o.double() * wo).sum() + (S.double() * wS).sum()).backward()
    ((ro * wo).sum() + (rS * wS).sum()).backward()
    for name, a, b in zip(("q", "k", "v", "beta", "g", "S0"), x_fast, x_ref):
        assert a.grad is not None and a.grad.dtype == a.dtype, name
        assert torch.isfinite(a.grad).all(), name
        scale = max(1.0, b.grad.abs().max().item())
        assert max_err(a.grad, b.grad) <= tol * scale, f"d{name}: {max_err(a.grad, b.grad):.2e}"


@pytest.mark.parametrize(("shape", "chunk"), [(GATED_SHAPES[0], 8), (GATED_SHAPES[1], 8)],
                         ids=[f"C8-{i}" for i in GATED_IDS])
def test_gated_delta_kernel_matches_naive(kernels, launches, shape, chunk):
    """The delta rule's kernels with the gates on (segment sums of log-gates: a gate of -50 and
    a hard reset stay finite), forward and backward, against the float64 literal recurrence on
    the same float32 inputs: output, final state and the gradients of q, k, v, beta, g and S0
    to float32 accuracy (the reset's own gate gets the oracle's gradient, 0), one launch per
    kernel and pass."""
    x32 = [x.float().requires_grad_() for x in gated_inputs(*shape)]
    x64 = [x.detach().double().requires_grad_() for x in x32]
    o, S = kernels.gated_delta_rule.gated_delta_rule_triton(*x32, chunk)
    ref, Sr = gated_delta_rule_naive(*x64[:5], S0=x64[5])
    assert o.dtype == S.dtype == torch.float32 and o.shape == ref.shape
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert max_err(o, ref) <= TOL32, f"o: {max_err(o, ref):.2e}"
    assert max_err(S, Sr) <= TOL32, f"S: {max_err(S, Sr):.2e}"
    gated_grads_match(o, S, ref, Sr, x32, x64, TOL32)
    assert launches == GATED_LAUNCHES, launches


def test_gated_delta_kernel_half_inputs_and_gradients(kernels, launches):
    """bfloat16 q, k, v: output and the gradients of q, k, v in bfloat16 within its rounding of
    the oracle on the same rounded inputs (those of beta, g and S0 in float32), state float32."""
    q, k, v, beta, g, S0 = gated_inputs(1, 21, 1, 2, 6, 5, seed=2)
    xh = [x.bfloat16() for x in (q, k, v)] + [x.float() for x in (beta, g, S0)]
    xh = [x.requires_grad_() for x in xh]
    x64 = [x.detach().double().requires_grad_() for x in xh]
    o, S = kernels.gated_delta_rule.gated_delta_rule_triton(*xh, 8)
    ref, Sr = gated_delta_rule_naive(*x64[:5], S0=x64[5])
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    assert max_err(o, ref) <= 2 * torch.finfo(torch.bfloat16).eps * ref.abs().max().item()
    assert max_err(S, Sr) <= TOL32 * max(1.0, Sr.abs().max().item())
    gated_grads_match(o, S, ref, Sr, xh, x64, 2 * torch.finfo(torch.bfloat16).eps)
    assert launches == GATED_LAUNCHES, launches


def test_gated_delta_dispatch_through_the_kernels(kernels, monkeypatch):
    """With the device check forced and fla absent, gated_delta_rule runs the (interpreted)
    kernels for half inputs (scale applied, state carried, output in the input dtype, equal to
    mode="naive"; a packed batch one document at a time, gradients included), and PyTorch for
    float32 inputs (no spill-free float32 tiling, as for the
    delta rule), chunk sizes over 64 and one-token steps. The first automatic choice runs a
    trial call first (ops/backend.py)."""
    ran = []
    monkeypatch.setattr(backends, "_trials", {})
    fn = kernels.gated_delta_rule.gated_delta_rule_triton
    monkeypatch.setattr(kernels.gated_delta_rule, "gated_delta_rule_triton", lambda *a: ran.append(1) or fn(*a))
    monkeypatch.setattr(backends, "_on_cuda", lambda q: True)
    monkeypatch.setattr(backends, "fla_ops", lambda: None)
    monkeypatch.delenv("FASTWEIGHTS_BACKEND", raising=False)
    monkeypatch.delenv("FASTWEIGHTS_TRITON", raising=False)
    q, k, v, beta, g, S0 = gated_inputs(1, 13, 1, 2, 4, 3, seed=4)
    qh, kh, vh = (x.half() for x in (q, k, v))
    kw = {"scale": 0.7, "output_final_state": True}
    o, S = gated_delta_rule(qh, kh, vh, beta.float(), g.float(), initial_state=S0.float(),
                            chunk_size=8, **kw)
    ref, Sr = gated_delta_rule(qh.double(), kh.double(), vh.double(), beta.float().double(),
                               g.float().double(), initial_state=S0, mode="naive", **kw)
    assert ran == [1, 1] and o.dtype == torch.float16  # the trial, then the call
    assert max_err(o, ref) <= torch.finfo(torch.float16).eps * ref.abs().max().item()
    assert max_err(S, Sr) <= TOL32 * max(1.0, Sr.abs().max().item())
    # A packed batch: one document at a time through the kernels, the state reset between;
    # the gradients too (the trial ran without them: a trial with them first).
    cu = torch.tensor([0, 5, 13])
    xh = [x.detach().requires_grad_() for x in (qh, kh, vh, beta.float(), g.float())]
    x64 = [x.detach().double().requires_grad_() for x in xh]
    o, states = gated_delta_rule(*xh, cu_seqlens=cu, chunk_size=8, **kw)
    ref, ref_states = gated_delta_rule(*x64, cu_seqlens=cu, mode="naive", **kw)
    assert ran == [1] * 5 and len(states) == 2
    assert max_err(o, ref) <= torch.finfo(torch.float16).eps * ref.abs().max().item()
    assert max(max_err(a, b) for a, b in zip(states, ref_states)) <= TOL32
    w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    (o.double() * w).sum().backward()
    (ref * w).sum().backward()
    for name, a, b in zip(("q", "k", "v", "beta", "g"), xh, x64):
        tol = 4 * torch.finfo(torch.float16).eps * max(1.0, b.grad.abs().max().item())
        assert max_err(a.grad, b.grad) <= tol, f"d{name}: {max_err(a.grad, b.grad):.2e}"
    gated_delta_rule(*(x.float() for x in (q, k, v, beta, g)), chunk_size=8)
    gated_delta_rule(qh, kh, vh, beta, g, chunk_size=65)
    gated_delta_rule(qh[:, :1], kh[:, :1], vh[:, :1], beta[:, :1], g[:, :1])
    assert ran == [1] * 5  # none of the three above
    with pytest.raises(ValueError, match="chunk_size <= 64"):
        gated_delta_rule(qh, kh, vh, beta, g, chunk_size=65, backend="triton")
    for dtype, want in ((torch.bfloat16, "triton"), (torch.float32, "torch")):
        assert backends.choose_backend("gated_delta_rule", cuda_like(dtype), None, "chunk", 64) == want
