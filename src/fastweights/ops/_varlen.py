"""Packed variable-length sequences (``cu_seqlens``) for every state-carrying op.

A packed batch has B = 1 and holds N documents back to back along T; ``cu_seqlens`` ([N + 1],
integer, 0 = c_0 < c_1 < ... < c_N = T) gives their boundaries, as in flash-linear-attention
and FlashAttention. The state is reset at every boundary: running the packed batch equals running
each document on its own. ``initial_state`` and the final state are then lists with one state per
document (each shaped as for a batch of one), because per-document states need not share a
structure (an open TTT mini-batch or Infini segment has a per-document fill level).
``cu_seqlens`` is a tensor, checked and read back once here, or ``Documents`` (``_checks.py``),
checked once where the call entered the library and taken as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._checks import Documents, check_documents, check_packed_states


def run_packed(
    op: Callable[..., tuple[torch.Tensor, Any]], time_args: Sequence[torch.Tensor],
    cu_seqlens: torch.Tensor | Documents, initial_state: Any, output_final_state: bool,
    **kwargs: Any,
) -> tuple[torch.Tensor, list[Any] | None]:
    """Run ``op`` once per document of a packed batch.

    time_args: tensors with time on dim 1 (q, k, v, beta, eta, ...), sliced per document;
    kwargs: everything else, passed unchanged. Returns (o [1, T, ...], list of states or None).
    """
    T = time_args[0].shape[1]
    docs = check_documents(cu_seqlens, T, time_args[0].shape[0], time_args[0].device)
    states = check_packed_states(initial_state, docs.count)
    outs, finals = [], []
    for (start, stop), state in zip(docs.spans(), states):
        o, final = op(*(x[:, start:stop] for x in time_args), initial_state=state,
                      output_final_state=output_final_state, **kwargs)
        outs.append(o)
        finals.append(final)
    return torch.cat(outs, dim=1), (finals if output_final_state else None)


def stack_packed_states(
    initial_state: Any, cu_seqlens: Any, q: torch.Tensor,
    check: Callable[[Any], tuple[torch.Tensor, ...]],
) -> tuple[list[int], tuple[torch.Tensor, ...]]:
    """For a backend that takes ``cu_seqlens`` itself (fla): the checked boundaries, and the
    per-document initial states, each checked by ``check`` (one document's state, or None, to
    its tensors for a batch of one) and stacked along dim 0 ([N, ...] each)."""
    docs = check_documents(cu_seqlens, q.shape[1], q.shape[0], q.device)
    states = check_packed_states(initial_state, docs.count)
    parts = [check(state) for state in states]
    return list(docs.bounds), tuple(torch.cat(tensors, dim=0) for tensors in zip(*parts))
