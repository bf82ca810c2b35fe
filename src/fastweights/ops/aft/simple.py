"""Causal AFT-simple with a carried state (docs/maths.md 4.2-4.3): ``aft_simple_stream``.

Dimension legend: B batch, T time, D channels (every channel its own head).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..._checks import state_dtype
from .._autocast import float32_compute
from .._state import check_items, checked_tensors
from .._varlen import run_packed
from .chunk import simple_causal
from .common import check_btd, check_stream_flags, gate
from .recurrent import simple_recurrent


class AFTSimpleState(NamedTuple):
    """The past of causal AFT-simple, each [B, D]: it sums to e^a n (numerator sum e^K V) and
    e^a m (denominator sum e^K); a is a stabilising reference (the running key maximum in
    ``"recurrent"`` mode, the log-sum-exp with m = 1 in ``"chunk"`` mode)."""

    a: torch.Tensor
    n: torch.Tensor
    m: torch.Tensor

    @classmethod
    def check(cls, state: Any, B: int, D: int, q: torch.Tensor) -> AFTSimpleState:
        """A carried state for q [B, T, D], in the compute dtype."""
        check_items(state, cls)
        spec = ((B, D), "[B, D]")
        return cls(**checked_tensors(state, cls, dict.fromkeys(cls._fields, spec), q,
                                     state_dtype(q.dtype)))


@float32_compute
def aft_simple_stream(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    initial_state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    output_final_state: bool = False, mode: str = "chunk", cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, AFTSimpleState | None]:
    """Causal AFT-simple with a carried state (docs/maths.md 4.3).

    q, k, v: [B, T, D]. State: an ``AFTSimpleState`` (a, n, m), each [B, D].
    Returns (o [B, T, D] in q's dtype, state in float32/float64 or None).
    ``cu_seqlens`` [N + 1]: packed documents in a batch of one, the state reset at each boundary;
    initial/final states are then lists with one state per document (ops/_varlen.py).
    """
    B, _, D = check_btd(q, k, v)
    check_stream_flags(output_final_state, mode)
    if cu_seqlens is not None:
        return run_packed(aft_simple_stream, (q, k, v), cu_seqlens, initial_state,
                          output_final_state, mode=mode)
    prefix = None
    if initial_state is not None:
        a, n, m = AFTSimpleState.check(initial_state, B, D, q)
        prefix = (a, n.unsqueeze(-1), m)
    cdtype = state_dtype(q.dtype)
    k_c, v_c = k.to(cdtype), v.to(cdtype).unsqueeze(-1)
    run = simple_causal if mode == "chunk" else simple_recurrent
    ratio, (a, n, m) = run(k_c, v_c, prefix)
    final = AFTSimpleState(a, n.squeeze(-1), m) if output_final_state else None
    return gate(q, ratio.squeeze(-1)), final
