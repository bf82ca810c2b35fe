"""A pre-norm residual block: ``x + mixer(norm(x))`` then ``x + ffn(norm(x))``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import GLU
from ..layers.base import State
from ..layers.norms import RMSNorm, SRMSNorm
from .config import LMConfig
from .registry import build_mixer

# How a block calls its mixer: (mixer, x [B, T, d_model], state, cu_seqlens) -> (y, state).
MixerRunner = Callable[[nn.Module, torch.Tensor, State, "torch.Tensor | None"], tuple[torch.Tensor, State]]


class MLP(nn.Module):
    """Linear(d, h) -> GELU -> Linear(h, d)."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, hidden)
        self.down = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def make_norm(config: LMConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model, config.norm_eps)
    if config.norm == "srmsnorm":
        return SRMSNorm(config.d_model, config.norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.norm_eps)


class Block(nn.Module):
    """One layer of the language model: the mixer ``mixer_name`` with ``options`` and the
    configured feed-forward, each behind a pre-norm and a residual connection.
    ``forward(x [B, T, d_model], state) -> (x [B, T, d_model], state)``.

    ``mixer_runner`` (None: call the mixer directly) is how the block calls its mixer, the one
    place where the sequence dimension matters (the norms and the feed-forward are per token):
    context-parallel training installs one that runs the mixer on this process's shard
    (``LanguageModel.set_mixer_runner``)."""

    mixer_runner: MixerRunner | None = None

    def __init__(self, config: LMConfig, mixer_name: str, options: dict[str, Any]) -> None:
        super().__init__()
        self.norm1 = make_norm(config)
        self.mixer = build_mixer(mixer_name, config.d_model, config.n_heads, **options)
        self.drop = nn.Dropout(config.dropout)
        hidden = config.ffn_hidden_size()
        self.norm2 = make_norm(config) if config.ffn != "none" else None
        self.ffn: nn.Module | None = {
            "mlp": lambda: MLP(config.d_model, hidden),
            "glu": lambda: GLU(config.d_model, hidden, activation=config.glu_activation),
            "none": lambda: None,
        }[config.ffn]()

    def forward(self, x: torch.Tensor, state: State = None,
                cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, State]:
        h = self.norm1(x)
        if self.mixer_runner is None:
            y, state = self.mixer(h, state, cu_seqlens=cu_seqlens)
        else:
            y, state = self.mixer_runner(self.mixer, h, state, cu_seqlens)
        x = x + self.drop(y)
        if self.ffn is not None:
            x = x + self.drop(self.ffn(self.norm2(x)))
        return x, state
