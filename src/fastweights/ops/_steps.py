"""What the token-by-token (decoding) forms of every family share.

Dimension legend: B batch, T time, ``...`` the per-token dims.
"""

from __future__ import annotations

import torch

from .._checks import check_qkv


def stack_time(outs: list[torch.Tensor]) -> torch.Tensor:
    """Per-token outputs [B, ...] as [B, T, ...]: a view for a one-token step (a decoding step
    is a chain of tiny operations, and a stack would copy)."""
    return outs[0].unsqueeze(1) if len(outs) == 1 else torch.stack(outs, dim=1)


def outer_add(S: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """S + k^T v per batch row and head: S [B, H, Dk, Dv], k [B, H, Dk], v [B, H, Dv] ->
    [B, H, Dk, Dv], a new tensor (S is left as it was: a carried state stays valid)."""
    # One fused pass over S (read S, write the sum): a decoding step is a handful of tiny
    # operations, and the broadcast product's own [B, H, Dk, Dv] tensor would be one more.
    return torch.addcmul(S, k.unsqueeze(-1), v.unsqueeze(-2))


def read(q: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """q S per batch row and head: q [B, H, Dk], S [B, H, Dk, Dv] -> [B, H, Dv]."""
    B, H, Dk, Dv = S.shape
    return torch.bmm(q.reshape(B * H, 1, Dk), S.reshape(B * H, Dk, Dv)).view(B, H, Dv)


def check_step_qkv(q: object, k: object, v: object) -> tuple[int, int, int, int]:
    """q, k ``[B, 1, H, Dk]`` and v ``[B, 1, H, Dv]`` of a one-token step: ``check_qkv`` with
    T = 1. Returns (B, H, Dk, Dv)."""
    B, T, H, Dk, Dv = check_qkv(q, k, v)
    if T != 1:
        raise ValueError(f"a step takes one token: q must have shape [B, 1, H, Dk], got "
                         f"{tuple(q.shape)} (the op itself takes T tokens)")
    return B, H, Dk, Dv


def wide(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in the compute ``dtype`` (no cast where it has it: a step is a chain of tiny
    operations, each of which counts)."""
    return x if x.dtype == dtype else x.to(dtype)
