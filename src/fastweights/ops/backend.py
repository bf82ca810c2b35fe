"""Which implementation runs a chunked fast-weight op, the flash-linear-attention adapter, and
the chunk sizes measured fastest per device kind. The one place that decides backends: the ops
(ops/fwp/linear_attention.py, ops/fwp/delta.py, ops/transnormer/decay.py) call
``choose_backend`` and run what it names.

``linear_attn``, ``delta_rule`` and ``decay_linear_attn`` take ``backend=``:
  "fla"     flash-linear-attention's maintained chunk kernels (``pip install
            flash-linear-attention``), CUDA only;
  "triton"  this project's kernels (ops/fwp/triton.py), CUDA only, linear_attn/delta_rule only;
  "torch"   the PyTorch forms of ``mode=`` (any device).
``backend=None`` (the default) means: the environment variable ``FASTWEIGHTS_BACKEND`` if set
(one of the three names), else the first of fla, triton, torch that can run the call. An
explicit choice (argument or environment) that cannot run the call is a ValueError saying why;
the automatic choice says once per (op, backend, reason), at logging level INFO, what it took.
``FASTWEIGHTS_TRITON=0`` (older switch) still keeps the automatic choice off Triton.

What each backend accepts: fla and triton run mode="chunk" only, on CUDA tensors of float16,
bfloat16 or float32, except the delta rule's float32 inputs, which neither takes (fla 0.6's
chunk_delta_rule refuses them; triton has no spill-free tiling for them: torch runs them).
fla's kernels use chunks of 64, so fla runs chunk_size=64 (the default) only; triton runs
chunk_size <= 64 and Dk <= 128 (the tilings ``tile_config`` gives, which
tests/ops/test_fwp_triton_compile.py compiles for sm_80 and sm_90 without register spills).
The automatic choice keeps a one-token call (decoding, T = 1) on torch's recurrent step. Packed
batches (cu_seqlens) go to fla whole, with fla's own cu_seqlens; triton and torch run them one
document at a time (ops/_varlen.py).

The fla adapter maps the two conventions exactly (checked against fla's own reference
functions in tests/ops/test_backend.py):
- scale: fla's default is 1/sqrt(Dk), ours 1.0: ours is always passed explicitly;
- normalisation: fla divides by (q . z + 1e-10) with z in the key dtype; we call fla
  unnormalised and divide by (scale q . z_t + eps) in float32 ourselves, with our eps and
  z_t = z0 + cumsum(k) (SPEC 1.3); the final (S, z) keep our layout [B, H, Dk, Dv], [B, H, Dk]
  (fla's z is [B, 1, H, Dk]);
- the delta rule: fla's ``use_qk_l2norm_in_kernel`` stays False: our callers normalise keys
  (sum_norm or L2) themselves and the op uses k as given; beta is passed in q's dtype (fla's
  kernels read beta like q), so a float32 beta driving bfloat16 q, k, v is rounded to bfloat16
  there, unlike the torch and triton backends;
- decay: decay_linear_attn's per-head lambda is simple GLA's log-decay g = log(lambda),
  broadcast over [B, T, H];
- states are float32 [B, H, Dk, Dv] on both sides; inputs are [B, T, H, D] on both sides
  (fla 0.6 has no head-first layout);
- packed batches: our cu_seqlens (any integer dtype) goes to fla as int64, with its CPU copy
  (``cu_seqlens_cpu``, spares fla a device synchronisation) where fla takes one; our
  per-document initial states (a list, None for zeros) are stacked into fla's [N, H, Dk, Dv]
  and its final states split back into one per document; the normaliser's running sum z_t
  restarts at each document from that document's z0.
"""

from __future__ import annotations

import itertools
import logging
import os
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

__all__ = ["BACKENDS", "PREFERRED_CHUNK_SIZES", "choose_backend", "fla_decay_linear_attn",
           "fla_delta_rule", "fla_linear_attn", "preferred_chunk_size", "triton_kernels"]

BACKENDS = ("fla", "triton", "torch")
ENV = "FASTWEIGHTS_BACKEND"
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FLA_CHUNK = 64
TRITON_MAX_DK = 128  # the key blocks the kernels hold (ops/fwp/triton.py MAX_DK)
TRITON_OPS = ("linear_attn", "delta_rule")

# Chunk sizes measured per device kind (forward and forward+backward, B1 H8 T4096 D64 float32;
# `python -m fastweights.bench.fwp_forms --backward --chunk-sizes 16,32,64,128 --modes chunk`,
# recorded in benchmarks/results/chunk_sizes/). Devices not measured here keep 64, the size
# flash-linear-attention's GPU kernels use (FLA_CHUNK).
PREFERRED_CHUNK_SIZES: dict[str, dict[str, int]] = {
    "cpu": {"linear_attn": 64, "delta_rule": 32},
}


def preferred_chunk_size(op: str, device: torch.device | str) -> int:
    """The measured fastest ``chunk_size`` of ``op`` (``"linear_attn"`` or ``"delta_rule"``) on
    this kind of device (see ``PREFERRED_CHUNK_SIZES``); 64 where nothing was measured. Layers
    built with ``chunk_size=None`` use it; the ops themselves keep DESIGN's default of 64."""
    if op not in ("linear_attn", "delta_rule"):
        raise ValueError(f"op must be 'linear_attn' or 'delta_rule', got {op!r}")
    return PREFERRED_CHUNK_SIZES.get(torch.device(device).type, {}).get(op, FLA_CHUNK)


_logger = logging.getLogger(__name__)
_logged: set[tuple[str, str, str]] = set()


def triton_kernels() -> ModuleType | None:
    """``ops/fwp/triton.py``, imported on first use; None where triton is not installed."""
    try:
        from .fwp import triton as kernels
    except ImportError:
        return None
    return kernels


def fla_ops() -> Any | None:
    """fla's chunk functions (linear_attn, delta_rule, simple_gla), or None where
    flash-linear-attention is not installed. Tests replace this with fla's reference forms."""
    try:
        from fla.ops.delta_rule import chunk_delta_rule
        from fla.ops.linear_attn import chunk_linear_attn
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError:
        return None
    return SimpleNamespace(linear_attn=chunk_linear_attn, delta_rule=chunk_delta_rule,
                           simple_gla=chunk_simple_gla)


def _on_cuda(q: torch.Tensor) -> bool:
    return q.is_cuda


def _why_not(name: str, op: str, q: torch.Tensor, mode: str, chunk_size: int) -> str | None:
    """Why ``name`` cannot run this call, or None if it can."""
    if name == "torch":
        return None
    if mode != "chunk":
        return f"mode={mode!r}: the {name} kernels are the chunked form (mode='chunk')"
    if not _on_cuda(q):
        return f"inputs on {q.device}, the {name} kernels need CUDA tensors"
    if q.dtype not in KERNEL_DTYPES:
        return f"dtype {q.dtype}: the {name} kernels take float16, bfloat16 or float32"
    if name == "fla":
        if chunk_size != FLA_CHUNK:
            return f"chunk_size={chunk_size}: fla's kernels use chunks of {FLA_CHUNK}"
        if op == "delta_rule" and q.dtype == torch.float32:
            return "float32 inputs: fla's chunk_delta_rule refuses them (fla 0.6)"
        if fla_ops() is None:
            return "flash-linear-attention is not installed (pip install flash-linear-attention)"
        return None
    if op not in TRITON_OPS:
        return f"no Triton kernel for {op}"
    if chunk_size > 64:
        return f"chunk_size={chunk_size}: the Triton kernels take chunk_size <= 64"
    if q.shape[-1] > TRITON_MAX_DK:
        return f"Dk={q.shape[-1]}: the Triton kernels take Dk <= {TRITON_MAX_DK}"
    if os.environ.get("FASTWEIGHTS_TRITON", "1") == "0":
        return "FASTWEIGHTS_TRITON=0"
    kernels = triton_kernels()
    if kernels is None:
        return "triton is not installed (pip install fastweights[triton])"
    if not kernels.supports(op, q.dtype):
        return (f"{q.dtype} {op}: no Triton tiling compiles without register spills "
                f"(ops/fwp/triton.py tile_config)")
    return None


def _log_once(op: str, name: str, why: str) -> None:
    key = (op, name, why)
    if key not in _logged:
        _logged.add(key)
        _logger.info("fastweights.ops.%s: %s backend (%s)", op, name, why)


def choose_backend(op: str, q: torch.Tensor, backend: str | None, mode: str,
                   chunk_size: int) -> str:
    """The backend that runs ``op`` for q ([B, T, H, Dk]) under ``mode``/``chunk_size``."""
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
    if mode != "chunk" or q.shape[1] == 1:
        return "torch"  # the oracle / recurrent forms, and one-token decoding steps
    reasons = []
    for name in ("fla", "triton"):
        why = _why_not(name, op, q, mode, chunk_size)
        if why is None:
            _log_once(op, name, "automatic choice")
            return name
        reasons.append(f"{name}: {why}")
    if _on_cuda(q):  # on CPU torch is the only candidate: nothing to report
        _log_once(op, "torch", "; ".join(reasons))
    return "torch"


# ---------------------------------------------------------------------------------------------
# The fla adapter. Arguments arrive checked by the public op; states are float32. With
# ``bounds`` (the document boundaries of a packed batch, B = 1) fla gets ``cu_seqlens`` itself
# and the states are stacked per document ([N, ...]).


def _running_z(k: torch.Tensor, z0: torch.Tensor, bounds: list[int] | None) -> torch.Tensor:
    """z_t = z0 + sum_{s <= t} k_s in float32: [B, T, H, Dk]. With ``bounds`` the sum restarts
    at each document from its own z0 (z0 [N, H, Dk]); the restart subtracts the running sum at
    the document's start, accumulated in float64 so that no cancellation reaches float32."""
    if bounds is None:
        return z0.unsqueeze(1) + k.to(torch.float32).cumsum(dim=1)
    ck = k.to(torch.float64).cumsum(dim=1)  # [1, T, H, Dk]
    lengths = torch.tensor([b - a for a, b in itertools.pairwise(bounds)], device=k.device)
    doc = torch.repeat_interleave(torch.arange(len(bounds) - 1, device=k.device), lengths)
    starts = torch.tensor(bounds[:-1], device=k.device)
    before = torch.cat([ck.new_zeros(ck[:, :1].shape), ck], dim=1)[:, starts]  # [1, N, H, Dk]
    return (ck - before[:, doc]).to(torch.float32) + z0[doc].unsqueeze(0)


def _last_of_each(x: torch.Tensor, bounds: list[int] | None) -> torch.Tensor:
    """x [B, T, ...] at each sequence's last step: [B, ...], or [N, ...] per packed document."""
    if bounds is None:
        return x[:, -1]
    return x[0, torch.tensor(bounds[1:], device=x.device) - 1]


def _packed(cu_seqlens: torch.Tensor | None, bounds: list[int] | None) -> dict[str, Any]:
    """fla's variable-length arguments: cu_seqlens as int64 and its CPU copy (from the checked
    bounds, sparing fla a device synchronisation); nothing for an unpacked batch."""
    if bounds is None:
        return {}
    return {"cu_seqlens": cu_seqlens.to(torch.long),
            "cu_seqlens_cpu": torch.tensor(bounds, dtype=torch.long)}


def fla_linear_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, normalize: bool, eps: float,
    scale: float, S0: torch.Tensor, z0: torch.Tensor, output_final_state: bool,
    cu_seqlens: torch.Tensor | None = None, bounds: list[int] | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """linear_attn through fla's ``chunk_linear_attn`` (see the module docstring).
    q, k [B, T, H, Dk], v [B, T, H, Dv]; S0 [B, H, Dk, Dv], z0 [B, H, Dk] float32; packed
    (``bounds`` given, B = 1): S0 [N, H, Dk, Dv], z0 [N, H, Dk], final states likewise."""
    varlen = _packed(cu_seqlens, bounds)
    varlen.pop("cu_seqlens_cpu", None)  # chunk_linear_attn takes none
    o, S = fla_ops().linear_attn(q, k, v, scale=scale, initial_state=S0,
                                 output_final_state=output_final_state, normalize=False,
                                 **varlen)
    z = None
    if normalize:
        zt = _running_z(k, z0, bounds)
        den = (q.to(torch.float32) * zt).sum(-1, keepdim=True) * scale + eps
        o = (o.to(torch.float32) / den).to(q.dtype)
        z = _last_of_each(zt, bounds)
    elif output_final_state:
        z = (z0 + k.to(torch.float32).sum(dim=1) if bounds is None
             else _last_of_each(_running_z(k, z0, bounds), bounds))
    return o, ((S.to(torch.float32), z) if output_final_state else None)


def fla_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, *, scale: float,
    S0: torch.Tensor, output_final_state: bool, cu_seqlens: torch.Tensor | None = None,
    bounds: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """delta_rule through fla's ``chunk_delta_rule`` with the keys as given (states as in
    ``fla_linear_attn``)."""
    o, S = fla_ops().delta_rule(q, k, v, beta.to(q.dtype), scale=scale, initial_state=S0,
                                output_final_state=output_final_state,
                                use_qk_l2norm_in_kernel=False, **_packed(cu_seqlens, bounds))
    return o, (S.to(torch.float32) if output_final_state else None)


def fla_decay_linear_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, *, scale: float,
    S0: torch.Tensor, output_final_state: bool, cu_seqlens: torch.Tensor | None = None,
    bounds: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """decay_linear_attn through fla's ``chunk_simple_gla``: g = log(lambda_h) per token (states
    as in ``fla_linear_attn``)."""
    B, T, H = q.shape[:3]
    g = torch.log(decay.to(torch.float32)).view(1, 1, H).expand(B, T, H).contiguous()
    o, S = fla_ops().simple_gla(q, k, v, g=g, scale=scale, initial_state=S0,
                                output_final_state=output_final_state,
                                **_packed(cu_seqlens, bounds))
    return o, (S.to(torch.float32) if output_final_state else None)
