"""Parallel forms of the Attention Free Transformer (docs/maths.md 4.1-4.4).

Dimension legend: B batch, T new tokens, c cached past tokens, L = c + T tokens in view,
G key channels (D for AFT-full/local/simple, where every channel is its own head; H for
AFT-conv), E value channels per key channel (1, or Dh for AFT-conv), s window, J window
positions looked at per row, C rows per block, N blocks, S = C + J - 1 keys a block of rows
can see, Gb band groups (1 for AFT-local's shared bias, H for AFT-conv's per-head kernels).

Every function returns the gate-free ratio R_t = sum_t' e^{K_t' + w_tt'} V_t' / sum_t' e^{K_t' + w_tt'}
as [B, T, G, E]; the public ops multiply it by sigmoid(Q). Inputs are in the compute dtype.

Streaming state of AFT-simple/local/conv, ``(a [B, G], n [B, G, E], m [B, G], k_cache [B, c, G],
v_cache [B, c, G, E])``: the tokens that have left the window sum to e^a n (numerator) and e^a m
(denominator); the cache holds the last c <= s - 1 tokens, still inside the next row's window.
The empty prefix is (a, n, m) = (-inf, 0, 0).

Numerical stability (docs/maths.md 4.4): only constants along the summed axis t' are ever
subtracted, and every sum is held as a (log-sum-exp, weighted mean) pair or an (a, n, m) triple.
- Prefix sums are plain cumulative sums of e^{K - max K} while no prefix can underflow (key
  spreads below ~60 in float32, ~680 in float64), and otherwise a doubling scan of the stable
  pairwise merge; either way keys of any range neither overflow nor underflow.
- A row's window terms and its outside prefix/suffix are scaled by their joint maximum, so no
  term exceeds 1, the largest is 1 and the denominator is >= 1.
- Windows are banded matrix products per block of rows, whose reference factorises into the row
  maximum of the bias and the block maximum of the keys; where that could underflow a row (a
  key spread over ~60 within a block in float32) they are summed position by position instead,
  exact for any range.
- Keys are first taken relative to the call's largest key per channel: sums then stay near
  e^0, where float32 resolves them best (keys around 80 would otherwise cost 2-3 digits).
- AFT-full's product form is in ``product.py``.

The choices between a fast form and an exact fallback above read tensor values. In eager mode
they are Python branches (one device sync each); under torch.compile / torch.export they are
``torch.cond`` (``_select``), so a traced graph holds both forms and picks at run time with
the same test: no graph break, no data-dependent guard, the same exactness.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

Summary = tuple[torch.Tensor, torch.Tensor]  # (log-sum-exp [B, G], weighted mean [B, G, E])
PrefixState = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (a, n, m)


def _select(pred: torch.Tensor, fast: Callable[..., Any], exact: Callable[..., Any],
            *operands: torch.Tensor) -> Any:
    """``fast(*operands)`` where the 0-d bool ``pred`` holds, else ``exact(*operands)``.

    Eager mode reads ``pred`` and runs one function. Traced (torch.compile, torch.export) it is a
    ``torch.cond``: a Python branch on a tensor's value would break the graph or fail to export.
    Both functions return tensors of the same shapes and dtypes."""
    if torch.compiler.is_compiling():
        return torch.cond(pred, _dense(fast), _dense(exact), operands)
    return fast(*operands) if bool(pred) else exact(*operands)


def _dense(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with contiguous outputs: torch.cond needs both branches' outputs laid out alike."""
    def run(*args: torch.Tensor) -> Any:
        out = fn(*args)
        return tuple(x.contiguous() for x in out) if isinstance(out, tuple) else out.contiguous()
    return run


def empty_prefix(k: torch.Tensor, v: torch.Tensor) -> PrefixState:
    """The empty prefix (a, n, m) = (-inf, 0, 0) for k [B, *, G], v [B, *, G, E]."""
    B, G, E = k.shape[0], k.shape[-1], v.shape[-1]
    return k.new_full((B, G), float("-inf")), v.new_zeros(B, G, E), k.new_zeros(B, G)


def _summary(prefix: PrefixState | None, ref: torch.Tensor) -> Summary | None:
    """(a, n, m) -> (log(e^a m) - ref, n / m); m = 0 (the empty prefix) gives (-inf, 0)."""
    if prefix is None:
        return None
    a, n, m = prefix
    tiny = torch.finfo(m.dtype).tiny
    return a + torch.log(m) - ref, n / m.clamp_min(tiny).unsqueeze(-1)


def merge(first: PrefixState, second: PrefixState) -> PrefixState:
    """Sum two (a, n, m) triples (e^a n, e^a m) over a common reference, their larger a: both
    rescalings are e^{<= 0}, so nothing overflows and the larger part keeps full precision."""
    a = torch.maximum(first[0], second[0]).detach()  # a reference only: it cancels in n / m
    f, g = torch.exp(first[0] - a), torch.exp(second[0] - a)
    return a, first[1] * f.unsqueeze(-1) + second[1] * g.unsqueeze(-1), first[2] * f + second[2] * g


def _doubling_scan(k: torch.Tensor, v: torch.Tensor) -> PrefixState:
    """Inclusive prefix triples (a, n, m) [B, L, ...] of the tokens by log2(L) doubling steps
    (Hillis-Steele) of ``merge``: exact for any key range, O(L log L) work."""
    a, n, m = k, v, torch.ones_like(k)
    step = 1
    while step < k.shape[1]:
        earlier = (F.pad(a[:, :-step], (0, 0, step, 0), value=float("-inf")),  # -inf, 0, 0: none
                   F.pad(n[:, :-step], (0, 0, 0, 0, step, 0)), F.pad(m[:, :-step], (0, 0, step, 0)))
        a, n, m = merge(earlier, (a, n, m))
        step *= 2
    return a, n, m


def _prefix(k: torch.Tensor, v: torch.Tensor, init: Summary | None) -> Summary:
    """Prefix summaries: entry i of the result summarises ``init`` and tokens 0..i-1 as
    (ell = log sum e^K, y = sum e^K V / sum e^K); entry 0 is ``init`` itself (with no init:
    ell = -inf, y = 0, the empty sum).

    k [B, L, G], v [B, L, G, E] -> ell [B, L+1, G], y [B, L+1, G, E].
    """
    carried = init is not None
    ell0 = init[0] if carried else k.new_full((k.shape[0], k.shape[2]), float("-inf"))
    ref = torch.maximum(k.detach().amax(dim=1), ell0.detach())  # [B, G]
    # Plain prefix sums of e^{K - max K} are exact while no prefix falls below the smallest
    # normal float (then every sum keeps full relative precision); the margin leaves room for
    # numerators that cancel. The smallest prefix is the first (init and token 0). Keys spread
    # wider than that take the doubling scan instead.
    margin = -math.log(torch.finfo(k.dtype).tiny) - 25.0  # 62 nats in float32, 683 in float64
    first = torch.maximum(ell0, k[:, 0]).detach()

    # The init travels as operands only when carried: torch.cond mismatched the symbolic sizes
    # of an empty one built outside its branches (tests/ops/test_compile.py).
    def unpack(k: torch.Tensor, v: torch.Tensor, init: tuple[torch.Tensor, ...]) -> Summary:
        return init if carried else empty_prefix(k, v)[:2]

    def plain(k: torch.Tensor, v: torch.Tensor, ref: torch.Tensor, *init: torch.Tensor) -> Summary:
        ell0, y0 = unpack(k, v, init)
        e = torch.exp(k - ref.unsqueeze(1))
        den, num = cumsum_time(e), cumsum_time(e.unsqueeze(-1) * v)
        if carried:  # the init's sums (0 for an empty one, never a 0 / 0)
            e0 = torch.exp(ell0 - ref)  # [B, G]
            den, num = den + e0.unsqueeze(1), num + (e0.unsqueeze(-1) * y0).unsqueeze(1)
        return _with_first(ell0, y0, torch.log(den) + ref.unsqueeze(1), num / den.unsqueeze(-1))

    def scan(k: torch.Tensor, v: torch.Tensor, ref: torch.Tensor, *init: torch.Tensor) -> Summary:
        ell0, y0 = unpack(k, v, init)
        a, n, m = _doubling_scan(k, v)
        a, n, m = merge((ell0.unsqueeze(1), y0.unsqueeze(1), torch.ones_like(a[:, :1])), (a, n, m))
        return _with_first(ell0, y0, a + torch.log(m), n / m.unsqueeze(-1))

    return _select((first - ref).amin() >= -margin, plain, scan, k, v, ref,
                   *(init if carried else ()))


SCAN_BLOCK = 64  # tokens per block of ``blocked_cumsum``


def cumsum_time(x: torch.Tensor) -> torch.Tensor:
    """The inclusive cumulative sum over time (dim 1) of x [B, L, ...]: torch's on CPU,
    ``blocked_cumsum`` on other devices."""
    return x.cumsum(dim=1) if x.device.type == "cpu" else blocked_cumsum(x)


def blocked_cumsum(x: torch.Tensor, block: int = SCAN_BLOCK) -> torch.Tensor:
    """``x.cumsum(dim=1)`` as sums within blocks of ``block`` tokens plus the running totals
    of the blocks before. The same additions in the same order within a block; what changes is
    the parallelism: CUDA's scan over a middle dimension runs one thread per remaining element
    through all L steps (B·D threads for [B, L, D], latency-bound at thousands of steps), here
    through ``block`` steps for each of L / block blocks, then L / block steps for the totals.
    x [B, L, ...] -> [B, L, ...]."""
    B, L = x.shape[:2]
    if block >= L:
        return x.cumsum(dim=1)
    N = -(-L // block)
    flat = F.pad(x.reshape(B, L, -1), (0, 0, 0, N * block - L)).view(B, N, block, -1)
    within = flat.cumsum(dim=2)
    before = F.pad(within[:, :-1, -1].cumsum(dim=1), (0, 0, 1, 0))  # totals of earlier blocks
    return (within + before.unsqueeze(2)).view(B, N * block, -1)[:, :L].view(x.shape)


def _with_first(ell0: torch.Tensor, y0: torch.Tensor, ell: torch.Tensor,
                y: torch.Tensor) -> Summary:
    """Prefix summaries of entries 1.. preceded by entry 0 (the init)."""
    return torch.cat([ell0.unsqueeze(1), ell], dim=1), torch.cat([y0.unsqueeze(1), y], dim=1)


Terms = list[tuple[torch.Tensor, torch.Tensor]]  # per window position: (logits, values)


def _windows(
    k: torch.Tensor, v: torch.Tensor, band: torch.Tensor, r_left: int, r_right: int, first: int,
) -> Terms:
    """Window [t - r_left, t + r_right] of every row t >= ``first``, one shifted slice per window
    position j (t' = t - r_left + j) with its bias added: (logits [B, Tr, G], values [B, Tr, G, E]).

    k [B, L, G], v [B, L, G, E], band [Tr|1, G|1, r_left + r_right + 1]. Positions outside the
    sequence get key -inf, so they weigh exactly 0. Slices rather than one unfolded tensor: the
    same work, without a [B, Tr, G, E, J] product or a scattering unfold backward.
    """
    k = F.pad(k, (0, 0, r_left, r_right), value=float("-inf"))
    v = F.pad(v, (0, 0, 0, 0, r_left, r_right))
    rows = k.shape[1] - r_left - r_right - first
    return [(k[:, first + j:first + j + rows] + band[..., j], v[:, first + j:first + j + rows])
            for j in range(band.shape[-1])]


def _window_blocks(
    k: torch.Tensor, v: torch.Tensor, band: torch.Tensor, r_left: int, r_right: int, first: int,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The window sums of rows ``first``..L-1 as banded matrix products (docs/maths.md 4.3), as
    (ell [B, Tr, G], y [B, Tr, G, E], ok).

    Rows go in blocks of C = ``chunk_size``: per block (and head, for a per-head band) one
    [C, C + J - 1] band matrix exp(b - row max b) times exp(K - max K) V over the block's key
    span, all blocks in one batched matmul: O(T (C + J) D) time, O(T (C + J) + T D) memory.
    The two maxima factorise each row's reference, so a row whose window holds only keys far
    below its block's maximum (a key spread over ~60 in float32) would underflow: the caller then
    sums the window position by position (``_windows``) instead.
    k [B, L, G], v [B, L, G, E], band [Tr|1, Gb, J] (Gb = 1 or G), window [t - r_left, t + r_right].
    Returns (ell, y, ok): ``ok`` (a 0-d bool tensor) is False where that could lose precision.
    """
    B, L, G = k.shape
    E = v.shape[-1]
    Gb, J = band.shape[1], band.shape[2]
    Tr = L - first
    C = min(chunk_size, Tr)
    N = -(-Tr // C)
    S = C + J - 1  # keys a block of rows can see
    extra = N * C - Tr
    k_blk = F.pad(k, (0, 0, r_left, r_right + extra), value=float("-inf"))[:, first:].unfold(1, S, C)
    v_blk = F.pad(v, (0, 0, 0, 0, r_left, r_right + extra))[:, first:].unfold(1, S, C)
    k_max = k_blk.detach().amax(dim=-1, keepdim=True)  # [B, N, G, 1]
    e = torch.exp(k_blk - k_max)  # [B, N, G, S]; 0 outside the sequence
    keys = torch.arange(first, L, device=k.device)[:, None] - r_left + torch.arange(J, device=k.device)
    b = band.masked_fill(((keys < 0) | (keys >= L)).unsqueeze(1), float("-inf"))  # [Tr, Gb, J]
    b_max = b.detach().amax(dim=-1)  # [Tr, Gb]: finite, t' = t is always in the window
    a = F.pad(torch.exp(b - b_max.unsqueeze(-1)), (0, 0, 0, 0, 0, extra))
    a = a.view(N, C, Gb, J).transpose(1, 2)  # [N, Gb, C, J]
    # Skew: shift row i right by i, so a's column i + j is key span position i + j.
    a = F.pad(a, (0, C)).flatten(-2)[..., :C * S].view(N, Gb, C, S)
    # Numerator columns e V and the denominator column e of each channel, grouped by band.
    x = torch.cat([e.unsqueeze(-2) * v_blk, e.unsqueeze(-2)], dim=-2)  # [B, N, G, E + 1, S]
    x = x.reshape(B, N, Gb, G // Gb * (E + 1), S).transpose(-1, -2)
    out = (a @ x).view(B, N, Gb, C, G // Gb, E + 1).permute(0, 1, 3, 2, 4, 5)
    out = out.reshape(B, N * C, G, E + 1)[:, :Tr]
    num, den = out[..., :E], out[..., E]
    margin = -math.log(torch.finfo(den.dtype).tiny) - 25.0  # as in _prefix
    ok = den.detach().amin() >= math.exp(-margin)
    ref = b_max + k_max.squeeze(-1).repeat_interleave(C, dim=1)[:, :Tr]  # [B, Tr, G]
    return torch.log(den) + ref, num / den.unsqueeze(-1), ok


def _window_sums(
    k: torch.Tensor, v: torch.Tensor, band: torch.Tensor, r_left: int, r_right: int, first: int,
    chunk_size: int, outside: list[Summary],
) -> torch.Tensor:
    """R of rows ``first``..L-1: their windows (banded matrix products, or position by position
    where those could lose precision) combined with the summaries of the tokens outside them."""
    ell, y, ok = _window_blocks(k, v, band, r_left, r_right, first, chunk_size)
    flat = [x for pair in outside for x in pair]

    def blocks(ell: torch.Tensor, y: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               band: torch.Tensor, *flat: torch.Tensor) -> torch.Tensor:
        return _combine([], [(ell, y), *zip(flat[::2], flat[1::2])])

    def positions(ell: torch.Tensor, y: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  band: torch.Tensor, *flat: torch.Tensor) -> torch.Tensor:
        return _combine(_windows(k, v, band, r_left, r_right, first), list(zip(flat[::2], flat[1::2])))

    return _select(ok, blocks, positions, ell, y, k, v, band, *flat)


def _combine(terms: Terms, outside: list[Summary], signs: torch.Tensor | None = None) -> torch.Tensor:
    """The ratio of a row's window terms (logits [B, T, G] and values [B, T, G, E] per window
    position) plus the summaries (ell [B, T, G], y [B, T, G, E]) of the tokens outside it (bias 0).
    ``signs`` [1|T, G|1, len(terms)] (signed AFT-conv kernels): window term j counts with sign
    signs[..., j] in the numerator only, its magnitude e^logits in both sums.

    Everything is scaled by the row's largest term rho (the window maximum or a log-sum-exp,
    which bounds its terms), a constant along t': no term exceeds 1 and the largest is 1.
    """
    parts = terms + outside
    rho = parts[0][0].detach()
    for logits, _ in parts[1:]:
        rho = torch.maximum(rho, logits.detach())
    num, den = 0.0, 0.0
    for j, (logits, values) in enumerate(parts):
        e = torch.exp(logits - rho)  # 0 for a position outside the sequence or an empty side
        signed = e * signs[..., j] if signs is not None and j < len(terms) else e
        num = num + signed.unsqueeze(-1) * values
        den = den + e
    return num / den.unsqueeze(-1)


def simple_causal(
    k: torch.Tensor, v: torch.Tensor, prefix: PrefixState | None,
) -> tuple[torch.Tensor, PrefixState]:
    """Causal AFT-simple (docs/maths.md 4.2-4.3): R_t = sum_{t' <= t} e^{K_t'} V_t' / sum_{t' <= t}
    e^{K_t'}, by prefix sums. k [B, T, G], v [B, T, G, E]; prefix (a, n, m) of the past or None.
    Returns R [B, T, G, E] and the prefix after the last token, as (log-sum-exp, mean, 1)."""
    ref = k.detach().amax(dim=1)  # [B, G]: keys relative to the call's largest (module docstring)
    ell, y = _prefix(k - ref.unsqueeze(1), v, _summary(prefix, ref))
    return y[:, 1:], (ell[:, -1] + ref, y[:, -1], torch.ones_like(ref))


def simple_bidirectional(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Bidirectional AFT-simple: every row is the softmax-over-time average of V (per channel).
    k [B, T, G], v [B, T, G, E] -> [B, T, G, E]."""
    p = torch.softmax(k, dim=1).unsqueeze(-1)  # softmax subtracts the max over t' itself
    return (p * v).sum(dim=1, keepdim=True).expand_as(v)


def banded_causal(
    k: torch.Tensor, v: torch.Tensor, band: torch.Tensor, window: int,
    state: tuple[torch.Tensor, ...] | None, chunk_size: int, *, global_context: bool = True,
    signs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Causal AFT-local / AFT-conv (docs/maths.md 4.3): row t adds e^{K_t' + b} V_t' over the window
    t - s < t' <= t (biases b from ``band``) to the prefix G_{t-s} of every token that has left
    the window (bias 0), and divides by the same sums of e^{K_t' + b}.

    k [B, T, G], v [B, T, G, E]; band [T|1, G|1, Jb] with band[..., -1 - o] the bias at offset
    o = t - t' (so the last entry is t itself), Jb >= min(s, c + T) (offsets that can exist);
    state as in the module docstring, or None.
    AFT-conv's ablations: ``global_context=False`` drops the prefix (tokens outside the window
    weigh 0 instead of e^{K_t'}); ``signs`` (laid out as ``band``) makes the window weights
    signed, numerator sign * e^{K + b}, denominator e^{K + b} (summed position by position).
    Returns R [B, T, G, E] and the state after the last token.
    """
    s = window
    T = k.shape[1]
    if state is None:
        prefix, k_cache, v_cache = None, k[:, :0], v[:, :0]
    else:
        prefix, (k_cache, v_cache) = state[:3], state[3:]
    kx, vx = torch.cat([k_cache, k], dim=1), torch.cat([v_cache, v], dim=1)  # [B, L, ...]
    c = k_cache.shape[1]
    L = c + T
    ref = kx.detach().amax(dim=1)  # [B, G]; see simple_causal
    k_rel = kx - ref.unsqueeze(1)
    ell, y = _prefix(k_rel, vx, _summary(prefix, ref))
    # Row e of the view reaches tokens <= e - s through the prefix: entry e - s + 1 (0 = none).
    out = (torch.arange(c, L, device=k.device) - s + 1).clamp_min(0)
    J = min(s, L)  # window positions that can exist
    outside = [(ell[:, out], y[:, out])] if global_context else []
    if signs is None:
        ratio = _window_sums(k_rel, vx, band[..., -J:], J - 1, 0, c, chunk_size, outside)
    else:
        ratio = _combine(_windows(k_rel, vx, band[..., -J:], J - 1, 0, c), outside,
                         signs[..., -J:])
    i = L - s + 1  # prefix entry of the next row: everything but the last s - 1 tokens
    if i > 0:
        prefix = (ell[:, i] + ref, y[:, i], torch.ones_like(ref))
    elif prefix is None:
        prefix = empty_prefix(k, v)
    keep = L - min(L, s - 1)
    return ratio, (*prefix, kx[:, keep:], vx[:, keep:])


def banded_bidirectional(
    k: torch.Tensor, v: torch.Tensor, band: torch.Tensor, r_left: int, r_right: int,
    chunk_size: int,
) -> torch.Tensor:
    """Bidirectional AFT-local / AFT-conv: row t adds the window t - r_left <= t' <= t + r_right
    (biases from ``band``) to the prefix before it and the suffix after it (bias 0).

    k [B, T, G], v [B, T, G, E]; band [T|1, G|1, r_left + r_right + 1] with band[..., j] the
    bias of t' = t - r_left + j. Returns R [B, T, G, E].
    """
    T = k.shape[1]
    k = k - k.detach().amax(dim=1, keepdim=True)  # see simple_causal
    ell_p, y_p = _prefix(k, v, None)
    ell_s, y_s = _prefix(k.flip(1), v.flip(1), None)  # suffix sums, read backwards
    t = torch.arange(T, device=k.device)
    before = (t - r_left).clamp_min(0)  # tokens <= t - r_left - 1
    after = (T - 1 - t - r_right).clamp_min(0)  # tokens >= t + r_right + 1
    lo, hi = min(r_left, T - 1), min(r_right, T - 1)  # window positions that can exist
    return _window_sums(k, v, band[..., r_left - lo:r_left + hi + 1], lo, hi, 0, chunk_size,
                        [(ell_p[:, before], y_p[:, before]), (ell_s[:, after], y_s[:, after])])
