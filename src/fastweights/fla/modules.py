"""The building blocks fla's layers and models share, as fla computes them (fla's
``fla/modules``): ``ShortConvolution`` (causal depthwise, its last inputs carried in the state),
``SwiGLU`` (fla's GatedMLP) and ``FlaMixer``, the head split of fla's layers (``expand_k`` /
``expand_v``). fla's RMSNorm, gated or not, is ``fastweights.layers.RMSNorm``.

Dimension legend: B batch, T tokens, C channels, W the short-convolution width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_bool, check_positive_int, is_number
from ..layers.base import Mixer
from ..ops._conv import causal_depthwise_conv


class ShortConvolution(nn.Module):
    """Causal depthwise convolution of width ``kernel_size`` over time, optionally followed by
    SiLU: ``y_t = act(sum_j weight[:, 0, j] * x_{t - W + 1 + j} + bias)``, inputs before the first
    token being the carried state (zeros at the start of a sequence).

    ``forward(x [B, T, C], state=None [B, C, W - 1]) -> (y [B, T, C], state [B, C, W - 1])``;
    the state is the last W - 1 inputs, so feeding a sequence in pieces equals feeding it whole.
    Parameters ``weight [C, 1, W]`` and ``bias [C]`` (optional), fla's layout (nn.Conv1d's).
    """

    def __init__(self, channels: int, kernel_size: int, *, bias: bool = False,
                 activation: bool = True) -> None:
        super().__init__()
        self.channels = check_positive_int("channels", channels)
        self.kernel_size = check_positive_int("kernel_size", kernel_size)
        self.activation = check_bool("activation", activation)
        check_bool("bias", bias)
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        self.bias = nn.Parameter(torch.zeros(channels)) if bias else None
        # nn.Conv1d's default initialisation (fresh layers only; checkpoints overwrite it)
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        B, _, C = x.shape
        W = self.kernel_size
        xt = x.transpose(1, 2)  # [B, C, T]
        if state is None:
            past = xt.new_zeros(B, C, W - 1)
        else:
            if not isinstance(state, torch.Tensor) or state.shape != (B, C, W - 1):
                raise ValueError(
                    f"short-convolution state must be a tensor [B, C, W - 1] = [{B}, {C}, {W - 1}], "
                    f"got {tuple(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__}")
            past = state.to(xt.dtype)
        full = torch.cat([past, xt], dim=2)  # [B, C, W - 1 + T]
        y = causal_depthwise_conv(full, self.weight, self.bias)  # [B, C, T]
        if self.activation:
            y = F.silu(y)
        return y.transpose(1, 2), full[:, :, full.shape[2] - (W - 1):]

    def extra_repr(self) -> str:
        return (f"{self.channels}, kernel_size={self.kernel_size}, bias={self.bias is not None}, "
                f"activation={'silu' if self.activation else None}")


class FlaMixer(Mixer):
    """What fla's layers share here: ``key_dim = round(d_model * expand_k)`` and
    ``value_dim = round(d_model * expand_v)``, each an integer divisible by n_heads (fla's
    rule), split into ``head_k_dim`` / ``head_v_dim`` per head."""

    def __init__(self, d_model: int, n_heads: int, expand_k: float, expand_v: float) -> None:
        check_positive_int("d_model", d_model)
        check_positive_int("n_heads", n_heads)
        key_dim = _expanded("expand_k", d_model, expand_k, n_heads)
        value_dim = _expanded("expand_v", d_model, expand_v, n_heads)
        super().__init__(d_model, n_heads, head_dim=key_dim // n_heads)
        self.key_dim, self.value_dim = key_dim, value_dim
        self.head_k_dim, self.head_v_dim = key_dim // n_heads, value_dim // n_heads


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


def _expanded(name: str, d_model: int, ratio: float, n_heads: int) -> int:
    """round(d_model * ratio), checked to be an integer divisible by n_heads (fla's rule)."""
    if not is_number(ratio) or not ratio > 0 or not math.isfinite(ratio):
        raise ValueError(f"{name} must be a positive number, got {ratio!r}")
    size = round(d_model * ratio)
    if not math.isclose(d_model * ratio, size) or size < 1:
        raise ValueError(f"hidden size * {name} must be a positive integer, got "
                         f"{d_model} * {ratio} = {d_model * ratio}")
    if size % n_heads:
        raise ValueError(f"hidden size * {name} = {size} must be divisible by num_heads {n_heads}")
    return size
