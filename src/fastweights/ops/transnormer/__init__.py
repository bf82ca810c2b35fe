"""TransNormer: block-diagonal attention (DiagAttention, docs/maths.md 3.2), decayed linear
attention (TransNormerLLM / Lightning Attention, docs/maths.md 3.5) and SRMSNorm
(docs/maths.md 3.1).

NormAttention's un-decayed core is ``fastweights.ops.linear_attn(..., normalize=False)``; its
decoding step is ``decay_linear_attn_step`` (decay None: the same recurrence without a
normaliser).
Public functions (``decay.py``, ``block.py``, ``norm.py``) validate their arguments, compute in float32 (float64 stays float64) and return
outputs in the input dtype with float32-or-wider states.
"""

from .block import KERNELS, block_attention, open_block_attention
from .decay import MODES, decay_linear_attn, decay_linear_attn_step
from .norm import srms_norm

__all__ = ["KERNELS", "MODES", "block_attention", "decay_linear_attn", "decay_linear_attn_step",
           "open_block_attention", "srms_norm"]
