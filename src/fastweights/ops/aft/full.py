"""AFT-full and AFT-simple (docs/maths.md 4.1-4.3): ``aft``, with its states ``AFTFullState`` (the
key/value cache of AFT-full) and ``AFTSimpleState`` (the stable sums of AFT-simple).

Dimension legend: B batch, T time, D channels (every channel its own head), p cached tokens.
``w`` is a table of pairwise position biases, rows = the call's tokens, columns = keys.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..._checks import check_tensor, state_dtype
from .._autocast import float32_compute
from .._state import check_items, checked_tensors
from .._varlen import run_packed
from ..backend import Kernel, Trial, choose_backend, register
from .chunk import simple_bidirectional, simple_causal
from .common import (
    check_bias_matrix,
    check_btd,
    check_flags,
    gate,
    kernel_refusal,
    triton_kernels,
)
from .naive import banded_naive, full_naive
from .product import exact_rows, full_product, redo_lossy
from .recurrent import simple_recurrent

# AFT-full has kernels (its product form, mode "chunk"); AFT-simple (``aft`` without w) none.
register("aft", triton=Kernel(kernels=triton_kernels, refuse=kernel_refusal))
register("aft_simple")


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


class AFTFullCache(NamedTuple):
    """AFT-full's cache in buffers of fixed capacity L (what a decoding step captured in a CUDA
    graph continues: fixed shapes and addresses; docs/design.md, "Decoding graphs"): k_cache and
    v_cache [B, L, D] in the compute dtype, row b's tokens their first ``lengths[b]`` entries
    (long [B]), the rest not yet written. ``aft_step`` writes into the buffers in place."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    lengths: torch.Tensor


class AFTSimpleState(NamedTuple):
    """The past of causal AFT-simple, each [B, D]: it sums to e^a n (numerator sum e^K V) and
    e^a m (denominator sum e^K); a is a stabilising reference (the running key maximum in
    ``"recurrent"`` and ``"naive"`` mode, the log-sum-exp with m = 1 in ``"chunk"`` mode)."""

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
def aft(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None = None, *,
    causal: bool = True, initial_state: tuple[torch.Tensor, ...] | None = None,
    output_final_state: bool = False, mode: str = "chunk", chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None, backend: str | None = None,
) -> tuple[torch.Tensor, AFTFullState | AFTSimpleState | None]:
    """AFT-full (docs/maths.md 4.1), or AFT-simple (docs/maths.md 4.2) with ``w=None``.

    q, k, v: [B, T, D]. Y_t = sigmoid(Q_t) * sum_t' e^{K_t' + w_tt'} V_t' / sum_t' e^{K_t' + w_tt'}
    over t' <= t (causal) or all t'. w: [T', P] pairwise biases, row i those of the call's i-th
    token (absolute position p + i, p the tokens in the state) against the keys at positions
    0..P-1, with T' >= T and P >= p + T (other rows and columns are not read): without a state,
    the top-left T x T block of a [T_max, T_max] table.
    Returns (o [B, T, D] in q's dtype, the state or None).

    State (causal only: ``initial_state`` / ``output_final_state``): AFT-full's is an
    ``AFTFullState``, the cache of every key and value seen (an arbitrary pairwise bias has no
    constant-size state); AFT-simple's an ``AFTSimpleState`` (a, n, m), each [B, D].

    ``mode``: "chunk" (default; AFT-full in the paper's product form, exp(w) @ (exp(K) V) over
    exp(w) @ exp(K) stabilised by the row maxima of w and the column maxima of K, per block of
    ``chunk_size`` query rows, O(T^2 D) and O(T (p + T) D) with a cache, rows whose terms
    underflowed redone in the log-sum-exp form (docs/maths.md 4.4); AFT-simple as stabilised
    prefix sums, O(T D), or one softmax over time), "recurrent" (causal AFT-simple only: token
    by token with an online log-sum-exp; AFT-full has no recurrence) or "naive" (the literal
    sums, the oracle). ``chunk_size`` never changes the result. ``cu_seqlens`` [N + 1]: packed
    documents in a batch of one, each on its own (for AFT-full w then has exactly T rows,
    aligned with the packed tokens, each document's against its own key positions from 0);
    initial/final states are lists with one state per document (ops/_varlen.py).
    ``backend``: "triton", "torch" or None (automatic; ops/backend.py): AFT-full's mode "chunk"
    has Triton kernels (ops/aft/triton.py; half inputs on CUDA, D a multiple of 16); AFT-simple
    runs on torch.
    """
    B, T, D = check_btd(q, k, v)
    check_flags(causal, initial_state, output_final_state, mode, chunk_size)
    if w is not None and mode == "recurrent":
        raise ValueError("AFT-full (w given) has no recurrent form (an arbitrary pairwise bias "
                         "has no constant-size state); use mode='chunk' or 'naive'")
    if cu_seqlens is not None:
        if w is None:
            return run_packed(aft, (q, k, v), cu_seqlens, initial_state, output_final_state,
                              causal=causal, mode=mode, chunk_size=chunk_size, backend=backend)
        check_tensor("w", w, 2, "[T, P]")
        if w.shape[0] != T:
            raise ValueError(f"w must have shape [T, P] with exactly T = {T} rows (one per packed "
                             f"token) under cu_seqlens, got {tuple(w.shape)}")

        def one_document(q, k, v, w_t, **kw):
            return aft(q, k, v, w_t[0], causal=causal, mode=mode, chunk_size=chunk_size,
                       backend=backend, **kw)

        return run_packed(one_document, (q, k, v, w.unsqueeze(0)), cu_seqlens, initial_state,
                          output_final_state)
    cdtype = state_dtype(q.dtype)
    # AFT's channels are its heads, of size 1: the backend sees q as [B, T, D heads, 1].
    if w is None:
        choose_backend("aft_simple", q.unsqueeze(-1), backend, mode, chunk_size)  # torch
        ratio, final = _simple(k.to(cdtype), v.to(cdtype).unsqueeze(-1), initial_state, causal,
                               mode, q)
        return gate(q, ratio.squeeze(-1)), (final if output_final_state else None)
    if initial_state is None:
        cache = None
        pos = 0
    else:
        cache = AFTFullState.check(initial_state, B, D, q)
        pos = cache.k_cache.shape[1]
    check_bias_matrix("w", w, T, pos + T, False, q, "[T', P]")
    # Trial runs carry a state, which a bidirectional call refuses: those go untried. The trial
    # detaches its sequences, not its options: w, detached here, must not get its gradient.
    chosen = choose_backend(
        "aft", q.unsqueeze(-1), backend, mode, chunk_size,
        (lambda: Trial(aft, (q, k, v), w=w.detach(), chunk_size=chunk_size)) if causal else None)
    # The keys and values in view; the kernels read a call without a cache in its own dtype.
    if cache is None:
        k_all, v_all = (k, v) if chosen == "triton" else (k.to(cdtype), v.to(cdtype))
    else:
        k_all = torch.cat([cache.k_cache, k.to(cdtype)], dim=1)
        v_all = torch.cat([cache.v_cache, v.to(cdtype)], dim=1)
    w = w[:T, :pos + T]
    if chosen == "triton":
        o, lossy = triton_kernels().aft_full_triton(q, k_all, v_all, w, pos, causal)
        o = redo_lossy(o, lossy, _exact_gated(pos, causal), q, k_all, v_all, w)
    elif mode == "chunk":
        ratio, lossy = full_product(k_all, v_all, w.to(cdtype), pos, causal, chunk_size)
        o = redo_lossy(gate(q, ratio), lossy, _exact_gated(pos, causal), q, k_all, v_all, w)
    else:
        o = gate(q, full_naive(k_all, v_all.unsqueeze(-1), w.to(cdtype), pos, causal).squeeze(-1))
    if not output_final_state:
        return o, None
    return o, AFTFullState(k_all.to(cdtype), v_all.to(cdtype))


def _exact_gated(first: int, causal: bool):
    """``redo_lossy``'s redo of AFT-full: the gated rows in the log-sum-exp form, in the
    compute dtype."""
    def redo(rows: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             w: torch.Tensor) -> torch.Tensor:
        cdtype = state_dtype(q.dtype)
        R = exact_rows(k.to(cdtype), v.to(cdtype), w.to(cdtype), rows, first, causal)
        return gate(q.index_select(1, rows), R)

    return redo


def _simple(
    k: torch.Tensor, v: torch.Tensor, initial_state: Any, causal: bool, mode: str,
    q: torch.Tensor,
) -> tuple[torch.Tensor, AFTSimpleState | None]:
    """AFT-simple in the chosen ``mode`` on k [B, T, D], v [B, T, D, 1] in the compute dtype:
    (R [B, T, D, 1], the state after the tokens; None when bidirectional)."""
    if not causal:
        if mode == "chunk":
            return simple_bidirectional(k, v), None
        return banded_naive(k, v, k.new_zeros(1, 1, 1, 1), 0, False, 1, None)[0], None
    prefix = None
    if initial_state is not None:
        a, n, m = AFTSimpleState.check(initial_state, k.shape[0], k.shape[2], q)
        prefix = (a, n.unsqueeze(-1), m)
    if mode == "naive":  # AFT-simple is AFT-local with a window of the token itself, bias 0
        state = None if prefix is None else (*prefix, k[:, :0], v[:, :0])
        ratio, (a, n, m, _, _) = banded_naive(k, v, k.new_zeros(1, 1, 1, 1), 0, True, 1, state)
    else:
        ratio, (a, n, m) = (simple_causal if mode == "chunk" else simple_recurrent)(k, v, prefix)
    return ratio, AFTSimpleState(a, n.squeeze(-1), m)
