"""AFT-full and AFT-simple over whole sequences (docs/maths.md 4.1-4.2): ``aft``; causal AFT-full
with a key/value cache (docs/maths.md 4.3): ``aft_full_stream``.

Dimension legend: B batch, T time, D channels (every channel its own head), p cached tokens.
In both ops ``w`` is a table of pairwise position biases, rows = queries, columns = keys.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..._checks import check_bool, check_positive_int, check_tensor, state_dtype
from .._autocast import float32_compute
from .._state import check_items, checked_tensors
from .chunk import full_rows, simple_bidirectional, simple_causal
from .common import check_bias_matrix, check_btd, gate


class AFTFullState(NamedTuple):
    """The cache of causal AFT-full: every token seen, k_cache and v_cache [B, p, D] in the
    compute dtype (an arbitrary pairwise bias has no constant-size state)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor

    @classmethod
    def check(cls, state: Any, B: int, D: int, q: torch.Tensor) -> AFTFullState:
        """A carried cache for q [B, T, D], in the compute dtype."""
        check_items(state, cls)
        check_tensor("initial_state[0] (k_cache)", state[0], 3, "[B, p, D]")
        spec = ((B, state[0].shape[1], D), "[B, p, D]")
        return cls(**checked_tensors(state, cls, dict.fromkeys(cls._fields, spec), q,
                                     state_dtype(q.dtype)))


@float32_compute
def aft(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None = None, *,
    causal: bool = True, chunk_size: int = 64,
) -> torch.Tensor:
    """AFT-full (docs/maths.md 4.1), or AFT-simple (docs/maths.md 4.2) with ``w=None``.

    q, k, v: [B, T, D]; w: [T_max, T_max] pairwise position bias with T_max >= T (its top-left
    T x T block is used) or None. Y_t = sigmoid(Q_t) * sum_t' e^{K_t' + w_tt'} V_t' /
    sum_t' e^{K_t' + w_tt'} over t' <= t (causal) or all t'. AFT-full costs O(T^2 D) time: one
    pair of matrix products (bidirectional), or per block of ``chunk_size`` query rows matrix
    products over the earlier keys plus a causal window over the block's own keys (causal).
    AFT-simple runs as stabilised prefix sums (causal, O(T D)) or one softmax over time.
    Returns o [B, T, D] in q's dtype.
    """
    T = check_btd(q, k, v)[1]
    if w is not None:
        check_bias_matrix("w", w, T, T, False, q, "[T_max, T_max]")
    check_bool("causal", causal)
    check_positive_int("chunk_size", chunk_size)
    cdtype = state_dtype(q.dtype)
    k_c, v_c = k.to(cdtype), v.to(cdtype).unsqueeze(-1)  # G = D key channels, E = 1 value each
    if w is None:
        ratio = simple_causal(k_c, v_c, None)[0] if causal else simple_bidirectional(k_c, v_c)
    else:
        ratio = full_rows(k_c, v_c, w[:T, :T].to(cdtype), 0, causal, chunk_size)
    return gate(q, ratio.squeeze(-1))


@float32_compute
def aft_full_stream(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, *,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
    output_final_state: bool = False, chunk_size: int = 64,
) -> tuple[torch.Tensor, AFTFullState | None]:
    """Causal AFT-full with a key/value cache (docs/maths.md 4.3: an arbitrary pairwise bias has no
    constant-size state, so the state grows with the sequence).

    q, k, v: [B, T, D] at absolute positions p..p+T-1, p = cached tokens; w: [T, P] with
    P >= p + T, the bias rows of these tokens against key positions 0..P-1.
    State: an ``AFTFullState`` (k_cache [B, p, D], v_cache [B, p, D]).
    Returns (o [B, T, D] in q's dtype, state or None).
    """
    B, T, D = check_btd(q, k, v)
    check_bool("output_final_state", output_final_state)
    check_positive_int("chunk_size", chunk_size)
    cdtype = state_dtype(q.dtype)
    if initial_state is None:
        cache = AFTFullState(k.new_zeros(B, 0, D, dtype=cdtype), v.new_zeros(B, 0, D, dtype=cdtype))
    else:
        cache = AFTFullState.check(initial_state, B, D, q)
    pos = cache.k_cache.shape[1]
    check_bias_matrix("w", w, T, pos + T, True, q, "[T, P]")
    k_all = torch.cat([cache.k_cache, k.to(cdtype)], dim=1)
    v_all = torch.cat([cache.v_cache, v.to(cdtype)], dim=1)
    ratio = full_rows(k_all, v_all.unsqueeze(-1), w[:, :pos + T].to(cdtype), pos, True, chunk_size)
    return gate(q, ratio.squeeze(-1)), (AFTFullState(k_all, v_all) if output_final_state else None)
