"""The mathematics: pure functions on ``[B, T, H, D]`` tensors, one sub-package per family."""

from .fwp import (
    delta_rule, dpfp, draw_favor_projection, elu_plus_one, favor_features, linear_attn, relu,
    sum_norm,
)
from .infini import infini_attention
from .softmax import softmax_attention
from .transnormer import block_attention, decay_linear_attn
from .ttt import ttt_linear, ttt_mlp

__all__ = [
    "linear_attn", "delta_rule", "elu_plus_one", "relu", "dpfp", "sum_norm", "favor_features",
    "draw_favor_projection", "softmax_attention",
    "infini_attention",
    "block_attention", "decay_linear_attn",
    "ttt_linear", "ttt_mlp",
]
