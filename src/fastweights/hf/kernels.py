"""transformers' own Gated DeltaNet models on fastweights' ops: ``use_fastweights(model)``.

transformers (5.x) writes the gated-delta layers of Qwen3.5 (``Qwen3_5GatedDeltaNet``, and
the MoE variant's), Qwen3-Next (``Qwen3NextGatedDeltaNet``) and OLMo-hybrid
(``OlmoHybridGatedDeltaNet``) around four functions of their modeling module:
``torch_chunk_gated_delta_rule`` (prefill), ``torch_recurrent_gated_delta_rule`` (one-token
decoding), ``causal_conv1d_fn`` and ``causal_conv1d_update`` (the short convolution, whole and
one step). ``use_kernel_func_from_hub_with_fallback`` binds each name, when the modeling module
is imported, to fla's or causal-conv1d's kernel where the package is installed, else to
transformers' PyTorch fallback. Neither choice suits a CPU: fla's kernels are Triton only (a
CPU forward fails with "0 active drivers"), and the fallbacks are slow (a chunked form written
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

Kimi-Linear's KDA layer is not covered: its decay is per key channel (g [B, T, H, Dk]), which
the scalar-per-head gate of ``gated_delta_rule`` does not express.

Numerics: q and k are L2-normalised in float32 (float64 for float64 models) as transformers'
fallbacks do, then the chunked op gets q, k, v in the values' dtype (the project's
mixed-precision rule: a bfloat16 model reaches the GPU kernels); the recurrent state is float32
(float64), outputs return in the input dtype.
"""

from __future__ import annotations

import contextvars
import functools
import sys
from collections.abc import Callable
from itertools import pairwise
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import state_dtype
from ..layers.gated_delta import l2_normalize
from ..ops._conv import causal_depthwise_conv
from ..ops.fwp import gated_delta_rule, gated_delta_rule_step, preferred_chunk_size

__all__ = ["is_gated_delta_layer", "use_fastweights"]

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
        B, _, H, Dv = v.shape
        S0 = (q.new_zeros(B, H, q.shape[-1], Dv) if initial_state is None
              else initial_state.to(cdtype))
        o, S = gated_delta_rule_step(q * scale, k, v, beta.to(cdtype), g.to(cdtype), S0)
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


def is_gated_delta_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers gated-delta layer ``use_fastweights`` serves: a
    ``...GatedDeltaNet`` class whose modeling module defines the four kernel names."""
    source = sys.modules.get(type(module).__module__)
    return (type(module).__name__.endswith("GatedDeltaNet") and source is not None
            and type(module).__module__.startswith("transformers.")
            and all(callable(getattr(source, name, None)) for name in KERNELS))


def use_fastweights(model: nn.Module, enable: bool = True) -> nn.Module:
    """Run the gated-delta layers of a transformers ``model`` (Qwen3.5, Qwen3.5-MoE,
    Qwen3-Next, OLMo-hybrid) on fastweights' ops: the chunked gated delta rule for prefill,
    its one-token step for decoding, fastweights' causal convolution for both (see the module
    docstring). Returns ``model``; calling it again is a no-op, ``enable=False`` restores
    transformers' own functions for this model. ValueError when ``model`` has no such layer."""
    layers = [m for m in model.modules() if is_gated_delta_layer(m)]
    unserved = {type(m).__module__ for m in model.modules()
                if type(m).__name__.endswith("GatedDeltaNet") and not is_gated_delta_layer(m)
                and type(m).__module__.startswith("transformers.")}
    if not layers and unserved:
        import transformers

        raise ValueError(
            f"transformers {transformers.__version__} writes {type(model).__name__}'s gated-delta "
            f"layers without the module-level functions use_fastweights replaces "
            f"({', '.join(KERNELS)} in {', '.join(sorted(unserved))}); it is tested with "
            "transformers 5.23 and 5.24")
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no transformers gated-delta layer (Qwen3.5, Qwen3-Next "
            "or OLMo-hybrid ...GatedDeltaNet); Kimi-Linear's KDA (a per-channel decay) is not "
            "supported")
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
