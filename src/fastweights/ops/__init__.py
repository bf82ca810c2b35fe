"""The mathematics: pure functions on ``[B, T, H, D]`` tensors, one sub-package per family."""

from .aft import aft, aft_conv, aft_local
from .fwp import (
    delta_rule,
    delta_rule_attn_norm,
    dpfp,
    draw_favor_projection,
    elu_plus_one,
    favor_features,
    gated_delta_rule,
    linear_attn,
    relu,
    sum_norm,
)
from .infini import InfiniState, infini_attention
from .softmax import softmax_attention
from .transnormer import block_attention, decay_linear_attn
from .ttt import ttt_linear, ttt_mlp

__all__ = [
    "InfiniState",
    "aft",
    "aft_conv",
    "aft_local",
    "block_attention",
    "decay_linear_attn",
    "delta_rule",
    "delta_rule_attn_norm",
    "dpfp",
    "draw_favor_projection",
    "elu_plus_one",
    "favor_features",
    "gated_delta_rule",
    "infini_attention",
    "linear_attn",
    "relu",
    "softmax_attention",
    "sum_norm",
    "ttt_linear",
    "ttt_mlp",
]
