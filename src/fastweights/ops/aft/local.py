"""AFT-local (docs/maths.md 4.2-4.3): ``aft_local``, with its state ``AFTLocalState``.

Dimension legend: B batch, T time, D channels (every channel its own head), s window,
c = min(p, s - 1) cached tokens, p tokens seen so far. ``w`` is the band of window biases of the
call's tokens, never a [T, T] table: a layer never builds the O(T^2) matrix.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..._checks import check_arg, check_positive_int, check_shape, check_tensor, is_int, state_dtype
from .._autocast import float32_compute
from .._modes import reads_allowed
from .._state import check_items, checked_tensors
from .._varlen import run_packed
from ..backend import Kernel, Trial, choose_backend, register
from .chunk import banded_bidirectional
from .common import (
    banded_stream,
    check_btd,
    check_flags,
    gate,
    kernel_refusal,
    triton_kernels,
)
from .naive import banded_naive
from .product import redo_lossy

# Causal calls without a carried state have kernels (the banded product form, mode "chunk").
register("aft_local", triton=Kernel(kernels=triton_kernels, refuse=kernel_refusal))


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
            if reads_allowed() and bool((pos < window - 1).any()):
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
def aft_local(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, *, window: int,
    causal: bool = True, initial_state: tuple | None = None, output_final_state: bool = False,
    mode: str = "chunk", chunk_size: int = 64, cu_seqlens: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, AFTLocalState | None]:
    """AFT-local (docs/maths.md 4.2): AFT-full whose bias is w_tt' inside the window
    (0 <= t - t' < s causal, |t - t'| < s bidirectional, s = ``window`` >= 1) and 0 outside it
    (those pairs still count).

    q, k, v: [B, T, D], the tokens at absolute positions p..p+T-1 (p = tokens in the state).
    w, the band of window biases of these tokens (only the band is passed, so a caller never
    builds the O(T^2) table W): causal, [T, s] with w[i, o] = W[p + i, p + i - o], the bias at
    offset o = t - t' of the call's token i (entries reaching before position 0 are not read);
    bidirectional, [T, 2s - 1] with w[i, j] the bias at offset t - t' = j - (s - 1).
    Returns (o [B, T, D] in q's dtype, state in float32/float64 or None).

    State (causal only): an ``AFTLocalState`` (a, n, m, k_cache, v_cache, pos). With pos per row
    (a long tensor [B], rows at their own positions) the call takes one token (T = 1) and w is
    [B, 1, s], each row's own biases.

    ``mode``: "chunk" (default; prefix (and suffix) sums for the pairs outside the window plus
    the window itself as banded matrix products over blocks of ``chunk_size`` rows, O(T s D); a
    one-token call runs the recurrent step), "recurrent" (causal only: token by token with an
    online log-sum-exp) or "naive" (the literal sums, the oracle). ``cu_seqlens``: packed
    documents in a batch of one, each on its own (ops/_varlen.py); the rows of ``w`` stay
    aligned with the packed tokens (each document's rows are its own window biases, positions
    counted from the document's start). ``backend``: "triton", "torch" or None (automatic;
    ops/backend.py): causal calls of mode "chunk" without a carried state have Triton kernels
    (the banded product form, docs/maths.md 4.4; half inputs on CUDA, D a multiple of 16).
    """
    B, T, D = check_btd(q, k, v)
    check_positive_int("window", window)
    check_flags(causal, initial_state, output_final_state, mode, chunk_size)
    width, layout = (window, "[T, window]") if causal else (2 * window - 1, "[T, 2 window - 1]")
    if cu_seqlens is not None:
        check_tensor("w", w, 2, layout)
        check_shape("w", w, (T, width), layout)

        def one_document(q, k, v, w_t, **kw):
            return aft_local(q, k, v, w_t[0], window=window, causal=causal, mode=mode,
                             chunk_size=chunk_size, backend=backend, **kw)

        return run_packed(one_document, (q, k, v, w.unsqueeze(0)), cu_seqlens, initial_state,
                          output_final_state)
    cdtype = state_dtype(q.dtype)
    if not causal:
        check_tensor("w", w, 2, layout)
        check_arg("w", w, (T, width), layout, q)
        # An explicit backend='triton' raises here (the kernels are causal); torch runs it.
        choose_backend("aft_local", q.unsqueeze(-1), backend, mode, chunk_size,
                       facts={"causal": False})
        k_c, v_c, w_c = k.to(cdtype), v.to(cdtype).unsqueeze(-1), w.to(cdtype)
        if mode == "naive":
            ratio = banded_naive(k_c, v_c, w_c[:, None, None], window - 1, False, window, None)[0]
        else:  # banded_bidirectional's band[..., j]: t' = t - (s - 1) + j, the flipped band
            ratio = banded_bidirectional(k_c, v_c, w_c.flip(-1).unsqueeze(1), window - 1,
                                         window - 1, chunk_size)
        return gate(q, ratio.squeeze(-1)), None
    pos, carried = 0, None
    if initial_state is not None:
        a, n, m, k_cache, v_cache, pos = AFTLocalState.check(initial_state, B, D, window, q)
        carried = (a, n.unsqueeze(-1), m, k_cache, v_cache.unsqueeze(-1))
    if isinstance(pos, torch.Tensor):
        if T != 1:
            raise ValueError(f"a state with per-row positions continues one token per call, "
                             f"got T={T}")
        check_tensor("w", w, 3, "[B, 1, window] (per-row positions)")
        check_arg("w", w, (B, 1, window), "[B, 1, window]", q)
        band = w.to(cdtype).flip(-1).transpose(0, 1).unsqueeze(2)  # [1, B, 1, s], per row
    else:
        check_tensor("w", w, 2, layout)
        check_arg("w", w, (T, window), layout, q)
        if choose_backend("aft_local", q.unsqueeze(-1), backend, mode, chunk_size,
                          lambda: _trial(q, k, v, w, window),
                          {"carried": initial_state is not None}) == "triton":
            return _local_triton(q, k, v, w, window, output_final_state, chunk_size)
        band = w.to(cdtype).flip(-1).unsqueeze(1)  # [T, 1, s], band[..., -1 - o] = w[:, o]
    o, final = local_causal(q, k, v, band, window, carried, pos, mode, chunk_size)
    return o, (final if output_final_state else None)


def _trial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor,
           window: int) -> Trial:
    """The automatic choice's trial call: the band's rows go with the tokens (a sequence, on
    its dimension 1 as [1, T, s])."""
    def op(q, k, v, w3, **kw):
        return aft_local(q, k, v, w3[0], window=window, **kw)

    return Trial(op, (q, k, v, w.unsqueeze(0)))


def _local_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor,
                  window: int, output_final_state: bool,
                  chunk_size: int) -> tuple[torch.Tensor, AFTLocalState | None]:
    """Causal ``aft_local`` without a carried state on the kernels (ops/aft/triton.py, the
    banded product form of docs/maths.md 4.4): rows flagged lossy redone by the PyTorch form,
    the final state summed in PyTorch."""
    o, lossy = triton_kernels().aft_local_triton(q, k, v, w, window)

    def redo(rows: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             w: torch.Tensor) -> torch.Tensor:
        band = w.to(state_dtype(q.dtype)).flip(-1).unsqueeze(1)
        return local_causal(q, k, v, band, window, None, 0, "chunk", chunk_size)[0][:, rows]

    o = redo_lossy(o, lossy, redo, q, k, v, w)
    return o, (_final_state(k, v, window) if output_final_state else None)


def _final_state(k: torch.Tensor, v: torch.Tensor, window: int) -> AFTLocalState:
    """The state after a call of k, v [B, T, D] without a carried state: the tokens before the
    last window - 1 summed as (log-sum-exp, softmax-weighted mean, 1), the rest cached."""
    cdtype = state_dtype(k.dtype)
    k, v = k.to(cdtype), v.to(cdtype)
    T = k.shape[1]
    keep = T - min(T, window - 1)
    if keep > 0:
        a = torch.logsumexp(k[:, :keep], dim=1)
        n = (torch.softmax(k[:, :keep], dim=1) * v[:, :keep]).sum(dim=1)
        m = torch.ones_like(a)
    else:
        a = k.new_full((k.shape[0], k.shape[2]), float("-inf"))
        n, m = torch.zeros_like(a), torch.zeros_like(a)
    return AFTLocalState(a, n, m, k[:, keep:], v[:, keep:], T)


def local_causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, band: torch.Tensor, window: int,
    carried: tuple[torch.Tensor, ...] | None, pos: int | torch.Tensor, mode: str,
    chunk_size: int,
) -> tuple[torch.Tensor, AFTLocalState]:
    """Causal ``aft_local`` past its checks, also run directly by AFTLocal's decoding step on
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
