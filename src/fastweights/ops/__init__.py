"""The mathematics: pure functions on ``[B, T, H, D]`` tensors, one folder per op or family of ops
that share their forms (docs/design.md, "Floors"), the feature maps, and one public one-token
step per stateful op (``<op>_step``: the op's own state in and out, shapes checked, nothing read
back to the host; docs/design.md, "Steps"). Layers use these names and nothing below them."""

from ._modes import RECURRENT_MODES, TTT_MODES, reading_nothing, reads_allowed
from .aft import (
    AFTConvState,
    AFTFullCache,
    AFTFullState,
    AFTLocalState,
    AFTSimpleState,
    aft,
    aft_conv,
    aft_conv_step,
    aft_local,
    aft_local_step,
    aft_step,
    merge_simple_states,
)
from .delta_rule import delta_rule, delta_rule_attn_norm, delta_rule_step
from .examples import EXAMPLE_OPS, Example, example_inputs
from .feature_maps import dpfp, draw_favor_projection, elu_plus_one, favor_features, relu, sum_norm
from .fused import fused_kernels_run, l2_normalize, rms_norm_gated, short_conv_silu
from .gated_delta_rule import gated_delta_rule, gated_delta_rule_step
from .infini import (
    InfiniRowsState,
    InfiniSegmentState,
    InfiniState,
    infini_attention,
    infini_attention_step,
)
from .linear_attn import LinearAttnState, linear_attn, linear_attn_step
from .softmax import KVCache, softmax_attention, softmax_attention_step
from .transnormer import (
    block_attention,
    decay_linear_attn,
    decay_linear_attn_step,
    open_block_attention,
    srms_norm,
)
from .ttt import TTTState, ttt_linear, ttt_linear_step, ttt_mlp, ttt_mlp_step

__all__ = [
    "EXAMPLE_OPS",
    "RECURRENT_MODES",
    "TTT_MODES",
    "AFTConvState",
    "AFTFullCache",
    "AFTFullState",
    "AFTLocalState",
    "AFTSimpleState",
    "Example",
    "InfiniRowsState",
    "InfiniSegmentState",
    "InfiniState",
    "KVCache",
    "LinearAttnState",
    "TTTState",
    "aft",
    "aft_conv",
    "aft_conv_step",
    "aft_local",
    "aft_local_step",
    "aft_step",
    "block_attention",
    "decay_linear_attn",
    "decay_linear_attn_step",
    "delta_rule",
    "delta_rule_attn_norm",
    "delta_rule_step",
    "dpfp",
    "draw_favor_projection",
    "elu_plus_one",
    "example_inputs",
    "favor_features",
    "fused_kernels_run",
    "gated_delta_rule",
    "gated_delta_rule_step",
    "infini_attention",
    "infini_attention_step",
    "l2_normalize",
    "linear_attn",
    "linear_attn_step",
    "merge_simple_states",
    "open_block_attention",
    "reading_nothing",
    "reads_allowed",
    "relu",
    "rms_norm_gated",
    "short_conv_silu",
    "softmax_attention",
    "softmax_attention_step",
    "srms_norm",
    "sum_norm",
    "ttt_linear",
    "ttt_linear_step",
    "ttt_mlp",
    "ttt_mlp_step",
]
