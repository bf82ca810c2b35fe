"""The building block of fla's models that no fastweights layer shares: ``SwiGLU`` (fla's
GatedMLP). fla's RMSNorm, gated or not, is ``fastweights.layers.RMSNorm``; its short
convolution and head split (``ShortConvolution``, ``FlaMixer``) are in
``fastweights.layers.fla_deltanet``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """fla's GatedMLP with hidden_act 'swish': down_proj(silu(gate_proj(x)) * up_proj(x)),
    bias-free. [..., d] -> [..., d]."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
