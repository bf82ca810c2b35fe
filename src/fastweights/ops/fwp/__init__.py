"""Fast weight programmers: linear attention (sum rule), the delta rule (DeltaNet) and the gated
delta rule (Gated DeltaNet, docs/maths.md 5b).

docs/maths.md 1.3 (sum rule, with/without attention normalisation), 1.4 (delta rule, read after
write) and 5b (the delta rule with a decay gate). The public functions (``linear_attention.py``,
``delta.py``, ``gated_delta.py``) validate their arguments, upcast to float32 (float64 stays
float64), dispatch on ``mode`` and return outputs in the input dtype with float32-or-wider
states. On CUDA, mode="chunk" of linear_attn and delta_rule runs fla's or this project's Triton
kernels (``triton.py``; ``backend=``, chosen by ops/backend.py); everywhere else, and for
gated_delta_rule everywhere, PyTorch.
"""

from ..backend import preferred_chunk_size
from .delta import delta_rule, delta_rule_attn_norm
from .feature_maps import (
    FEATURE_MAPS,
    dpfp,
    draw_favor_projection,
    elu_plus_one,
    favor_features,
    feature_map,
    relu,
    sum_norm,
)
from .gated_delta import gated_delta_rule
from .gated_delta_recurrent import gated_delta_rule_step
from .linear_attention import MODES, LinearAttnState, linear_attn

__all__ = [
    "FEATURE_MAPS", "MODES", "LinearAttnState", "delta_rule",
    "delta_rule_attn_norm", "dpfp", "draw_favor_projection", "elu_plus_one", "favor_features",
    "feature_map", "gated_delta_rule", "gated_delta_rule_step", "linear_attn",
    "preferred_chunk_size", "relu", "sum_norm",
]
