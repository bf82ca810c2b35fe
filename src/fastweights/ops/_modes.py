"""The algorithms an op's ``mode=`` can pick, listed once for the ops and the layers that pass
``mode`` through (docs/design.md, "Modes")."""

from __future__ import annotations

# Fast-weight, decayed linear attention and Infini-attention: the oracle, the token-by-token
# recurrence and the parallel-within-chunks form (the default).
RECURRENT_MODES = ("chunk", "recurrent", "naive")
# AFT's streaming ops: the chunked form or the token-by-token one with an online log-sum-exp.
STREAM_MODES = ("chunk", "recurrent")
# TTT's inner loop: the dual form (default), per-token primal weights, the autograd oracle.
TTT_MODES = ("dual", "primal", "naive")
