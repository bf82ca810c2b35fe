"""The contract every sequence mixer honours (DESIGN.md, "Layers and models")."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._checks import check_positive_int

State = Any  # a tuple of tensors (and ints) owned by the layer; None means "start of sequence"


class Mixer(nn.Module):
    """Base class of every sequence-mixing layer.

    ``forward(x [B, T, d_model], state=None) -> (y [B, T, d_model], state)``: feeding a sequence
    in pieces with the state carried equals feeding it whole, and T = 1 is the decoding step.
    ``state_size(seq_len)`` counts the floats of recurrent state per sequence after ``seq_len``
    tokens (constant for recurrent mixers, growing with ``seq_len`` for softmax attention).
    """

    def __init__(self, d_model: int, n_heads: int, head_dim: int | None = None) -> None:
        super().__init__()
        check_positive_int("d_model", d_model)
        check_positive_int("n_heads", n_heads)
        if head_dim is None:
            if d_model % n_heads:
                raise ValueError(
                    f"d_model ({d_model}) must be divisible by n_heads ({n_heads}) "
                    "unless head_dim is given"
                )
            head_dim = d_model // n_heads
        check_positive_int("head_dim", head_dim)
        self.d_model = d_model
        self.n_heads = n_heads
        self.head_dim = head_dim

    def forward(self, x: torch.Tensor, state: State = None) -> tuple[torch.Tensor, State]:
        raise NotImplementedError

    def state_size(self, seq_len: int = 1) -> int:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n_heads={self.n_heads}, head_dim={self.head_dim}"


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[B, T, H*D] -> [B, T, H, D]."""
    return x.unflatten(-1, (n_heads, -1))


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, T, H, D] -> [B, T, H*D]."""
    return x.flatten(-2)
