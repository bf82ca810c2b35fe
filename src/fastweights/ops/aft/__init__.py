"""Attention Free Transformer: AFT-full, AFT-local, AFT-simple and AFT-conv (SPEC.md 4).

Per channel c and row t (no dot products; every channel is its own single-dimensional head):

    Y_t = sigmoid(Q_t) * sum_t' exp(K_t' + w_tt') V_t' / sum_t' exp(K_t' + w_tt'),

summed over t' <= t when causal and over all t' otherwise. AFT-simple has w = 0; AFT-local keeps
w inside a window and uses bias 0 (not a mask) outside it; AFT-conv has one key channel per head
and a per-head bias that depends only on the offset t - t'.

Whole-sequence ops: ``aft`` (full, or simple with ``w=None``), ``aft_local``, ``aft_conv``
(DESIGN.md signatures, plus ``chunk_size``: the rows per block of the matrix-product forms).
Streaming ops for decoding and for running a sequence in pieces, all causal, with
``initial_state=None, output_final_state=False`` returning ``(o, state)``:
``aft_simple_stream``, ``aft_local_stream``, ``aft_conv_stream`` (``mode="chunk"``: the whole
call at once, stabilised prefix sums plus banded matrix products over blocks of ``chunk_size``
rows, or ``"recurrent"``: token by token with an online log-sum-exp) and ``aft_full_stream`` (a
key/value cache; no recurrent form, so no mode). ``chunk_size`` never changes the result.

Inputs may be float64/float32/bfloat16/float16; the mathematics and every state run in float32
(float64 for float64 inputs) and outputs come back in the input dtype. Every form is stable for
keys of any range, and AFT-local/simple/conv for biases of any range too; AFT-full's matrix
products need a row's biases to spread less than ~60 in float32 (SPEC 4.4, ``chunk.py``).
The oracles are in ``naive.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..._checks import (
    check_bool,
    check_mode,
    check_positive_int,
    check_same_dtype_device,
    check_shape,
    check_state_tensor,
    check_tensor,
    state_dtype,
)
from .._autocast import float32_compute
from .._varlen import run_packed
from .chunk import (
    banded_bidirectional,
    banded_causal,
    full_rows,
    simple_bidirectional,
    simple_causal,
)
from .recurrent import banded_recurrent, simple_recurrent

__all__ = [
    "aft", "aft_conv", "aft_conv_stream", "aft_full_stream", "aft_local", "aft_local_stream",
    "aft_simple_stream",
]

MODES = ("chunk", "recurrent")


# ----------------------------------------------------------------------------- validation

def _check_btd(q: Any, k: Any, v: Any) -> tuple[int, int, int]:
    """q, k, v: [B, T, D] of one shape, dtype and device. Returns (B, T, D)."""
    check_tensor("q", q, 3, "[B, T, D]")
    check_tensor("k", k, 3, "[B, T, D]")
    check_tensor("v", v, 3, "[B, T, D]")
    for name, x in (("k", k), ("v", v)):
        if x.shape != q.shape:
            raise ValueError(
                f"{name} must have the same shape as q [B, T, D] = {tuple(q.shape)}, "
                f"got {tuple(x.shape)}"
            )
    if min(q.shape) < 1:
        raise ValueError(f"q, k, v must have non-empty dims, got {tuple(q.shape)}")
    check_same_dtype_device(q=q, k=k, v=v)
    return tuple(q.shape)


def _check_conv_qkv(q: Any, k: Any, v: Any) -> tuple[int, int, int, int]:
    """q, v: [B, T, H, Dh]; k: [B, T, H] (one key channel per head). Returns (B, T, H, Dh)."""
    check_tensor("q", q, 4, "[B, T, H, Dh]")
    check_tensor("v", v, 4, "[B, T, H, Dh]")
    if v.shape != q.shape:
        raise ValueError(
            f"v must have the same shape as q [B, T, H, Dh] = {tuple(q.shape)}, got {tuple(v.shape)}"
        )
    check_tensor("k", k)
    if k.dim() != 3 or k.shape != q.shape[:3]:
        raise ValueError(
            f"k must have shape [B, T, H] = {tuple(q.shape[:3])} (one key channel per head), "
            f"got {tuple(k.shape)}"
        )
    if min(q.shape) < 1:
        raise ValueError(f"q, k, v must have non-empty dims, got q {tuple(q.shape)}")
    check_same_dtype_device(q=q, k=k, v=v)
    return tuple(q.shape)


def _check_matrix(name: str, w: Any, rows: int, cols: int, exact_rows: bool, ref: torch.Tensor,
                  layout: str) -> torch.Tensor:
    """A 2-D float bias on ref's device with >= ``cols`` columns and ``rows`` rows (exactly, or
    at least); its dtype may differ from q's (it is a parameter; both are upcast)."""
    check_tensor(name, w, 2, layout)
    too_few = w.shape[0] != rows if exact_rows else w.shape[0] < rows
    if too_few or w.shape[1] < cols:
        want = f"{'exactly' if exact_rows else 'at least'} {rows} rows and at least {cols} columns"
        raise ValueError(f"{name} must have shape {layout} with {want}, got {tuple(w.shape)}")
    _check_device(name, w, ref)
    return w


def _check_device(name: str, x: torch.Tensor, ref: torch.Tensor) -> None:
    if x.device != ref.device:
        raise ValueError(f"{name} is on device {x.device} but q is on {ref.device}; they must match")


def _check_kernel(w: Any, H: int, ref: torch.Tensor) -> int:
    """AFT-conv kernel w: [H, s] with s >= 1 on ref's device. Returns s."""
    check_tensor("w", w, 2, "[H, s]")
    if w.shape[0] != H or w.shape[1] < 1:
        raise ValueError(f"w must have shape [H, s] with H = {H} and s >= 1, got {tuple(w.shape)}")
    _check_device("w", w, ref)
    return w.shape[1]


def _check_stream_flags(output_final_state: Any, mode: Any, chunk_size: Any = 1) -> None:
    check_bool("output_final_state", output_final_state)
    check_mode(mode, MODES)
    check_positive_int("chunk_size", chunk_size)


def _check_state(state: Any, names_shapes: list[tuple[str, tuple[int, ...], str]],
                 ref: torch.Tensor, extra: tuple[str, ...] = ()) -> list[torch.Tensor]:
    """initial_state: a tuple of the named tensors (then the ``extra`` non-tensor items), each of
    the given shape and on q's device; the tensors are returned in the compute dtype."""
    _check_state_tuple(state, [nm for nm, _, _ in names_shapes] + list(extra))
    cd = state_dtype(ref.dtype)
    out = []
    for i, (nm, shape, layout) in enumerate(names_shapes):
        check_state_tensor(f"initial_state[{i}] ({nm})", state[i], shape, layout, ref)
        out.append(state[i].to(cd))
    return out


def _check_state_tuple(state: Any, names: list[str]) -> None:
    if not isinstance(state, (tuple, list)) or len(state) != len(names):
        got = type(state).__name__ + (f" of length {len(state)}" if isinstance(state, (tuple, list)) else "")
        raise TypeError(f"initial_state must be a tuple ({', '.join(names)}) or None, got {got}")


def _banded_stream(k: torch.Tensor, v: torch.Tensor, band: torch.Tensor, window: int,
                   state: tuple | None, mode: str, chunk_size: int) -> tuple[torch.Tensor, tuple]:
    if mode == "chunk":
        return banded_causal(k, v, band, window, state, chunk_size)
    return banded_recurrent(k, v, band, window, state)


def _gate(q: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """o = sigmoid(Q) * ratio, computed in the compute dtype and returned in q's dtype."""
    return (torch.sigmoid(q.to(ratio.dtype)) * ratio).to(q.dtype)


def _local_band(w_rows: torch.Tensor, first: int, r_left: int, r_right: int) -> torch.Tensor:
    """Biases of the window [t - r_left, t + r_right] of rows t = first .. first + T - 1.

    w_rows [T, P]: the rows' biases against key positions 0..P-1. Returns [T, 1, J] with
    [i, 0, j] = w_rows[i, first + i - r_left + j]; positions outside 0..P-1 are clamped (their
    keys are -inf in the window, so these finite stand-ins never count)."""
    T, P = w_rows.shape
    i = torch.arange(T, device=w_rows.device).unsqueeze(1)
    j = torch.arange(r_left + r_right + 1, device=w_rows.device)
    cols = (first + i - r_left + j).clamp(0, P - 1)
    return w_rows.gather(1, cols).unsqueeze(1)


# ----------------------------------------------------------------------------- whole sequences

@float32_compute
def aft(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None = None, *,
    causal: bool = True, chunk_size: int = 64,
) -> torch.Tensor:
    """AFT-full (SPEC 4.1), or AFT-simple (SPEC 4.2) with ``w=None``.

    q, k, v: [B, T, D]; w: [T_max, T_max] pairwise position bias with T_max >= T (its top-left
    T x T block is used) or None. Y_t = sigmoid(Q_t) * sum_t' e^{K_t' + w_tt'} V_t' /
    sum_t' e^{K_t' + w_tt'} over t' <= t (causal) or all t'. AFT-full costs O(T^2 D) time: one
    pair of matrix products (bidirectional), or per block of ``chunk_size`` query rows matrix
    products over the earlier keys plus a causal window over the block's own keys (causal).
    AFT-simple runs as stabilised prefix sums (causal, O(T D)) or one softmax over time.
    Returns o [B, T, D] in q's dtype.
    """
    T = _check_btd(q, k, v)[1]
    if w is not None:
        _check_matrix("w", w, T, T, False, q, "[T_max, T_max]")
    check_bool("causal", causal)
    check_positive_int("chunk_size", chunk_size)
    cd = state_dtype(q.dtype)
    kc, vc = k.to(cd), v.to(cd).unsqueeze(-1)  # G = D key channels, E = 1 value each
    if w is None:
        ratio = simple_causal(kc, vc, None)[0] if causal else simple_bidirectional(kc, vc)
    else:
        ratio = full_rows(kc, vc, w[:T, :T].to(cd), 0, causal, chunk_size)
    return _gate(q, ratio.squeeze(-1))


@float32_compute
def aft_local(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, *, window: int,
    causal: bool = True, chunk_size: int = 64,
) -> torch.Tensor:
    """AFT-local (SPEC 4.2): AFT-full whose bias is w_tt' inside the window (0 <= t - t' < s
    causal, |t - t'| < s bidirectional, s = ``window``) and 0 outside it (those pairs still count).

    q, k, v: [B, T, D]; w: [T_max, T_max] with T_max >= T (top-left block used).
    ``window`` is an int >= 0; 0 leaves no pair in the window, which is AFT-simple (SPEC 4.5).
    O(T s D): prefix (and suffix) sums for the pairs outside the window plus the window itself,
    as banded matrix products over blocks of ``chunk_size`` rows. Returns o [B, T, D] in q's dtype.
    """
    T = _check_btd(q, k, v)[1]
    if isinstance(window, bool) or not isinstance(window, int):
        raise TypeError(f"window must be an int >= 0, got {window!r}")
    if window < 0:
        raise ValueError(f"window must be >= 0 (0: no window, AFT-simple), got {window}")
    _check_matrix("w", w, T, T, False, q, "[T_max, T_max]")
    check_bool("causal", causal)
    check_positive_int("chunk_size", chunk_size)
    if window == 0:
        return aft(q, k, v, None, causal=causal, chunk_size=chunk_size)
    cd = state_dtype(q.dtype)
    kc, vc, wc = k.to(cd), v.to(cd).unsqueeze(-1), w[:T, :T].to(cd)
    r = min(window, T) - 1  # offsets beyond T - 1 cannot occur
    if causal:
        ratio = banded_causal(kc, vc, _local_band(wc, 0, r, 0), window, None, chunk_size)[0]
    else:
        ratio = banded_bidirectional(kc, vc, _local_band(wc, 0, r, r), r, r, chunk_size)
    return _gate(q, ratio.squeeze(-1))


@float32_compute
def aft_conv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, *, causal: bool = True,
    chunk_size: int = 64,
) -> torch.Tensor:
    """AFT-conv (SPEC 4.2): per head h, one key channel k[..., h] shared by the head's Dh value
    channels and a bias depending only on the offset t - t':

    - causal: w[h, j] is the bias at t - t' = j for j = 0..s-1 (a causal convolution kernel);
    - bidirectional: s must be odd and w[h, j] is the bias at t - t' = j - (s - 1) / 2 (a centred
      kernel, index (s - 1) / 2 being t itself).

    Pairs at other offsets count with bias 0, so this equals AFT-local with window s (causal) or
    (s + 1) / 2 (bidirectional) and the per-head Toeplitz bias. O(T s H Dh), as banded matrix
    products over blocks of ``chunk_size`` rows.
    q, v: [B, T, H, Dh]; k: [B, T, H]; w: [H, s]. Returns o [B, T, H, Dh] in q's dtype.
    """
    H = _check_conv_qkv(q, k, v)[2]
    s = _check_kernel(w, H, q)
    check_bool("causal", causal)
    check_positive_int("chunk_size", chunk_size)
    if not causal and s % 2 == 0:
        raise ValueError(f"w must have an odd kernel size s for causal=False (centred kernel), got s = {s}")
    cd = state_dtype(q.dtype)
    band = w.to(cd).flip(-1).unsqueeze(0)  # [1, H, s]: offset s-1-j for causal, r-j centred
    if causal:
        ratio = banded_causal(k.to(cd), v.to(cd), band, s, None, chunk_size)[0]
    else:
        r = (s - 1) // 2
        ratio = banded_bidirectional(k.to(cd), v.to(cd), band, r, r, chunk_size)
    return _gate(q, ratio)


# ----------------------------------------------------------------------------- streaming

@float32_compute
def aft_simple_stream(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    initial_state: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    output_final_state: bool = False, mode: str = "chunk", cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]:
    """Causal AFT-simple with a carried state (SPEC 4.3).

    q, k, v: [B, T, D]. State (a, n, m), each [B, D]: the past sums to e^a n (numerator
    sum e^K V) and e^a m (denominator sum e^K); a is a stabilising reference (the running key
    maximum in ``"recurrent"`` mode, the log-sum-exp with m = 1 in ``"chunk"`` mode).
    Returns (o [B, T, D] in q's dtype, state in float32/float64 or None).
    ``cu_seqlens`` [N + 1]: packed documents in a batch of one, the state reset at each boundary;
    initial/final states are then lists with one state per document (ops/_varlen.py).
    """
    B, _, D = _check_btd(q, k, v)
    _check_stream_flags(output_final_state, mode)
    if cu_seqlens is not None:
        return run_packed(aft_simple_stream, (q, k, v), cu_seqlens, initial_state,
                          output_final_state, mode=mode)
    prefix = None
    if initial_state is not None:
        a, n, m = _check_state(initial_state, [("a", (B, D), "[B, D]"), ("n", (B, D), "[B, D]"),
                                               ("m", (B, D), "[B, D]")], q)
        prefix = (a, n.unsqueeze(-1), m)
    cd = state_dtype(q.dtype)
    kc, vc = k.to(cd), v.to(cd).unsqueeze(-1)
    run = simple_causal if mode == "chunk" else simple_recurrent
    ratio, (a, n, m) = run(kc, vc, prefix)
    return _gate(q, ratio.squeeze(-1)), ((a, n.squeeze(-1), m) if output_final_state else None)


@float32_compute
def aft_local_stream(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, *, window: int,
    initial_state: tuple | None = None, output_final_state: bool = False, mode: str = "chunk",
    chunk_size: int = 64, cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple | None]:
    """Causal AFT-local with a carried state (SPEC 4.3), for decoding and pieces == whole.

    q, k, v: [B, T, D], the tokens at absolute positions p..p+T-1 (p = tokens seen so far);
    w: [T, s], the window biases of these tokens: w[i, o] = W[p + i, p + i - o], the bias at
    offset o = t - t' of the token at p + i (entries reaching before position 0 are ignored).
    Only the band is passed, so a layer never builds the O(T^2) matrix W.
    State (a, n, m [B, D], k_cache [B, c, D], v_cache [B, c, D], p): e^a n and e^a m sum the
    tokens that have left the window (bias 0), the caches hold the last c = min(p, s - 1) tokens
    and p is the absolute position of the next token (a Python int).
    Returns (o [B, T, D] in q's dtype, state in float32/float64 or None).
    ``cu_seqlens``: packed documents in a batch of one, as in ``aft_simple_stream``; the rows of
    ``w`` stay aligned with the packed tokens (each document's rows are its own window biases,
    positions counted from the document's start).
    """
    B, T, D = _check_btd(q, k, v)
    check_positive_int("window", window)
    _check_stream_flags(output_final_state, mode, chunk_size)
    if cu_seqlens is not None:
        check_tensor("w", w, 2, "[T, window]")
        check_shape("w", w, (T, window), "[T, window]")

        def one_document(q, k, v, w_t, **kw):
            return aft_local_stream(q, k, v, w_t[0], window=window, mode=mode,
                                    chunk_size=chunk_size, **kw)

        return run_packed(one_document, (q, k, v, w.unsqueeze(0)), cu_seqlens, initial_state,
                          output_final_state)
    pos, state = 0, None
    if initial_state is not None:
        _check_state_tuple(initial_state, ["a", "n", "m", "k_cache", "v_cache", "pos"])
        pos = initial_state[5]
        if isinstance(pos, bool) or not isinstance(pos, int):
            raise TypeError(f"initial_state[5] (pos) must be an int, got {pos!r}")
        if pos < 0:
            raise ValueError(f"initial_state[5] (pos) must be >= 0, got {pos}")
        c = min(pos, window - 1)
        a, n, m, kc, vc = _check_state(
            initial_state, [("a", (B, D), "[B, D]"), ("n", (B, D), "[B, D]"), ("m", (B, D), "[B, D]"),
                            ("k_cache", (B, c, D), "[B, min(pos, window - 1), D]"),
                            ("v_cache", (B, c, D), "[B, min(pos, window - 1), D]")], q, ("pos",))
        state = (a, n.unsqueeze(-1), m, kc, vc.unsqueeze(-1))
    check_tensor("w", w, 2, "[T, window]")
    check_shape("w", w, (T, window), "[T, window]")
    _check_device("w", w, q)
    cd = state_dtype(q.dtype)
    band = w.to(cd).flip(-1).unsqueeze(1)  # [T, 1, s], band[..., -1 - o] = w[:, o]
    ratio, (a, n, m, kc, vc) = _banded_stream(k.to(cd), v.to(cd).unsqueeze(-1), band, window, state,
                                              mode, chunk_size)
    final = (a, n.squeeze(-1), m, kc, vc.squeeze(-1), pos + T) if output_final_state else None
    return _gate(q, ratio.squeeze(-1)), final


@float32_compute
def aft_conv_stream(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, *,
    initial_state: tuple | None = None, output_final_state: bool = False, mode: str = "chunk",
    chunk_size: int = 64, cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple | None]:
    """Causal AFT-conv with a carried state (the streaming form of ``aft_conv``, causal=True).

    q, v: [B, T, H, Dh]; k: [B, T, H]; w: [H, s] (w[h, j] is the bias at offset t - t' = j).
    State (a [B, H], n [B, H, Dh], m [B, H], k_cache [B, c, H], v_cache [B, c, H, Dh]),
    c = min(tokens seen, s - 1): the prefix that has left the kernel and the last c tokens; no
    position is needed since the bias depends on offsets only.
    Returns (o [B, T, H, Dh] in q's dtype, state in float32/float64 or None).
    ``cu_seqlens``: packed documents in a batch of one, as in ``aft_simple_stream``.
    """
    B, _, H, Dh = _check_conv_qkv(q, k, v)
    s = _check_kernel(w, H, q)
    _check_stream_flags(output_final_state, mode, chunk_size)
    if cu_seqlens is not None:
        return run_packed(aft_conv_stream, (q, k, v), cu_seqlens, initial_state,
                          output_final_state, w=w, mode=mode, chunk_size=chunk_size)
    state = None
    if initial_state is not None:
        _check_state_tuple(initial_state, ["a", "n", "m", "k_cache", "v_cache"])
        kc = initial_state[3]
        check_tensor("initial_state[3] (k_cache)", kc, 3, "[B, c, H]")
        c = kc.shape[1]
        if c > s - 1:
            raise ValueError(
                f"initial_state[3] (k_cache) must have shape [B, c, H] with c <= s - 1 = {s - 1}, "
                f"got {tuple(kc.shape)}")
        state = tuple(_check_state(
            initial_state, [("a", (B, H), "[B, H]"), ("n", (B, H, Dh), "[B, H, Dh]"),
                            ("m", (B, H), "[B, H]"), ("k_cache", (B, c, H), "[B, c, H]"),
                            ("v_cache", (B, c, H, Dh), "[B, c, H, Dh]")], q))
    cd = state_dtype(q.dtype)
    band = w.to(cd).flip(-1).unsqueeze(0)  # [1, H, s], band[..., -1 - o] = w[:, o]
    ratio, final = _banded_stream(k.to(cd), v.to(cd), band, s, state, mode, chunk_size)
    return _gate(q, ratio), (final if output_final_state else None)


@float32_compute
def aft_full_stream(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, *,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
    output_final_state: bool = False, chunk_size: int = 64,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Causal AFT-full with a key/value cache (SPEC 4.3: an arbitrary pairwise bias has no
    constant-size state, so the state grows with the sequence).

    q, k, v: [B, T, D] at absolute positions p..p+T-1, p = cached tokens; w: [T, P] with
    P >= p + T, the bias rows of these tokens against key positions 0..P-1.
    State (k_cache [B, p, D], v_cache [B, p, D]). Returns (o [B, T, D] in q's dtype, state).
    """
    B, T, D = _check_btd(q, k, v)
    check_bool("output_final_state", output_final_state)
    check_positive_int("chunk_size", chunk_size)
    cd = state_dtype(q.dtype)
    if initial_state is None:
        k_cache = k.new_zeros(B, 0, D, dtype=cd)
        v_cache = v.new_zeros(B, 0, D, dtype=cd)
    else:
        _check_state_tuple(initial_state, ["k_cache", "v_cache"])
        check_tensor("initial_state[0] (k_cache)", initial_state[0], 3, "[B, p, D]")
        p = initial_state[0].shape[1]
        k_cache, v_cache = _check_state(
            initial_state, [("k_cache", (B, p, D), "[B, p, D]"), ("v_cache", (B, p, D), "[B, p, D]")], q)
    pos = k_cache.shape[1]
    _check_matrix("w", w, T, pos + T, True, q, "[T, P]")
    k_all = torch.cat([k_cache, k.to(cd)], dim=1)
    v_all = torch.cat([v_cache, v.to(cd)], dim=1)
    ratio = full_rows(k_all, v_all.unsqueeze(-1), w[:, :pos + T].to(cd), pos, True, chunk_size)
    return _gate(q, ratio.squeeze(-1)), ((k_all, v_all) if output_final_state else None)
