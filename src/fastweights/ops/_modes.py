"""The algorithms an op's ``mode=`` can pick, listed once for the ops and the layers that pass
``mode`` through (docs/design.md, "Modes")."""

from __future__ import annotations

# Fast-weight, decayed linear attention, Infini-attention and AFT: the parallel-within-chunks
# form (the default), the token-by-token recurrence and the oracle.
RECURRENT_MODES = ("chunk", "recurrent", "naive")
# TTT's inner loop: the dual form (default), per-token primal weights, the autograd oracle.
TTT_MODES = ("dual", "primal", "naive")
