"""Causal AFT-local with a carried state (docs/maths.md 4.3): ``aft_local_stream``, for decoding and
running a sequence in pieces.

Dimension legend: B batch, T time, D channels (every channel its own head), s window,
c = min(p, s - 1) cached tokens, p tokens seen so far. Here ``w`` is the [T, s] band of window
biases of the call's tokens (never the whole [T_max, T_max] table ``aft_local`` takes).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..._checks import check_arg, check_positive_int, check_shape, check_tensor, is_int, state_dtype
from .._autocast import float32_compute
from .._state import check_items, checked_tensors
from .._varlen import run_packed
from .common import banded_stream, check_btd, check_stream_flags, gate


class AFTLocalState(NamedTuple):
    """The past of causal AFT-local: e^a n and e^a m (a, n, m [B, D]) sum the tokens that have
    left the window (bias 0), the caches (k_cache, v_cache [B, c, D]) hold the last
    c = min(pos, s - 1) tokens and ``pos`` is the absolute position of the next token: an int,
    or a long tensor [B] for rows at their own positions (every one >= s - 1, so that every
    row's cache is full)."""

    a: torch.Tensor
    n: torch.Tensor
    m: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    pos: int | torch.Tensor

    @classmethod
    def check(cls, state: Any, B: int, D: int, window: int, q: torch.Tensor) -> AFTLocalState:
        """A carried state for q [B, T, D] and this window, tensors in the compute dtype."""
        check_items(state, cls)
        pos = state[5]
        if isinstance(pos, torch.Tensor):
            if pos.dtype != torch.long or pos.shape != (B,) or pos.device != q.device:
                raise ValueError(f"initial_state[5] (pos) given per row must be a long tensor "
                                 f"[B] = [{B}] on {q.device}, got {pos.dtype} "
                                 f"{tuple(pos.shape)} on {pos.device}")
            # Data-dependent: eager only (a traced program cannot branch on it).
            if not torch.compiler.is_compiling() and bool((pos < window - 1).any()):
                raise ValueError(f"initial_state[5] (pos) per row must be >= window - 1 = "
                                 f"{window - 1} (full caches), got {pos.tolist()}")
            c = window - 1
        elif not is_int(pos):
            raise TypeError(f"initial_state[5] (pos) must be an int, got {pos!r}")
        elif pos < 0:
            raise ValueError(f"initial_state[5] (pos) must be >= 0, got {pos}")
        else:
            c = min(pos, window - 1)
        row, cache = ((B, D), "[B, D]"), ((B, c, D), "[B, min(pos, window - 1), D]")
        specs = {"a": row, "n": row, "m": row, "k_cache": cache, "v_cache": cache}
        return cls(**checked_tensors(state, cls, specs, q, state_dtype(q.dtype)), pos=pos)


@float32_compute
def aft_local_stream(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, *, window: int,
    initial_state: tuple | None = None, output_final_state: bool = False, mode: str = "chunk",
    chunk_size: int = 64, cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, AFTLocalState | None]:
    """Causal AFT-local with a carried state (docs/maths.md 4.3), for decoding and pieces == whole.

    q, k, v: [B, T, D], the tokens at absolute positions p..p+T-1 (p = tokens seen so far);
    w: [T, s], the window biases of these tokens: w[i, o] = W[p + i, p + i - o], the bias at
    offset o = t - t' of the token at p + i (entries reaching before position 0 are ignored).
    Only the band is passed, so a layer never builds the O(T^2) matrix W.
    State: an ``AFTLocalState`` (a, n, m, k_cache, v_cache, pos). With pos per row (a long
    tensor [B], rows at their own positions) the call takes one token (T = 1) and w is
    [B, 1, s], each row's own biases.
    Returns (o [B, T, D] in q's dtype, state in float32/float64 or None).
    ``cu_seqlens``: packed documents in a batch of one, as in ``aft_simple_stream``; the rows of
    ``w`` stay aligned with the packed tokens (each document's rows are its own window biases,
    positions counted from the document's start).
    """
    B, T, D = check_btd(q, k, v)
    check_positive_int("window", window)
    check_stream_flags(output_final_state, mode, chunk_size)
    if cu_seqlens is not None:
        check_tensor("w", w, 2, "[T, window]")
        check_shape("w", w, (T, window), "[T, window]")

        def one_document(q, k, v, w_t, **kw):
            return aft_local_stream(q, k, v, w_t[0], window=window, mode=mode,
                                    chunk_size=chunk_size, **kw)

        return run_packed(one_document, (q, k, v, w.unsqueeze(0)), cu_seqlens, initial_state,
                          output_final_state)
    pos, carried = 0, None
    if initial_state is not None:
        a, n, m, k_cache, v_cache, pos = AFTLocalState.check(initial_state, B, D, window, q)
        carried = (a, n.unsqueeze(-1), m, k_cache, v_cache.unsqueeze(-1))
    cdtype = state_dtype(q.dtype)
    if isinstance(pos, torch.Tensor):
        if T != 1:
            raise ValueError(f"a state with per-row positions continues one token per call, "
                             f"got T={T}")
        check_tensor("w", w, 3, "[B, 1, window] (per-row positions)")
        check_arg("w", w, (B, 1, window), "[B, 1, window]", q)
        band = w.to(cdtype).flip(-1).transpose(0, 1).unsqueeze(2)  # [1, B, 1, s], per row
    else:
        check_tensor("w", w, 2, "[T, window]")
        check_arg("w", w, (T, window), "[T, window]", q)
        band = w.to(cdtype).flip(-1).unsqueeze(1)  # [T, 1, s], band[..., -1 - o] = w[:, o]
    o, final = local_stream(q, k, v, band, window, carried, pos, mode, chunk_size)
    return o, (final if output_final_state else None)


def local_stream(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, band: torch.Tensor, window: int,
    carried: tuple[torch.Tensor, ...] | None, pos: int | torch.Tensor, mode: str,
    chunk_size: int,
) -> tuple[torch.Tensor, AFTLocalState]:
    """``aft_local_stream`` past its checks, also run directly by AFTLocal's decoding step on
    the state it checked: ``band`` the biases in the compute dtype and time order ([T, 1, J],
    or [1, B, 1, J] per row; band[..., -1 - o] at offset o, J >= the window the tokens see),
    ``carried`` the checked state's (a, n [B, D, 1], m, k_cache, v_cache [B, c, D, 1]) or None.
    Returns (o [B, T, D] in q's dtype, the state after the tokens)."""
    cdtype = state_dtype(q.dtype)
    k, v = (t if t.dtype == cdtype else t.to(cdtype) for t in (k, v))
    ratio, (a, n, m, k_cache, v_cache) = banded_stream(
        k, v.unsqueeze(-1), band, window, carried, mode, chunk_size)
    final = AFTLocalState(a, n.squeeze(-1), m, k_cache, v_cache.squeeze(-1), pos + k.shape[1])
    return gate(q, ratio.squeeze(-1)), final
