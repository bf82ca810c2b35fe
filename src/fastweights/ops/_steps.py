"""What the token-by-token (decoding) forms of every family share.

Dimension legend: B batch, T time, ``...`` the per-token dims.
"""

from __future__ import annotations

import torch


def stack_time(outs: list[torch.Tensor]) -> torch.Tensor:
    """Per-token outputs [B, ...] as [B, T, ...]: a view for a one-token step (a decoding step
    is a chain of tiny operations, and a stack would copy)."""
    return outs[0].unsqueeze(1) if len(outs) == 1 else torch.stack(outs, dim=1)
