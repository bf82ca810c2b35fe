"""linear_attn through flash-linear-attention's ``chunk_linear_attn`` (the ``"fla"`` backend,
ops/backend.py chooses it). Arguments arrive checked by the public op; states are float32.
With ``bounds`` (the document boundaries of a packed batch, B = 1) fla gets ``cu_seqlens``
itself and the states are stacked per document ([N, ...]). The conventions below, but for the
normalisation, are every fla adapter's (ops/*/fla.py).

The adapters map the two conventions exactly (checked against fla's own reference
functions in tests/ops/test_backend.py):
- scale: fla's default is 1/sqrt(Dk), ours 1.0: ours is always passed explicitly;
- normalisation: fla divides by (q . z + 1e-10) with z in the key dtype; we call fla
  unnormalised and divide by (scale q . z_t + eps) in float32 ourselves, with our eps and
  z_t = z0 + cumsum(k) (docs/maths.md 1.3); the final (S, z) keep our layout [B, H, Dk, Dv],
  [B, H, Dk] (fla's z is [B, 1, H, Dk]);
- states are float32 [B, H, Dk, Dv] on both sides; inputs are [B, T, H, D] on both sides
  (fla 0.6 has no head-first layout);
- packed batches: our cu_seqlens (any integer dtype) goes to fla as int64, with its CPU copy
  (``cu_seqlens_cpu``, spares fla a device synchronisation) where fla takes one; our
  per-document initial states (a list, None for zeros) are stacked into fla's [N, H, Dk, Dv]
  and its final states split back into one per document; the normaliser's running sum z_t
  restarts at each document from that document's z0.

Dimension legend: B batch, T tokens, H heads, Dk/Dv head dims, N packed documents.
"""

from __future__ import annotations

import itertools

import torch

from .. import backend

backend.register_fla("linear_attn", "fla.ops.linear_attn", "chunk_linear_attn")


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


def fla_linear_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, normalize: bool, eps: float,
    scale: float, S0: torch.Tensor, z0: torch.Tensor, output_final_state: bool,
    cu_seqlens: torch.Tensor | None = None, bounds: list[int] | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """linear_attn through fla's ``chunk_linear_attn`` (see the module docstring).
    q, k [B, T, H, Dk], v [B, T, H, Dv]; S0 [B, H, Dk, Dv], z0 [B, H, Dk] float32; packed
    (``bounds`` given, B = 1): S0 [N, H, Dk, Dv], z0 [N, H, Dk], final states likewise."""
    varlen = backend.fla_varlen(cu_seqlens, bounds)
    varlen.pop("cu_seqlens_cpu", None)  # chunk_linear_attn takes none
    o, S = backend.fla_ops().linear_attn(q, k, v, scale=scale, initial_state=S0,
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
