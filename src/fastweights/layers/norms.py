"""The norms: ``RMSNorm`` (with a gain, optionally gated: the language model's, the output norms
of the gated-delta and fla layers, fla's models) and TransNormer's gain-free ``SRMSNorm``
(docs/maths.md 3.1). [..., d] -> [..., d]."""

from __future__ import annotations

import torch
from torch import nn

from .._checks import (
    check_bool,
    check_choice,
    check_nonneg_float,
    check_positive_int,
    check_tensor,
    is_number,
)
from ..ops.fused import GATE_ACTIVATIONS, rms_norm_gated
from ..ops.transnormer import srms_norm


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, ``y = x / sqrt(mean(x^2) + eps) * weight``, times
    ``act(gate)`` when a gate is given (norm before gate, as fla's FusedRMSNormGated and
    transformers' Qwen3.5 RMSNormGated), ``act`` SiLU (``gate_activation`` "swish" or "silu")
    or sigmoid. Computed in float32 (float64 stays float64: bfloat16 loses the small-variance
    rows) and rounded to x's dtype once at the end, as fla's fused kernels round.

    The parameter is ``weight [dim]``, the name the checkpoints of fastweights, fla and
    transformers use; ``elementwise_affine=False`` leaves it out (a gain of 1).
    ``forward(x [..., dim], gate None or [..., dim]) -> [..., dim]`` in x's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6, *, elementwise_affine: bool = True,
                 gate_activation: str = "swish") -> None:
        super().__init__()
        check_positive_int("dim", dim)
        if not is_number(eps) or not 0 < eps < 1:
            raise ValueError(f"eps must be a float in (0, 1), got {eps!r}")
        self.dim, self.eps = dim, float(eps)
        self.gate_activation = check_choice("gate_activation", gate_activation, GATE_ACTIVATIONS)
        if check_bool("elementwise_affine", elementwise_affine):
            self.weight = nn.Parameter(torch.ones(dim))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        # the PyTorch form (the gated-delta layer calls the op itself, kernels included)
        return rms_norm_gated(x, self.weight, gate, eps=self.eps,
                              activation=self.gate_activation, backend="torch")

    def extra_repr(self) -> str:
        return (f"{self.dim}, eps={self.eps}"
                + ("" if self.weight is not None else ", elementwise_affine=False")
                + ("" if self.gate_activation == "swish" else
                   f", gate_activation={self.gate_activation}"))


class SRMSNorm(nn.Module):
    """x / (||x||_2 / sqrt(d) + eps) over the last dim, no learnable gain (docs/maths.md 3.1).

    ``dim`` (optional) is checked against x's last dim. [..., d] -> [..., d].
    """

    def __init__(self, dim: int | None = None, eps: float = 1e-8) -> None:
        super().__init__()
        self.dim = None if dim is None else check_positive_int("dim", dim)
        self.eps = check_nonneg_float("eps", eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_tensor("x", x)
        if self.dim is not None and (x.dim() < 1 or x.shape[-1] != self.dim):
            raise ValueError(f"x must have shape [..., {self.dim}], got {tuple(x.shape)}")
        return srms_norm(x, self.eps)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, eps={self.eps}"
