"""Infini-attention (Munkhdalai et al. 2024): segment-local softmax attention plus a compressive
memory read before and written after each segment, mixed by a learned per-head gate
(docs/maths.md 5).

The public function (``attention.py``) validates its arguments, upcasts to float32 (float64 stays float64),
dispatches on ``mode`` and returns outputs in the input dtype with float32-or-wider states.
"""

from .attention import (
    MODES,
    UPDATES,
    InfiniRowsState,
    InfiniSegmentState,
    InfiniState,
    infini_attention,
    infini_attention_step,
)

__all__ = ["MODES", "UPDATES", "InfiniRowsState", "InfiniSegmentState", "InfiniState",
           "infini_attention", "infini_attention_step"]
