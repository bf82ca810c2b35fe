"""The algorithms an op's ``mode=`` can pick, listed once for the ops and the layers that pass
``mode`` through (docs/design.md, "Modes"); and whether an op may read tensor values back to the
host now (``reads_allowed``, docs/design.md, "Host reads")."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

# Fast-weight, decayed linear attention, Infini-attention and AFT: the parallel-within-chunks
# form (the default), the token-by-token recurrence and the oracle.
RECURRENT_MODES = ("chunk", "recurrent", "naive")
# TTT's inner loop: the dual form (default), per-token primal weights, the autograd oracle.
TTT_MODES = ("dual", "primal", "naive")

_READ_FREE: contextvars.ContextVar[bool] = contextvars.ContextVar("read_free", default=False)


@contextlib.contextmanager
def reading_nothing() -> Iterator[None]:
    """While active, the ops read no tensor value back to the host: value checks are skipped
    (as while torch.compile traces) and the per-row decoding forms commit without reading which
    rows complete. What a step captured in a CUDA graph runs under (models/graph.py)."""
    token = _READ_FREE.set(True)
    try:
        yield
    finally:
        _READ_FREE.reset(token)


def reads_allowed() -> bool:
    """Whether an op may read tensor values back to the host now: not while torch.compile or
    torch.export traces (a data-dependent branch), nor inside ``reading_nothing``."""
    # (is_compiling first: dynamo cannot trace a ContextVar's get)
    return not (torch.compiler.is_compiling() or _READ_FREE.get())
