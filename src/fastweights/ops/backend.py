"""Which implementation runs an op that has GPU kernels: the backend registry and the one place
that decides. An op with kernels registers them when its module is imported (``register``:
for each backend, a ``Kernel`` saying which of the op's modes it computes and which inputs it
takes, and the chunk sizes measured fastest per device kind); the op calls ``choose_backend``
and runs what it names. Nothing here names an op. The fla adapters sit beside the ops they
adapt and reach fla's functions through ``fla_ops``, which holds the functions the adapters
registered (``register_fla``); which op has which backend, and why, is in docs/gpu.md.

Backends, for ``backend=``:
  "fla"     flash-linear-attention's maintained chunk kernels (``pip install
            flash-linear-attention``), CUDA only, chunks of 64 (``FLA_CHUNK``);
  "triton"  this project's kernels (each op's ``triton.py``), CUDA only,
            ``chunk_size`` <= 64 and Dk <= ``TRITON_MAX_DK``, the dtypes its module's
            ``supports(op, dtype)`` has a spill-free tiling for;
  "torch"   the PyTorch forms of ``mode=`` (any device).
``backend=None`` (the default) means: the environment variable ``FASTWEIGHTS_BACKEND`` if set
(one of the three names), else the first of fla, triton, torch that can run the call, the two
kernel backends ranked by the op's measured times on this kind of GPU where both were measured
(``ranked``; the table is the op's ``speeds.py``, docs/gpu.md "Which backend runs what"). An
explicit choice (argument or environment) that cannot run the call is a ValueError saying why;
the automatic choice says once per (op, backend, reason), at logging level INFO, what it took.
``FASTWEIGHTS_TRITON=0`` (older switch) keeps the automatic choice off Triton.

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
The automatic choice keeps a one-token call (decoding, T = 1) on torch's step, unless the op
is a one-token step with a kernel of its own (``Kernel.one_token``: the TTT layers' decoding
step). Packed batches (cu_seqlens) go to fla whole, with fla's own cu_seqlens; triton and
torch run them one document at a time (ops/_varlen.py).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from .._checks import Documents

__all__ = ["BACKENDS", "ENV", "FLA_CHUNK", "PROBE_TOKENS", "TRITON_MAX_DK", "Kernel", "Trial",
           "choose_backend", "device_kind", "fla_ops", "fla_varlen", "kernel_ops",
           "optional_module", "preferred_chunk_size", "ranked", "register", "register_fla"]

BACKENDS = ("fla", "triton", "torch")
ENV = "FASTWEIGHTS_BACKEND"
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FLA_CHUNK = 64  # fla's kernels use chunks of 64; the ops' default chunk_size
TRITON_MAX_CHUNK = 64
TRITON_MAX_DK = 128  # the key blocks the kernels hold


@dataclass(frozen=True)
class Kernel:
    """A kernel backend of one op, as the op registers it: the ``mode`` of the op it computes
    (its ``chunk_size`` called ``chunk_name`` there), the input ``dtypes`` it takes (``refused``
    says why not the others), and for Triton the module of the kernels (``kernels``, loaded on
    first use, None where triton is missing; its ``supports(op, dtype)`` says which dtypes
    have a tiling that compiles without register spills). ``one_token``: a kernel of the
    op's one-token step (decoding), which runs its one-token calls (an op registers it beside
    its multi-token kernel: ``triton=(Kernel(...), Kernel(one_token=True, ...))``); the
    automatic choice keeps the one-token calls of ops without one on torch. ``refuse``: what
    else of a call the kernel cannot take, ``refuse(q, facts) -> reason or None`` with the
    ``facts`` the op passes to ``choose_backend`` (head sizes, a state's form, gradients):
    checked last, after everything above."""

    mode: str = "chunk"
    chunk_name: str = "chunk_size"
    dtypes: tuple[torch.dtype, ...] = KERNEL_DTYPES
    refused: str = ""
    kernels: Callable[[], ModuleType | None] | None = None
    one_token: bool = False
    refuse: Callable[[torch.Tensor, Mapping[str, Any]], str | None] | None = None


@dataclass(frozen=True)
class _Registered:
    kernels: dict[str, tuple[Kernel, ...]]
    chunk_sizes: Mapping[str, int]
    speeds: Mapping[str, Mapping[str, Any]]
    auxiliary: bool = False

    def kernel(self, name: str, T: int) -> Kernel | None:
        """The ``name`` kernel for a call of T tokens: the one-token kernel where T = 1 and
        there is one, else the other."""
        found = self.kernels.get(name, ())
        if T == 1:  # (a branch, not a comparison of bools: T may be symbolic while tracing)
            for k in found:
                if k.one_token:
                    return k
        return next((k for k in found if not k.one_token), None)


_REGISTRY: dict[str, _Registered] = {}
_FLA: dict[str, tuple[str, str]] = {}  # adapter name -> (fla module, function)


def register(op: str, *, fla: Kernel | None = None,
             triton: Kernel | tuple[Kernel, ...] | None = None,
             chunk_sizes: Mapping[str, int] | None = None,
             speeds: Mapping[str, Mapping[str, Any]] | None = None,
             auxiliary: bool = False) -> None:
    """Register ``op``'s kernel backends (a kernel, or a multi-token kernel and a one-token
    one), its measured fastest chunk sizes per device kind (``preferred_chunk_size``) and its
    measured times per GPU kind (``speeds``: the op's speeds.py ``SPEEDS``, {kind: {"forward" |
    "train": {backend: ms}, ...}}, ``ranked``). ``auxiliary``: an op a layer runs around its
    recurrent op (the fused short convolution and output norm, ops/fused), which has no fla
    kernel: ``FASTWEIGHTS_BACKEND=fla`` leaves it to the automatic choice (fla's layers fuse
    the same work in kernels of their own). Called once, when the op's module is imported."""
    if op in _REGISTRY:
        raise ValueError(f"op {op!r} registered twice")
    found = {name: k if isinstance(k, tuple) else (k,)
             for name, k in (("fla", fla), ("triton", triton)) if k is not None}
    _REGISTRY[op] = _Registered(found, dict(chunk_sizes or {}), dict(speeds or {}), auxiliary)


def register_fla(name: str, module: str, function: str) -> None:
    """Make fla's ``module.function`` reachable as ``fla_ops().name`` (an fla adapter's)."""
    _FLA[name] = (module, function)


def kernel_ops(backend: str) -> list[str]:
    """The registered ops that have a ``backend`` kernel."""
    return [op for op, r in _REGISTRY.items() if backend in r.kernels]


def optional_module(load: Callable[[], ModuleType]) -> Callable[[], ModuleType | None]:
    """``load`` (which imports a module of kernels, an op's ``triton.py``: ``from . import
    triton``, an import statement torch.compile traces) as a function returning the module, or
    None where the import fails (triton not installed)."""
    def module() -> ModuleType | None:
        try:
            return load()
        except ImportError:
            return None

    return module


def preferred_chunk_size(op: str, device: torch.device | str) -> int:
    """The measured fastest ``chunk_size`` of ``op`` on this kind of device (what the op
    registered, from the records in benchmarks/results/chunk_sizes/ and
    gated_delta_epyc_avx2/); ``FLA_CHUNK`` where nothing was measured. Layers built with
    ``chunk_size=None`` use it; the ops themselves keep the default of 64 (docs/design.md,
    "Modes")."""
    if op not in _REGISTRY:
        raise ValueError(f"op must be one of {', '.join(map(repr, _REGISTRY))}, got {op!r}")
    return _REGISTRY[op].chunk_sizes.get(torch.device(device).type, FLA_CHUNK)


def device_kind(device: torch.device | str) -> str:
    """The key of a device in the ops' tables: "sm_90" for a CUDA GPU of compute capability
    9.0 (H100, H200), the device type otherwise ("cpu"; "cuda" where CUDA is not available to
    ask)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def ranked(op: str, device: torch.device | str, train: bool) -> list[str]:
    """The kernel backends in the order the automatic choice tries them on ``device``: fla, then
    triton, except that those both measured on this kind of device (``register``'s ``speeds``,
    the forward's time, or with ``train`` the forward+backward's) go fastest first. A backend
    without a figure keeps its place: the figures rank only what they compare."""
    order = list(BACKENDS[:-1])
    table = _REGISTRY[op].speeds.get(device_kind(device), {}) if op in _REGISTRY else {}
    times = table.get("train" if train else "forward", {})
    measured = iter(sorted((n for n in order if n in times), key=lambda n: times[n]))
    return [next(measured) if n in times else n for n in order]


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


def _trial_refusal(op: str, name: str, q: torch.Tensor,
                   trial: Trial | Callable[[], Trial] | None) -> str | None:
    """Why ``name`` failed its trial for this (op, dtype, device kind, gradients), or None
    (it passed, now or earlier; or there is nothing to try)."""
    if trial is None or torch.compiler.is_compiling():
        return None
    if not isinstance(trial, Trial):
        trial = trial()
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


def fla_ops() -> Any | None:
    """fla's functions the adapters registered (``register_fla``), by their names, or None
    where flash-linear-attention is not installed. Tests replace this with fla's reference
    forms."""
    try:
        return SimpleNamespace(**{name: getattr(importlib.import_module(module), function)
                                  for name, (module, function) in _FLA.items()})
    except ImportError:
        return None


def _on_cuda(q: torch.Tensor) -> bool:
    return q.is_cuda


def _why_not(name: str, op: str, q: torch.Tensor, mode: str, chunk_size: int,
             facts: Mapping[str, Any] | None = None) -> str | None:
    """Why ``name`` cannot run this call, or None if it can."""
    if name == "torch":
        return None
    kernel = _REGISTRY[op].kernel(name, q.shape[1]) if op in _REGISTRY else None
    if kernel is None:
        return f"no {'Triton' if name == 'triton' else name} kernel for {op}"
    if mode != kernel.mode:
        return f"mode={mode!r}: the {name} kernels are the {kernel.mode} form (mode={kernel.mode!r})"
    if not _on_cuda(q):
        return f"inputs on {q.device}, the {name} kernels need CUDA tensors"
    if q.dtype not in KERNEL_DTYPES:
        return f"dtype {q.dtype}: the {name} kernels take float16, bfloat16 or float32"
    if q.dtype not in kernel.dtypes:
        return f"{str(q.dtype).removeprefix('torch.')} inputs: {kernel.refused}"
    size = kernel.chunk_name
    if name == "fla":
        if chunk_size != FLA_CHUNK:
            return f"{size}={chunk_size}: fla's kernels use chunks of {FLA_CHUNK}"
        if fla_ops() is None:
            return "flash-linear-attention is not installed (pip install flash-linear-attention)"
        return None
    if chunk_size > TRITON_MAX_CHUNK:
        return f"{size}={chunk_size}: the Triton kernels take {size} <= {TRITON_MAX_CHUNK}"
    if q.shape[-1] > TRITON_MAX_DK:
        return f"Dk={q.shape[-1]}: the Triton kernels take Dk <= {TRITON_MAX_DK}"
    if os.environ.get("FASTWEIGHTS_TRITON", "1") == "0":
        return "FASTWEIGHTS_TRITON=0"
    kernels = kernel.kernels() if kernel.kernels is not None else None
    if kernels is None:
        return "triton is not installed (pip install fastweights[triton])"
    if not kernels.supports(op, q.dtype):
        return (f"{q.dtype} {op}: no Triton tiling compiles without register spills "
                f"({kernels.__name__} tile_config)")
    return None if kernel.refuse is None else kernel.refuse(q, facts or {})


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
                   chunk_size: int, trial: Trial | Callable[[], Trial] | None = None,
                   facts: Mapping[str, Any] | None = None) -> str:
    """The backend that runs ``op`` for q ([B, T, H, Dk]) under ``mode``/``chunk_size``; an
    automatic choice of a kernel backend first passes ``trial`` (see the module docstring; a
    function making it is called only where a trial runs). ``facts``: what else of the call a
    kernel's ``refuse`` reads."""
    source = "backend"
    if backend is None and os.environ.get(ENV) and not (
            os.environ[ENV] == "fla" and op in _REGISTRY and _REGISTRY[op].auxiliary):
        backend, source = os.environ[ENV], ENV
    if backend is not None:
        if backend not in BACKENDS:
            raise ValueError(f"{source} must be one of {BACKENDS} or None, got {backend!r}")
        why = _why_not(backend, op, q, mode, chunk_size, facts)
        if why is not None:
            raise ValueError(f"{source}={backend!r} cannot run {op}: {why}")
        return backend
    kernels = [k for ks in _REGISTRY[op].kernels.values() for k in ks] if op in _REGISTRY else ()
    if all(mode != k.mode for k in kernels) or (
            q.shape[1] == 1 and not any(k.one_token for k in kernels)):
        return "torch"  # the oracle / recurrent forms, and one-token steps without a kernel
    reasons = []
    train = (trial.grad if isinstance(trial, Trial)
             else torch.is_grad_enabled() and getattr(q, "requires_grad", False))
    for name in ranked(op, q.device, train) if _on_cuda(q) else BACKENDS[:-1]:
        why = _why_not(name, op, q, mode, chunk_size, facts)
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


def fla_varlen(cu_seqlens: torch.Tensor | Documents | None,
               bounds: Sequence[int] | None) -> dict[str, Any]:
    """fla's variable-length arguments: cu_seqlens as int64 and its CPU copy (from the checked
    bounds, sparing fla a device synchronisation); nothing for an unpacked batch."""
    if bounds is None:
        return {}
    if isinstance(cu_seqlens, Documents):
        cu_seqlens = cu_seqlens.cu_seqlens
    return {"cu_seqlens": cu_seqlens.to(torch.long),
            "cu_seqlens_cpu": torch.tensor(bounds, dtype=torch.long)}
