"""transformers' own Gated DeltaNet models on fastweights' ops: ``use_fastweights(model)``.

transformers (5.x) writes the gated-delta layers of Qwen3.5 (``Qwen3_5GatedDeltaNet``, and
the MoE variant's), Qwen3-Next (``Qwen3NextGatedDeltaNet``), OLMo-hybrid
(``OlmoHybridGatedDeltaNet``) and, in 5.24, LaraMini and Qwen4-Exp around four functions of
their modeling module (``gated_delta_architectures`` finds every such module of the installed
transformers):
``torch_chunk_gated_delta_rule`` (prefill), ``torch_recurrent_gated_delta_rule`` (one-token
decoding), ``causal_conv1d_fn`` and ``causal_conv1d_update`` (the short convolution, whole and
one step). ``use_kernel_func_from_hub_with_fallback`` binds each name, when the modeling module
is imported, to fla's or causal-conv1d's kernel where the package is installed, else to
transformers' PyTorch fallback. Neither choice suits a CPU: fla's kernels are Triton only (a
CPU forward fails with "0 active drivers"; from transformers 5.25, CPU inputs go to the
fallbacks), and the fallbacks are slow (a chunked form written
for clarity, a token loop, and PyTorch's depthwise ``conv1d``, which has no fast bfloat16 CPU
kernel). The kernel hub (``kernels``) offers no way to register a local function for them.

``use_fastweights(model)`` makes every such layer of ``model`` call fastweights instead:
``gated_delta_rule`` (the chunked form) for prefill, ``gated_delta_rule_step`` for decoding and
``causal_depthwise_conv`` for the convolutions, on any device and whether or not fla is
installed. transformers' own layer code runs unchanged around them (projections, gates,
norms, its cache of conv and recurrent states), so generation, caches and checkpoints are
transformers'. How: the four module-level names are replaced, once per modeling module, by a
dispatcher that calls fastweights' function inside a layer marked by ``use_fastweights`` and
the original binding everywhere else (other models, unmarked layers: unchanged behaviour);
the marking is a forward pre-hook and an always-called forward hook on each layer.

A layer is served whole or not at all: a transformers layer named ``...GatedDeltaNet`` or whose
forward calls the gated delta rule is refused, with the model's and the layer's names and the
reason, when its module lacks one of the four names, when its forward also calls another
kernel function of its module (one transformers binds at import, as it binds these four), or
when one of the four takes a parameter fastweights' replacement does not (a later transformers
release that changes them). Nothing is patched then.

Kimi-Linear's KDA layer is not covered: its decay is per key channel (g [B, T, H, Dk]), which
the scalar-per-head gate of ``gated_delta_rule`` does not express.

Numerics: q and k are L2-normalised in float32 (float64 for float64 models) as transformers'
fallbacks do, then the chunked op gets q, k, v in the values' dtype (the project's
mixed-precision rule: a bfloat16 model reaches the GPU kernels); the recurrent state is float32
(float64), outputs return in the input dtype.
"""

from __future__ import annotations

import contextvars
import dis
import functools
import importlib.util
import inspect
import re
import sys
import types
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import state_dtype
from ..layers.conv import causal_depthwise_conv
from ..layers.gated_delta import l2_normalize
from ..ops import gated_delta_rule, gated_delta_rule_step
from ..ops.backend import preferred_chunk_size

__all__ = ["gated_delta_architectures", "is_gated_delta_layer", "use_fastweights"]

# Depth of marked layers' forwards running in this context (a layer's forward is not reentrant,
# but a count is as cheap as a flag and survives nesting).
_DEPTH: contextvars.ContextVar[int] = contextvars.ContextVar("fastweights_gated_delta", default=0)


def _activation(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"causal_conv1d activation must be None, 'silu' or 'swish', got {activation!r}")


def _conv(full: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
          activation: str | None) -> torch.Tensor:
    """act(conv) of ``full`` [B, C, W - 1 + T] (the past first) -> [B, C, T] in float32 or wider
    (the activation before the single rounding, as fused kernels do)."""
    acc = torch.promote_types(weight.dtype, torch.float32)
    y = causal_depthwise_conv(full.to(acc), weight.unsqueeze(1).to(acc),
                              None if bias is None else bias.to(acc))
    return _activation(y, activation)


def causal_conv1d_fn(hidden_states: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None, activation: str | None = None,
                     **kwargs: Any) -> torch.Tensor:
    """transformers' ``causal_conv1d_fn``: x [B, C, T], weight [C, W] -> act(causal depthwise
    conv) [B, C, T] in x's dtype (zeros before the first token). With ``cu_seq_lens_q``
    (packed documents in a batch of one) each document starts from zeros."""
    W = weight.shape[-1]
    cu = kwargs.get("cu_seq_lens_q", kwargs.get("cu_seqlens"))
    if cu is None:
        return _conv(F.pad(hidden_states, (W - 1, 0)), weight, bias, activation).to(
            hidden_states.dtype)
    bounds = [int(b) for b in cu.tolist()]
    pieces = [_conv(F.pad(hidden_states[..., a:b], (W - 1, 0)), weight, bias, activation)
              for a, b in pairwise(bounds)]
    return torch.cat(pieces, dim=-1).to(hidden_states.dtype)


def causal_conv1d_update(hidden_states: torch.Tensor, conv_state: torch.Tensor,
                         weight: torch.Tensor, bias: torch.Tensor | None = None,
                         activation: str | None = None, **kwargs: Any) -> torch.Tensor:
    """transformers' ``causal_conv1d_update``: continue the convolution from ``conv_state``
    [B, C, S] (the last S inputs, S >= W - 1), updated in place; x [B, C, T] -> [B, C, T]."""
    W, T = weight.shape[-1], hidden_states.shape[-1]
    full = torch.cat([conv_state, hidden_states.to(conv_state.dtype)], dim=-1)
    conv_state.copy_(full[..., full.shape[-1] - conv_state.shape[-1]:])
    return _conv(full[..., full.shape[-1] - (W - 1 + T):], weight, bias, activation).to(
        hidden_states.dtype)


def _gated_delta(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor, initial_state: torch.Tensor | None,
                 output_final_state: bool, use_qk_l2norm_in_kernel: bool,
                 cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' gated delta rule (q scaled by 1/sqrt(Dk), optional L2 norm; states
    [N, H, Dk, Dv]) as ``gated_delta_rule``; a one-token call is the recurrence's step."""
    cdtype = state_dtype(query.dtype)
    q, k, v = (x.to(cdtype) for x in (query, key, value))
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalize(q), l2_normalize(k)
    scale = q.shape[-1] ** -0.5
    if cu_seqlens is None and q.shape[1] == 1:
        o, S = gated_delta_rule_step(q, k, v, beta, g, state=initial_state, scale=scale)
    else:
        init: Any = initial_state
        if cu_seqlens is not None and initial_state is not None:  # [N, ...] -> one per document
            init = list(initial_state.split(1))
        # The op's operands in the values' dtype (layers/base.py like_values): a bfloat16 model
        # reaches the GPU kernels; the state and the gates stay float32.
        q, k, v = (x.to(value.dtype) for x in (q, k, v))
        o, S = gated_delta_rule(
            q, k, v, beta, g, scale=scale, initial_state=init, output_final_state=True,
            chunk_size=preferred_chunk_size("gated_delta_rule", q.device), cu_seqlens=cu_seqlens)
        if cu_seqlens is not None:
            S = torch.cat(S)
    return o.to(query.dtype), (S if output_final_state else None)


def chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           g: torch.Tensor, beta: torch.Tensor, chunk_size: int = 64,
                           initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False,
                           cu_seqlens: torch.Tensor | None = None, **kwargs: Any
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' ``torch_chunk_gated_delta_rule`` on ``gated_delta_rule`` (its chunk size
    is the measured fastest for the device, ``chunk_size`` being a kernel detail)."""
    return _gated_delta(query, key, value, g, beta, initial_state, output_final_state,
                        use_qk_l2norm_in_kernel, cu_seqlens)


def recurrent_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               g: torch.Tensor, beta: torch.Tensor,
                               initial_state: torch.Tensor | None = None,
                               output_final_state: bool = False,
                               use_qk_l2norm_in_kernel: bool = False,
                               cu_seqlens: torch.Tensor | None = None, **kwargs: Any
                               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' ``torch_recurrent_gated_delta_rule``: one token, ``gated_delta_rule_step``."""
    return _gated_delta(query, key, value, g, beta, initial_state, output_final_state,
                        use_qk_l2norm_in_kernel, cu_seqlens)


# The module-level names transformers' gated-delta layers call, and fastweights' replacements.
KERNELS: dict[str, Callable[..., Any]] = {
    "torch_chunk_gated_delta_rule": chunk_gated_delta_rule,
    "torch_recurrent_gated_delta_rule": recurrent_gated_delta_rule,
    "causal_conv1d_fn": causal_conv1d_fn,
    "causal_conv1d_update": causal_conv1d_update,
}


def _dispatcher(original: Callable[..., Any], ours: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        return (ours if _DEPTH.get() else original)(*args, **kwargs)

    dispatch.fastweights_original = original  # type: ignore[attr-defined]
    return dispatch


def _install(module: ModuleType) -> None:
    """Put the dispatchers in ``module`` (once: a dispatcher already there is kept)."""
    for name, ours in KERNELS.items():
        current = getattr(module, name)
        if not hasattr(current, "fastweights_original"):
            setattr(module, name, _dispatcher(current, ours))


def _enter(module: nn.Module, args: Any) -> None:
    _DEPTH.set(_DEPTH.get() + 1)


def _leave(module: nn.Module, args: Any, output: Any) -> None:
    _DEPTH.set(_DEPTH.get() - 1)


# transformers' two forms of the gated delta rule: a layer that calls one is a gated-delta layer.
GATED_DELTA_RULE = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")


@functools.cache
def gated_delta_architectures() -> tuple[str, ...]:
    """The installed transformers' gated-delta architectures: the names of its
    ``transformers.models.<name>`` packages whose ``modeling_<name>.py`` defines
    ``torch_chunk_gated_delta_rule`` (``lara_mini``, ``olmo_hybrid``, ``qwen3_5``,
    ``qwen3_5_moe``, ``qwen3_next``, ``qwen4_exp`` in 5.24), found by reading the source files,
    importing none; () without transformers."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return ()
    defines = re.compile(rf"^def {GATED_DELTA_RULE[0]}\(", re.MULTILINE)
    root = Path(spec.submodule_search_locations[0]) / "models"
    return tuple(sorted(
        path.parent.name for path in root.glob("*/modeling_*.py")
        if path.name == f"modeling_{path.parent.name}.py"
        and defines.search(path.read_text(encoding="utf-8", errors="replace"))))


def _global_names(fn: Callable[..., Any]) -> set[str]:
    """The global names the code of ``fn`` (unwrapped from its decorators) and of the functions
    nested in it loads."""
    codes, names = [inspect.unwrap(fn).__code__], set()
    while codes:
        code = codes.pop()
        names.update(i.argval for i in dis.get_instructions(code) if i.opname == "LOAD_GLOBAL")
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return names


def _is_kernel(obj: Any, module: str) -> bool:
    """Whether ``obj`` is a kernel function of modeling module ``module``: one defined there and
    bound at import through a wrapper (transformers' ``use_kernel_func_from_hub_with_fallback``
    or a dispatcher of ours)."""
    return (callable(obj) and inspect.unwrap(obj) is not obj
            and getattr(inspect.unwrap(obj), "__module__", None) == module)


def _positional_names(fn: Callable[..., Any]) -> list[str]:
    """The named parameters of ``fn`` (``*args``, ``**kwargs`` left out), in order."""
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _is_candidate(cls: type) -> bool:
    """Whether ``cls`` is a transformers gated-delta layer: a ``...GatedDeltaNet`` class of a
    transformers module, or one whose forward calls the gated delta rule."""
    if not cls.__module__.startswith("transformers.") or not callable(getattr(cls, "forward", None)):
        return False
    return cls.__name__.endswith("GatedDeltaNet") or bool(
        _global_names(cls.forward) & set(GATED_DELTA_RULE))


_MISSING = "without the module-level functions use_fastweights replaces"


def _unsupported(cls: type) -> str | None:
    """Why ``use_fastweights`` cannot serve gated-delta layer class ``cls`` whole (a phrase
    naming what is missing or unsupported), None when it can."""
    source = sys.modules.get(cls.__module__)
    missing = [name for name in KERNELS if not callable(getattr(source, name, None))]
    if missing:
        return f"is written {_MISSING} (no {', '.join(missing)} in {cls.__module__})"
    others = sorted(name for name in _global_names(cls.forward) - KERNELS.keys()
                    if _is_kernel(getattr(source, name, None), cls.__module__))
    if others:
        return (f"also calls the kernel function(s) {', '.join(others)} of {cls.__module__}, "
                "which use_fastweights does not replace")
    for name, ours in KERNELS.items():
        theirs, mine = _positional_names(inspect.unwrap(getattr(source, name))), _positional_names(ours)
        if mine[:len(theirs)] != theirs:
            new = [p for p in theirs if p not in mine] or theirs
            return (f"calls {name}({', '.join(theirs)}): fastweights' replacement takes "
                    f"({', '.join(mine)}), not {', '.join(new)}")
    return None


def is_gated_delta_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers gated-delta layer ``use_fastweights`` serves: a
    ``...GatedDeltaNet`` layer (or one calling the gated delta rule) whose modeling module
    defines the four kernel names, calls no other kernel and passes only the parameters
    fastweights' replacements take."""
    return _is_candidate(type(module)) and _unsupported(type(module)) is None


def use_fastweights(model: nn.Module, enable: bool = True) -> nn.Module:
    """Run the gated-delta layers of a transformers ``model`` (Qwen3.5, Qwen3.5-MoE,
    Qwen3-Next, OLMo-hybrid, LaraMini, Qwen4-Exp: ``gated_delta_architectures``) on
    fastweights' ops: the chunked gated delta rule for prefill, its one-token step for
    decoding, fastweights' causal convolution for both (see the module docstring). Returns
    ``model``; calling it again is a no-op, ``enable=False`` restores transformers' own
    functions for this model. ValueError, before anything is patched, when ``model`` has no
    such layer, or has one that cannot be served whole (naming the model, the layer and why)."""
    candidates = {cls for cls in {type(m) for m in model.modules()} if _is_candidate(cls)}
    reasons = {cls: why for cls in candidates if (why := _unsupported(cls)) is not None}
    if reasons:
        import transformers

        what = "; ".join(f"{cls.__name__} ({cls.__module__}) {why}"
                         for cls, why in sorted(reasons.items(), key=lambda kv: kv[0].__name__))
        raise ValueError(
            f"use_fastweights cannot serve {type(model).__name__} of transformers "
            f"{transformers.__version__}: its gated-delta layer {what}; nothing was changed "
            "(it is tested with transformers 5.23 and 5.24)")
    layers = [m for m in model.modules() if type(m) in candidates]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no transformers gated-delta layer (those of "
            f"{', '.join(gated_delta_architectures()) or 'transformers 5.23 and 5.24'}); "
            "Kimi-Linear's KDA (a per-channel decay) is not supported")
    for layer in layers:
        _install(sys.modules[type(layer).__module__])
        marked = _enter in layer._forward_pre_hooks.values()
        if enable and not marked:
            layer.register_forward_pre_hook(_enter)
            layer.register_forward_hook(_leave, always_call=True)
        elif not enable and marked:
            for hooks in (layer._forward_pre_hooks, layer._forward_hooks):
                for key in [k for k, hook in hooks.items() if hook in (_enter, _leave)]:
                    del hooks[key]
                    layer._forward_hooks_always_called.pop(key, None)
    return model
