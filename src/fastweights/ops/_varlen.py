"""Packed variable-length sequences (``cu_seqlens``) for every state-carrying op.

A packed batch has B = 1 and holds N documents back to back along T; ``cu_seqlens`` ([N + 1],
integer, 0 = c_0 < c_1 < ... < c_N = T) gives their boundaries, as in flash-linear-attention
and FlashAttention. The state is reset at every boundary: running the packed batch equals running
each document on its own. ``initial_state`` and the final state are then lists with one state per
document (each shaped as for a batch of one), because per-document states need not share a
structure (an open TTT mini-batch or Infini segment has a per-document fill level).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch


def check_cu_seqlens(cu_seqlens: Any, T: int, batch: int, device: torch.device) -> list[int]:
    """Validate ``cu_seqlens`` for a packed batch of length T; return the boundaries as ints."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a 1-D integer torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be a 1-D tensor [N + 1] with N >= 1, got shape {tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"cu_seqlens must have an integer dtype, got {cu_seqlens.dtype}")
    if batch != 1:
        raise ValueError(f"packed sequences (cu_seqlens) need batch size B = 1, got B = {batch}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on device {cu_seqlens.device} but q is on {device}; they must match")
    bounds = [int(c) for c in cu_seqlens.tolist()]
    if bounds[0] != 0 or bounds[-1] != T:
        raise ValueError(f"cu_seqlens must start at 0 and end at T = {T}, got {bounds[0]} ... {bounds[-1]}")
    if any(b <= a for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"cu_seqlens must be strictly increasing (no empty documents), got {bounds}")
    return bounds


def check_packed_states(initial_state: Any, n_docs: int) -> list[Any]:
    """``initial_state`` under cu_seqlens: None or a list/tuple of one state per document."""
    if initial_state is None:
        return [None] * n_docs
    if not isinstance(initial_state, list) or len(initial_state) != n_docs:
        got = f"a list of {len(initial_state)}" if isinstance(initial_state, list) else type(initial_state).__name__
        raise ValueError(
            f"with cu_seqlens, initial_state must be None or a list with one state per document "
            f"({n_docs}), got {got}"
        )
    return initial_state


def run_packed(
    op: Callable[..., tuple[torch.Tensor, Any]], time_args: Sequence[torch.Tensor],
    cu_seqlens: torch.Tensor, initial_state: Any, output_final_state: bool, **kwargs: Any,
) -> tuple[torch.Tensor, list[Any] | None]:
    """Run ``op`` once per document of a packed batch.

    time_args: tensors with time on dim 1 (q, k, v, beta, eta, ...), sliced per document;
    kwargs: everything else, passed unchanged. Returns (o [1, T, ...], list of states or None).
    """
    T = time_args[0].shape[1]
    bounds = check_cu_seqlens(cu_seqlens, T, time_args[0].shape[0], time_args[0].device)
    states = check_packed_states(initial_state, len(bounds) - 1)
    outs, finals = [], []
    for (start, stop), state in zip(itertools.pairwise(bounds), states):
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
    bounds = check_cu_seqlens(cu_seqlens, q.shape[1], q.shape[0], q.device)
    states = check_packed_states(initial_state, len(bounds) - 1)
    parts = [check(state) for state in states]
    return bounds, tuple(torch.cat(tensors, dim=0) for tensors in zip(*parts))
