"""Which implementation runs a chunked fast-weight op, and the chunk sizes measured fastest
per device kind. The one place that decides backends: the ops (ops/fwp/linear_attention.py,
ops/fwp/delta.py, ops/fwp/gated_delta.py, ops/transnormer/decay.py) call ``choose_backend``
and run what it names; the fla adapters sit beside the ops they adapt (ops/fwp/fla.py,
ops/transnormer/fla.py) and reach fla through ``fla_ops`` and ``fla_varlen`` here.

``linear_attn``, ``delta_rule``, ``gated_delta_rule``, ``decay_linear_attn``, ``ttt_linear``
and ``ttt_mlp`` take ``backend=`` (the TTT ops' kernels run their dual form, mode="dual", with
the mini-batch size as chunk size; ops/ttt/triton.py; fla has none):
  "fla"     flash-linear-attention's maintained chunk kernels (``pip install
            flash-linear-attention``), CUDA only;
  "triton"  this project's kernels (ops/fwp/triton.py), CUDA only, linear_attn, delta_rule and
            gated_delta_rule (its forward; its backward is the PyTorch chunked form's);
  "torch"   the PyTorch forms of ``mode=`` (any device).
``backend=None`` (the default) means: the environment variable ``FASTWEIGHTS_BACKEND`` if set
(one of the three names), else the first of fla, triton, torch that can run the call. An
explicit choice (argument or environment) that cannot run the call is a ValueError saying why;
the automatic choice says once per (op, backend, reason), at logging level INFO, what it took.
``FASTWEIGHTS_TRITON=0`` (older switch) still keeps the automatic choice off Triton.

What each backend accepts: fla and triton run mode="chunk" only, on CUDA tensors of float16,
bfloat16 or float32, except the delta rule's float32 inputs, which neither takes (fla 0.6's
chunk_delta_rule refuses them; triton has no spill-free tiling for them: torch runs them);
fla's chunk_gated_delta_rule takes float32 inputs too, triton (the delta rule's kernels) not.
fla's kernels use chunks of 64, so fla runs chunk_size=64 (the default) only; triton runs
chunk_size <= 64 and Dk <= 128 (the tilings ``tile_config`` gives, which
tests/ops/test_fwp_triton_compile.py compiles for sm_80 and sm_90 without register spills).
The automatic choice never crashes where another backend can run. A kernel backend may still
refuse a call at run time, in its forward or only in its backward (fla 0.6's gated kernels raise
a RuntimeError in the backward pass on Hopper GPUs with Triton < 3.7.1, a guard for a Triton
bug). So the first time the automatic choice would take fla or triton for an (op, backend,
dtype, device kind, gradients or not), it tries that backend on the call's first
``PROBE_TOKENS`` tokens (forward, and backward when gradients are recorded; on detached copies,
so the caller's graph and gradients are untouched): if the trial raises, the backend is refused
for that key from then on, the reason is logged once at WARNING, and the next backend is tried.
The trial's cost is that of one short call; fla's first-call autotuning, which a trial triggers,
would have happened in the call itself. An explicit choice is not tried: its refusal raises.
The automatic choice keeps a one-token call (decoding, T = 1) on torch's recurrent step. Packed
batches (cu_seqlens) go to fla whole, with fla's own cu_seqlens; triton and torch run them one
document at a time (ops/_varlen.py). How the fla adapters map fla's conventions to ours:
ops/fwp/fla.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

__all__ = ["BACKENDS", "PREFERRED_CHUNK_SIZES", "PROBE_TOKENS", "Trial", "choose_backend",
           "fla_ops", "fla_varlen", "preferred_chunk_size", "triton_kernels", "ttt_triton_kernels"]

BACKENDS = ("fla", "triton", "torch")
ENV = "FASTWEIGHTS_BACKEND"
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FLA_CHUNK = 64
TRITON_MAX_DK = 128  # the key blocks the kernels hold (ops/fwp/triton.py MAX_DK)
TRITON_OPS = ("linear_attn", "delta_rule", "gated_delta_rule")
# The TTT ops' dual form (mode="dual", chunk_size = mini_batch_size) in ops/ttt/triton.py.
TTT_TRITON_OPS = ("ttt_linear", "ttt_mlp")
KERNEL_MODES = {"ttt_linear": "dual", "ttt_mlp": "dual"}  # the mode kernels run; else "chunk"

# Chunk sizes measured per device kind (forward and forward+backward, B1 H8 T4096 D64 float32;
# `fastweights bench fwp-forms --backward --chunk-sizes 16,32,64,128 --modes chunk`,
# recorded in benchmarks/results/chunk_sizes/). Devices not measured here keep 64, the size
# flash-linear-attention's GPU kernels use (FLA_CHUNK).
PREFERRED_CHUNK_SIZES: dict[str, dict[str, int]] = {
    "cpu": {"linear_attn": 64, "delta_rule": 32, "gated_delta_rule": 32},
}


def preferred_chunk_size(op: str, device: torch.device | str) -> int:
    """The measured fastest ``chunk_size`` of ``op`` (``"linear_attn"``, ``"delta_rule"`` or
    ``"gated_delta_rule"``, the last from benchmarks/results/gated_delta_epyc_avx2/) on
    this kind of device (see ``PREFERRED_CHUNK_SIZES``); 64 where nothing was measured. Layers
    built with ``chunk_size=None`` use it; the ops themselves keep the default of 64
    (docs/design.md, "Modes")."""
    if op not in ("linear_attn", "delta_rule", "gated_delta_rule"):
        raise ValueError(f"op must be 'linear_attn', 'delta_rule' or 'gated_delta_rule', got {op!r}")
    return PREFERRED_CHUNK_SIZES.get(torch.device(device).type, {}).get(op, FLA_CHUNK)


_logger = logging.getLogger(__name__)
_logged: set[tuple[str, str, str]] = set()
PROBE_TOKENS = 64  # tokens of a trial call: one chunk of fla's kernels
# (op, backend, dtype, device kind, with gradients) -> None (the trial ran) or why it failed
_trials: dict[tuple[str, str, torch.dtype, str, bool], str | None] = {}


class Trial:
    """A trial run of a kernel backend for ``choose_backend``: ``op`` (the public op) on the
    first ``PROBE_TOKENS`` tokens of the call's per-token inputs ``sequences`` (q, k, v, gates:
    [B, T, ...]), detached copies, with ``backend=name``, ``output_final_state=True`` and
    ``options``; when the call records gradients (``grad``), the trial's outputs are
    back-propagated too. It raises what the backend raises."""

    def __init__(self, op: Callable[..., Any], sequences: Sequence[torch.Tensor],
                 **options: Any) -> None:
        self.op, self.sequences, self.options = op, sequences, options
        self.grad = torch.is_grad_enabled() and any(x.requires_grad for x in sequences)

    def __call__(self, name: str) -> None:
        T = min(PROBE_TOKENS, self.sequences[0].shape[1])
        xs = [x[:, :T].detach().clone().requires_grad_(self.grad) for x in self.sequences]
        # Identity saved-tensor hooks: a trial inside a checkpointed region keeps its own graph.
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), \
                (torch.enable_grad() if self.grad else contextlib.nullcontext()):
            out = self.op(*xs, backend=name, output_final_state=True, **self.options)
            if self.grad:
                leaves = [t for t in _tensors(out) if t.requires_grad]
                torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in an op's result (nested tuples and lists)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def _trial_refusal(op: str, name: str, q: torch.Tensor, trial: Trial | None) -> str | None:
    """Why ``name`` failed its trial for this (op, dtype, device kind, gradients), or None
    (it passed, now or earlier; or there is nothing to try)."""
    if trial is None or torch.compiler.is_compiling():
        return None
    key = (op, name, q.dtype, q.device.type, trial.grad)
    if key not in _trials:
        try:
            trial(name)
            _trials[key] = None
        except torch.OutOfMemoryError:
            raise  # memory, not the backend: the next backend would not do better
        except Exception as err:  # a refusal: a version guard, an unsupported shape, ...
            reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            _trials[key] = reason
            _logger.warning("fastweights.ops.%s: the %s backend failed a trial run on %s %s "
                            "inputs%s (%s); the automatic choice skips it for these from now on",
                            op, name, q.device.type, str(q.dtype).removeprefix("torch."),
                            " with gradients" if trial.grad else "", reason)
    return _trials[key]


def triton_kernels() -> ModuleType | None:
    """``ops/fwp/triton.py``, imported on first use; None where triton is not installed."""
    try:
        from .fwp import triton as kernels
    except ImportError:
        return None
    return kernels


def fla_ops() -> Any | None:
    """fla's chunk functions (linear_attn, delta_rule, simple_gla, gated_delta_rule), or None where
    flash-linear-attention is not installed. Tests replace this with fla's reference forms."""
    try:
        from fla.ops.delta_rule import chunk_delta_rule
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.linear_attn import chunk_linear_attn
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError:
        return None
    return SimpleNamespace(linear_attn=chunk_linear_attn, delta_rule=chunk_delta_rule,
                           simple_gla=chunk_simple_gla, gated_delta_rule=chunk_gated_delta_rule)


def _on_cuda(q: torch.Tensor) -> bool:
    return q.is_cuda


def ttt_triton_kernels() -> ModuleType | None:
    """``ops/ttt/triton.py``, imported on first use; None where triton is not installed."""
    try:
        from .ttt import triton as kernels
    except ImportError:
        return None
    return kernels


def _why_not(name: str, op: str, q: torch.Tensor, mode: str, chunk_size: int) -> str | None:
    """Why ``name`` cannot run this call, or None if it can."""
    if name == "torch":
        return None
    kernel_mode = KERNEL_MODES.get(op, "chunk")
    if mode != kernel_mode:
        form = "dual" if kernel_mode == "dual" else "chunked"
        return f"mode={mode!r}: the {name} kernels are the {form} form (mode={kernel_mode!r})"
    if not _on_cuda(q):
        return f"inputs on {q.device}, the {name} kernels need CUDA tensors"
    if q.dtype not in KERNEL_DTYPES:
        return f"dtype {q.dtype}: the {name} kernels take float16, bfloat16 or float32"
    if name == "fla":
        if op in KERNEL_MODES:
            return f"fla has no kernel for {op}"
        if chunk_size != FLA_CHUNK:
            return f"chunk_size={chunk_size}: fla's kernels use chunks of {FLA_CHUNK}"
        if op == "delta_rule" and q.dtype == torch.float32:
            return "float32 inputs: fla's chunk_delta_rule refuses them (fla 0.6)"
        if fla_ops() is None:
            return "flash-linear-attention is not installed (pip install flash-linear-attention)"
        return None
    if op not in TRITON_OPS + TTT_TRITON_OPS:
        return f"no Triton kernel for {op}"
    if chunk_size > 64:
        size = "mini_batch_size" if op in KERNEL_MODES else "chunk_size"
        return f"{size}={chunk_size}: the Triton kernels take {size} <= 64"
    if q.shape[-1] > TRITON_MAX_DK:
        return f"Dk={q.shape[-1]}: the Triton kernels take Dk <= {TRITON_MAX_DK}"
    if os.environ.get("FASTWEIGHTS_TRITON", "1") == "0":
        return "FASTWEIGHTS_TRITON=0"
    kernels = ttt_triton_kernels() if op in KERNEL_MODES else triton_kernels()
    if kernels is None:
        return "triton is not installed (pip install fastweights[triton])"
    if not kernels.supports(op, q.dtype):
        family = "ttt" if op in KERNEL_MODES else "fwp"
        return (f"{q.dtype} {op}: no Triton tiling compiles without register spills "
                f"(ops/{family}/triton.py tile_config)")
    return None


def _log_once(op: str, name: str, why: str) -> None:
    key = (op, name, why)
    if key not in _logged:
        _logged.add(key)
        _logger.info("fastweights.ops.%s: %s backend (%s)", op, name, why)


def _warn_autotuning(op: str) -> None:
    """Say once per op, at WARNING, that fla's first call autotunes (minutes, not a hang)."""
    key = (op, "fla", "autotuning")
    if key not in _logged:
        _logged.add(key)
        _logger.warning("fastweights.ops.%s: runs on flash-linear-attention's kernels, which "
                        "autotune on their first call for each shape (minutes on a GPU; later "
                        "calls are fast); FASTWEIGHTS_BACKEND=triton takes this project's "
                        "kernels, which compile in seconds", op)


def choose_backend(op: str, q: torch.Tensor, backend: str | None, mode: str,
                   chunk_size: int, trial: Trial | None = None) -> str:
    """The backend that runs ``op`` for q ([B, T, H, Dk]) under ``mode``/``chunk_size``; an
    automatic choice of a kernel backend first passes ``trial`` (see the module docstring)."""
    source = "backend"
    if backend is None and os.environ.get(ENV):
        backend, source = os.environ[ENV], ENV
    if backend is not None:
        if backend not in BACKENDS:
            raise ValueError(f"{source} must be one of {BACKENDS} or None, got {backend!r}")
        why = _why_not(backend, op, q, mode, chunk_size)
        if why is not None:
            raise ValueError(f"{source}={backend!r} cannot run {op}: {why}")
        return backend
    if mode != KERNEL_MODES.get(op, "chunk") or q.shape[1] == 1:
        return "torch"  # the oracle / recurrent forms, and one-token decoding steps
    reasons = []
    for name in ("fla", "triton"):
        why = _why_not(name, op, q, mode, chunk_size)
        if why is None:
            why = _trial_refusal(op, name, q, trial)
        if why is None:
            _log_once(op, name, "automatic choice")
            if name == "fla":
                _warn_autotuning(op)
            return name
        reasons.append(f"{name}: {why}")
    if _on_cuda(q):  # on CPU torch is the only candidate: nothing to report
        _log_once(op, "torch", "; ".join(reasons))
    return "torch"


def fla_varlen(cu_seqlens: torch.Tensor | None, bounds: list[int] | None) -> dict[str, Any]:
    """fla's variable-length arguments: cu_seqlens as int64 and its CPU copy (from the checked
    bounds, sparing fla a device synchronisation); nothing for an unpacked batch."""
    if bounds is None:
        return {}
    return {"cu_seqlens": cu_seqlens.to(torch.long),
            "cu_seqlens_cpu": torch.tensor(bounds, dtype=torch.long)}
