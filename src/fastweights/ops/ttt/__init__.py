"""Test-time training layers' inner loop: TTT-Linear and TTT-MLP (docs/maths.md 2, Sun et al. 2024).

A per-head inner model f(z) = [z +] [LN](f_res(z)) is trained on the sequence itself with the
loss l_t = 1/2 ||[LN](f_res(k_t)) - target_t||^2 (target = v - k with the residual, else v;
docs/maths.md 2.2) by mini-batch gradient descent: within a mini-batch every gradient is taken at
the start weights, W_i = W_0 - tau_i sum_{j<=i} eta_j grad l_j(W_0), and the output is read with
the weights after the token's own update: o_t = [q_t +] [LN](f_res(q_t; W_t)).

Three forms that agree: ``"dual"`` (default, chunk.py, docs/maths.md 2.4), ``"primal"`` (primal.py,
per-token weights) and ``"naive"`` (naive.py, token loop with autograd gradients, the oracle); one
token at a time, recurrent.py (the steps ``ttt_linear_step``, ``ttt_mlp_step``). The public
functions (``inner_loop.py``) validate every argument first, compute in float32 (float64 stays
float64), and return outputs in the input dtype with float32-or-wider states: the weights at a
mini-batch boundary, else a ``TTTState`` (common.py).
"""

from .common import TTTState
from .inner_loop import MODES, ttt_linear, ttt_linear_step, ttt_mlp, ttt_mlp_step

__all__ = ["MODES", "TTTState", "ttt_linear", "ttt_linear_step", "ttt_mlp", "ttt_mlp_step"]
