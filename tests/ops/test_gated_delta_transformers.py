"""gated_delta_rule against transformers' own PyTorch gated delta rule (the reference forms of
Qwen3.5 and Qwen3-Next, ``torch_chunk_gated_delta_rule`` and ``torch_recurrent_gated_delta_rule``,
the same code in both models and in OLMo-hybrid).

The exact correspondence, checked below (both take [B, T, H, D] and states [B, H, Dk, Dv]):

    theirs(q, k, v, g=g, beta=beta, initial_state=S0, use_qk_l2norm_in_kernel=l2)
    == gated_delta_rule(n(q), n(k), v, beta, g, scale=Dk ** -0.5, initial_state=S0)

with n(x) = x / sqrt(sum x^2 + 1e-6) (their l2norm, fla's) when l2 is set, else n(x) = x.
Theirs always scales q by 1/sqrt(Dk); ours has no hidden scale. Grouped heads: both map value
head h to key head h // (H / Hk) (theirs by ``repeat_interleave`` of q and k).

Theirs compute in float32 whatever the input dtype (``.to(torch.float32)`` inside). To compare
the algorithms to float64 rounding, their function is also run with its module's name
``torch`` bound to a view of torch whose ``float32`` is float64: the same code, every line
unchanged, computing in float64 (``_in_float64``). Unmodified, in float32, they agree with our
float64 result to float32 rounding (checked too).

With fla installed, the module-level names are transformers' wrappers that dispatch to fla's
Triton kernels; ``__wrapped__`` is transformers' PyTorch fallback, the function tested here.
"""

from __future__ import annotations

import importlib
import inspect
import types

import pytest
import torch

from fastweights.ops import gated_delta_rule, gated_delta_rule_step
from tests.ops.test_gated_delta import make, rel_err, state0

pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed")

MODELS = ["qwen3_5", "qwen3_next"]


def _fallback(model: str, name: str):
    """transformers' PyTorch ``name`` of ``model`` (unwrapped from the kernel dispatch)."""
    module = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    fn = inspect.unwrap(getattr(module, name))
    # The wrapper copies the fallback's name and module: the code's file tells them apart.
    assert fn.__code__.co_filename == module.__file__ and fn.__name__ == name
    return fn


class _Float64Torch(types.SimpleNamespace):
    """torch, but for ``float32``, which is float64."""

    def __getattr__(self, name: str):
        return torch.float64 if name == "float32" else getattr(torch, name)


def _in_float64(fn):
    """``fn`` with its global ``torch`` replaced by ``_Float64Torch``: the same code in float64."""
    wide = types.FunctionType(fn.__code__, {**fn.__globals__, "torch": _Float64Torch()},
                              fn.__name__, fn.__defaults__, fn.__closure__)
    wide.__kwdefaults__ = fn.__kwdefaults__
    return wide


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _inputs(T: int, Hk: int, H: int, seed: int):
    q, k, v, beta, g = make(2, T, Hk, H, 8, 6, seed=seed, gates="mixed")
    k = 1.7 * k  # not unit norm: what l2norm does is visible
    return q, k, v, beta, g, state0(2, H, 8, 6, seed=seed)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("l2", [False, True], ids=["raw", "l2norm"])
@pytest.mark.parametrize("Hk,H", [(2, 2), (2, 4)], ids=["heads-2", "grouped-2-4"])
@pytest.mark.parametrize("chunk", [16, 64], ids=lambda c: f"C{c}")
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "state"])
def test_equals_torch_chunk_gated_delta_rule(model, l2, Hk, H, chunk, with_state):
    """T = 37: a padded last chunk on both sides."""
    q, k, v, beta, g, S0 = _inputs(37, Hk, H, seed=30)
    init = S0 if with_state else None
    theirs = _fallback(model, "torch_chunk_gated_delta_rule")
    o_t, S_t = _in_float64(theirs)(q, k, v, g=g, beta=beta, chunk_size=chunk,
                                   initial_state=init, output_final_state=True,
                                   use_qk_l2norm_in_kernel=l2)
    assert S_t.dtype == torch.float64  # (o comes back in the input dtype either way)
    qn, kn = (_l2norm(q), _l2norm(k)) if l2 else (q, k)
    o, S = gated_delta_rule(qn, kn, v, beta, g, scale=8 ** -0.5, initial_state=init,
                            output_final_state=True, chunk_size=chunk)
    assert rel_err(o, o_t) <= 1e-12 and rel_err(S, S_t) <= 1e-12
    # Unmodified (float32 inside): our float64 result to float32 rounding.
    o32, S32 = theirs(q, k, v, g=g, beta=beta, chunk_size=chunk, initial_state=init,
                      output_final_state=True, use_qk_l2norm_in_kernel=l2)
    assert S32.dtype == torch.float32
    assert rel_err(o32, o) <= 5e-5 and rel_err(S32, S) <= 5e-5


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("l2", [False, True], ids=["raw", "l2norm"])
@pytest.mark.parametrize("Hk,H", [(2, 2), (2, 4)], ids=["heads-2", "grouped-2-4"])
def test_equals_torch_recurrent_gated_delta_rule(model, l2, Hk, H):
    q, k, v, beta, g, S0 = _inputs(23, Hk, H, seed=31)
    theirs = _in_float64(_fallback(model, "torch_recurrent_gated_delta_rule"))
    o_t, S_t = theirs(q, k, v, g=g, beta=beta, initial_state=S0, output_final_state=True,
                      use_qk_l2norm_in_kernel=l2)
    qn, kn = (_l2norm(q), _l2norm(k)) if l2 else (q, k)
    for mode in ("recurrent", "chunk", "naive"):
        o, S = gated_delta_rule(qn, kn, v, beta, g, scale=8 ** -0.5, initial_state=S0,
                                output_final_state=True, mode=mode, chunk_size=8)
        assert rel_err(o, o_t) <= 1e-12 and rel_err(S, S_t) <= 1e-12, mode


@pytest.mark.parametrize("model", MODELS)
def test_decoding_step_equals_theirs(model):
    """One token with a carried state, as their layer decodes (Hk 2, H 4, L2-normalised q, k):
    theirs(T = 1) == gated_delta_rule_step on our side."""
    q, k, v, beta, g, S0 = _inputs(1, 2, 4, seed=32)
    theirs = _in_float64(_fallback(model, "torch_recurrent_gated_delta_rule"))
    o_t, S_t = theirs(q, k, v, g=g, beta=beta, initial_state=S0, output_final_state=True,
                      use_qk_l2norm_in_kernel=True)
    o, S = gated_delta_rule_step(_l2norm(q), _l2norm(k), v, beta, g, state=S0, scale=8 ** -0.5)
    assert rel_err(o, o_t) <= 1e-12 and rel_err(S, S_t) <= 1e-12
