"""Attention Free Transformer: AFT-full, AFT-local, AFT-simple and AFT-conv (docs/maths.md 4).

Per channel c and row t (no dot products; every channel is its own single-dimensional head):

    Y_t = sigmoid(Q_t) * sum_t' exp(K_t' + w_tt') V_t' / sum_t' exp(K_t' + w_tt'),

summed over t' <= t when causal and over all t' otherwise. AFT-simple has w = 0; AFT-local keeps
w inside a window and uses bias 0 (not a mask) outside it; AFT-conv has one key channel per head
and a per-head bias that depends only on the offset t - t'.

Whole-sequence ops: ``aft`` (full, or simple with ``w=None``), ``aft_local``, ``aft_conv``
(docs/design.md, "Public ops", plus ``chunk_size``: the rows per block of the matrix-product forms).
Streaming ops for decoding and for running a sequence in pieces, all causal, with
``initial_state=None, output_final_state=False`` returning ``(o, state)``:
``aft_simple_stream``, ``aft_local_stream``, ``aft_conv_stream`` (``mode="chunk"``: the whole
call at once, stabilised prefix sums plus banded matrix products over blocks of ``chunk_size``
rows, or ``"recurrent"``: token by token with an online log-sum-exp) and ``aft_full_stream`` (a
key/value cache; no recurrent form, so no mode). ``chunk_size`` never changes the result.

Inputs may be float64/float32/bfloat16/float16; the mathematics and every state run in float32
(float64 for float64 inputs) and outputs come back in the input dtype. Every form is stable for
keys and biases of any range: AFT-full's matrix products redo the rows they would underflow with
the joint maximum of K + w (docs/maths.md 4.4, ``chunk.py``).
The oracles are in ``naive.py``; the public ops in ``full.py`` (``aft``, ``aft_full_stream``),
``local.py``, ``local_stream.py``, ``simple.py`` and ``conv.py``, each beside its typed state.
"""

from .conv import AFTConvState, aft_conv, aft_conv_stream
from .full import AFTFullState, aft, aft_full_stream
from .local import aft_local
from .local_stream import AFTLocalState, aft_local_stream
from .simple import AFTSimpleState, aft_simple_stream

__all__ = [
    "AFTConvState", "AFTFullState", "AFTLocalState", "AFTSimpleState", "aft", "aft_conv",
    "aft_conv_stream", "aft_full_stream", "aft_local", "aft_local_stream", "aft_simple_stream",
]
