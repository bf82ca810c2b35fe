"""Attention Free Transformer: AFT-full, AFT-local, AFT-simple and AFT-conv (docs/maths.md 4).

Per channel c and row t (no dot products; every channel is its own single-dimensional head):

    Y_t = sigmoid(Q_t) * sum_t' exp(K_t' + w_tt') V_t' / sum_t' exp(K_t' + w_tt'),

summed over t' <= t when causal and over all t' otherwise. AFT-simple has w = 0; AFT-local keeps
w inside a window and uses bias 0 (not a mask) outside it; AFT-conv has one key channel per head
and a per-head bias that depends only on the offset t - t'.

Three ops, each with its typed state: ``aft`` (AFT-full, or AFT-simple with ``w=None``),
``aft_local`` and ``aft_conv`` (docs/design.md, "Public ops"). Each takes ``causal``, the state
contract of the other ops (``initial_state=None, output_final_state=False`` returning
``(o, state)``; causal only), ``mode`` ("chunk": stabilised prefix sums plus banded matrix
products over blocks of ``chunk_size`` rows, or AFT-full's blocks of rows; "recurrent": token by
token with an online log-sum-exp, not for AFT-full, whose state is a cache of every token;
"naive": the oracle) and ``cu_seqlens``. ``chunk_size`` never changes the result.

Inputs may be float64/float32/bfloat16/float16; the mathematics and every state run in float32
(float64 for float64 inputs) and outputs come back in the input dtype. Every form is stable for
keys and biases of any range: AFT-full's product form redoes the rows it would underflow in the
log-sum-exp form (docs/maths.md 4.4, ``product.py``).
The oracles are in ``naive.py``, the chunked forms in ``chunk.py`` and ``product.py``, the
token-by-token ones in ``recurrent.py``, the Triton kernels of AFT-full and causal AFT-local in
``triton.py`` (``backend=``, ops/backend.py); the public ops in ``full.py`` (``aft``),
``local.py`` and ``conv.py``, each beside its typed state, and their one-token steps in
``step.py``.
"""

from .common import MODES
from .conv import AFTConvState, aft_conv
from .full import AFTFullCache, AFTFullState, AFTSimpleState, aft
from .local import AFTLocalState, aft_local
from .step import aft_conv_step, aft_local_step, aft_step, merge_simple_states

__all__ = [
    "MODES", "AFTConvState", "AFTFullCache", "AFTFullState", "AFTLocalState", "AFTSimpleState", "aft",
    "aft_conv", "aft_conv_step", "aft_local", "aft_local_step", "aft_step",
    "merge_simple_states",
]
