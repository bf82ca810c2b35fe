"""Gated linear unit feed-forward of TransNormer (docs/maths.md 3.4)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_bool, check_choice, check_positive_int, check_tensor

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "identity": lambda x: x}


class GLU(nn.Module):
    """(act(x W1 + b1) ⊙ (x W2 + b2)) W3 + b3, applied to the last dim: [..., d_model] -> [..., d_model].

    ``hidden`` defaults to int(8/3 * d_model). ``activation`` is ``"silu"`` (default, the
    intended "swish"), ``"gelu"`` or ``"identity"``: the published TransNormer checkpoints
    effectively trained an activation-free GLU, because fairseq-evo did not recognise "swish"
    and fell back to identity (docs/maths.md 3.4, 7.3). Biases on, as in the reference GLU.
    """

    def __init__(self, d_model: int, hidden: int | None = None, *, activation: str = "silu",
                 bias: bool = True) -> None:
        super().__init__()
        check_positive_int("d_model", d_model)
        hidden = int(8 / 3 * d_model) if hidden is None else check_positive_int("hidden", hidden)
        self.activation = check_choice("activation", activation, ACTIVATIONS)
        check_bool("bias", bias)
        self.d_model, self.hidden = d_model, hidden
        self.w1 = nn.Linear(d_model, hidden, bias=bias)
        self.w2 = nn.Linear(d_model, hidden, bias=bias)
        self.w3 = nn.Linear(hidden, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_tensor("x", x)
        if x.dim() < 1 or x.shape[-1] != self.d_model:
            raise ValueError(
                f"x must have shape [..., d_model] with d_model={self.d_model}, got {tuple(x.shape)}"
            )
        return self.w3(ACTIVATIONS[self.activation](self.w1(x)) * self.w2(x))

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, hidden={self.hidden}, activation={self.activation}"
