"""The contract every sequence mixer honours (DESIGN.md, "Layers and models")."""

from __future__ import annotations

import functools
import itertools
from typing import Any

import torch
from torch import nn

from .._checks import check_layer_input, check_positive_int
from ..ops._varlen import check_cu_seqlens, check_packed_states

State = Any  # a tuple of tensors (and ints) owned by the layer; None means "start of sequence"


class Mixer(nn.Module):
    """Base class of every sequence-mixing layer.

    ``forward(x [B, T, d_model], state=None) -> (y [B, T, d_model], state)``: feeding a sequence
    in pieces with the state carried equals feeding it whole, and T = 1 is the decoding step.
    ``state_size(seq_len)`` counts the floats of recurrent state per sequence after ``seq_len``
    tokens (constant for recurrent mixers, growing with ``seq_len`` for softmax attention).

    Every subclass's ``forward`` also accepts ``cu_seqlens`` ([N + 1] boundaries of documents
    packed in a batch of one): the state is reset at each boundary, the result equals running
    the documents one by one, and ``state`` in and out is a list with one state per document.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        forward = cls.__dict__.get("forward")
        if forward is None or getattr(forward, "_accepts_cu_seqlens", False):
            return

        @functools.wraps(forward)
        def forward_with_packing(self: Mixer, x: torch.Tensor, state: State = None,
                                 cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, State]:
            if cu_seqlens is None:
                return forward(self, x, state)
            return self._forward_packed(forward, x, state, cu_seqlens)

        forward_with_packing._accepts_cu_seqlens = True  # type: ignore[attr-defined]
        cls.forward = forward_with_packing  # type: ignore[method-assign]

    def _forward_packed(self, forward: Any, x: torch.Tensor, state: State,
                        cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, list[State]]:
        """Run ``forward`` once per packed document; states are per-document lists."""
        check_layer_input(x, self.d_model)
        bounds = check_cu_seqlens(cu_seqlens, x.shape[1], x.shape[0], x.device)
        states = check_packed_states(state, len(bounds) - 1)
        outs, finals = [], []
        for (start, stop), s in zip(itertools.pairwise(bounds), states):
            y, s = forward(self, x[:, start:stop], s)
            outs.append(y)
            finals.append(s)
        return torch.cat(outs, dim=1), finals

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
