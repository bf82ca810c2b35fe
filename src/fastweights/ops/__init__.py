"""The mathematics: pure functions on ``[B, T, H, D]`` tensors, one folder per op or family of ops
that share their forms (docs/design.md, "Floors"), and the feature maps."""

from .aft import aft, aft_conv, aft_local
from .delta_rule import delta_rule, delta_rule_attn_norm
from .feature_maps import dpfp, draw_favor_projection, elu_plus_one, favor_features, relu, sum_norm
from .gated_delta_rule import gated_delta_rule
from .infini import InfiniState, infini_attention
from .linear_attn import linear_attn
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
