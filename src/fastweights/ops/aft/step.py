"""One token of each causal AFT op (docs/maths.md 4.3): ``aft_step`` (AFT-simple, or AFT-full
with a bias row), ``aft_local_step`` and ``aft_conv_step``, each on its op's typed state; and
``merge_simple_states``, the sum of two AFT-simple states (the context-parallel scan's).

A step checks shapes only, reads nothing back to the host and copies no state (a decoding
step's budget; ``torch.compile(fullgraph=True)`` traces it whole); its arithmetic is the op's
one-token call (the online log-sum-exp of ``recurrent.py``).

Dimension legend: B batch, D channels (every channel its own head), H heads and Dh channels per
head (AFT-conv), s window / kernel size, p tokens seen.
"""

from __future__ import annotations

import torch

from ..._checks import check_arg, check_tensor, state_dtype
from .._autocast import float32_compute
from .._steps import wide
from .chunk import merge
from .common import check_bias_matrix, check_btd, check_conv_qkv, check_kernel, gate
from .conv import AFTConvState
from .full import AFTFullCache, AFTFullState, AFTSimpleState
from .local import AFTLocalState, local_causal
from .naive import full_naive
from .recurrent import banded_recurrent, simple_recurrent


def _one_token(T: int, layout: str) -> None:
    if T != 1:
        raise ValueError(f"a step takes one token: q must have shape {layout} with T = 1, got "
                         f"T = {T} (the op itself takes T tokens)")


@float32_compute
def aft_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None = None, *,
    state: AFTSimpleState | AFTFullState | AFTFullCache | None = None,
) -> tuple[torch.Tensor, AFTSimpleState | AFTFullState | AFTFullCache]:
    """One token of causal ``aft``: q, k, v [B, 1, D]. ``w`` None is AFT-simple, ``state`` an
    ``AFTSimpleState`` (None: empty); with ``w`` [1, P] (the token's biases against the keys at
    positions 0..P-1, P >= p + 1) AFT-full, ``state`` an ``AFTFullState`` (the cache of the p
    tokens seen). Or AFT-full on an ``AFTFullCache`` of capacity L: ``w`` [B, L] (or [1, L]),
    row b the token's biases against the positions 0..L-1 (those past the row's
    ``lengths[b]`` ignored); the token is written at each row's length, into the buffers in
    place (the state passed in is the one returned, with lengths + 1). Shapes are checked, not
    the lengths' values (a full row, lengths = L, is outside the buffers: the caller sizes
    them). Returns (o [B, 1, D] in q's dtype, the state after the token)."""
    B, T, D = check_btd(q, k, v)
    _one_token(T, "[B, 1, D]")
    cdtype = state_dtype(q.dtype)
    kc, vc = wide(k, cdtype), wide(v, cdtype)
    if isinstance(state, AFTFullCache):
        if w is None:
            raise ValueError("an AFTFullCache is AFT-full's state: w must be given ([B, L])")
        return _cached_full_step(q, kc, vc, w, state)
    if w is None:
        prefix = None
        if state is not None:
            a, n, m = AFTSimpleState.check(state, B, D, q)
            prefix = (a, n.unsqueeze(-1), m)
        ratio, (a, n, m) = simple_recurrent(kc, vc.unsqueeze(-1), prefix)
        return gate(q, ratio.squeeze(-1)), AFTSimpleState(a, n.squeeze(-1), m)
    cache = (AFTFullState(kc[:, :0], vc[:, :0]) if state is None
             else AFTFullState.check(state, B, D, q))
    p = cache.k_cache.shape[1]
    check_bias_matrix("w", w, 1, p + 1, False, q, "[1, P]")
    k_all = torch.cat([cache.k_cache, kc], dim=1)
    v_all = torch.cat([cache.v_cache, vc], dim=1)
    ratio = full_naive(k_all, v_all.unsqueeze(-1), wide(w[:1, :p + 1], cdtype), p, True)
    return gate(q, ratio.squeeze(-1)), AFTFullState(k_all, v_all)


def _cached_full_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor,
                      cache: AFTFullCache) -> tuple[torch.Tensor, AFTFullCache]:
    """``aft_step`` on an ``AFTFullCache``: k, v [B, 1, D] already in the compute dtype."""
    B, _, D = k.shape
    k_cache, v_cache, lengths = cache
    check_tensor("state.k_cache", k_cache, 3, "[B, L, D]")
    L = k_cache.shape[1]
    for name, x in (("state.k_cache", k_cache), ("state.v_cache", v_cache)):
        check_tensor(name, x, 3, "[B, L, D]")
        if tuple(x.shape) != (B, L, D):
            raise ValueError(f"{name} must have shape [B, L, D] = [{B}, {L}, {D}], got "
                             f"{tuple(x.shape)}")
        if x.dtype != k.dtype:
            raise ValueError(f"{name} must be {k.dtype} (the compute dtype of "
                             f"{str(q.dtype).removeprefix('torch.')} inputs), got {x.dtype}")
    if not (isinstance(lengths, torch.Tensor) and lengths.dtype == torch.long
            and lengths.shape == (B,)):
        raise ValueError(f"state.lengths must be a long tensor [B] = [{B}]")
    check_tensor("w", w, 2, "[B, L]")
    if w.shape[0] not in (1, B) or w.shape[1] != L:
        raise ValueError(f"w must have shape [B, L] = [{B}, {L}] (or [1, {L}]) against an "
                         f"AFTFullCache of capacity {L}, got {tuple(w.shape)}")
    at = lengths.view(B, 1, 1)
    k_cache.scatter_(1, at.expand(B, 1, D), k)
    v_cache.scatter_(1, at.expand(B, 1, D), v)
    seen = torch.arange(L, device=k.device).view(1, L, 1) <= at  # [B, L, 1]: this token too
    logits = (k_cache + wide(w, k.dtype).unsqueeze(-1)).masked_fill(~seen, float("-inf"))
    ratio = (torch.softmax(logits, dim=1) * v_cache).sum(1, keepdim=True)  # [B, 1, D]
    return gate(q, ratio), AFTFullCache(k_cache, v_cache, lengths + 1)


@float32_compute
def aft_local_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, *, window: int,
    state: AFTLocalState | None = None,
) -> tuple[torch.Tensor, AFTLocalState]:
    """One token of causal ``aft_local``: q, k, v [B, 1, D]; w the token's window biases
    [1, window] (w[0, o] the bias at offset o = t - t'; offsets reaching before position 0 are
    not read), or [B, 1, window] for a state whose rows sit at their own positions (pos a long
    tensor [B]); ``state`` an ``AFTLocalState`` (None: empty). Returns (o [B, 1, D] in q's
    dtype, the state after the token)."""
    B, T, D = check_btd(q, k, v)
    _one_token(T, "[B, 1, D]")
    cdtype = state_dtype(q.dtype)
    pos, carried = 0, None
    if state is not None:
        a, n, m, k_cache, v_cache, pos = AFTLocalState.check(state, B, D, window, q)
        carried = (a, n.unsqueeze(-1), m, k_cache, v_cache.unsqueeze(-1))
    if isinstance(pos, torch.Tensor):
        check_tensor("w", w, 3, "[B, 1, window] (per-row positions)")
        check_arg("w", w, (B, 1, window), "[B, 1, window]", q)
        band = wide(w, cdtype).flip(-1).transpose(0, 1).unsqueeze(2)  # [1, B, 1, s], per row
    else:
        check_tensor("w", w, 2, "[1, window]")
        check_arg("w", w, (1, window), "[1, window]", q)
        band = wide(w, cdtype).flip(-1).unsqueeze(1)  # [1, 1, s], band[..., -1 - o] = w[:, o]
    return local_causal(q, k, v, band, window, carried, pos, "recurrent", 1)


@float32_compute
def aft_conv_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, *,
    state: AFTConvState | None = None, gating: bool = True,
) -> tuple[torch.Tensor, AFTConvState]:
    """One token of causal ``aft_conv`` (its default form: global context, non-negative
    weights e^w): q, v [B, 1, H, Dh], k [B, 1, H], w the kernel [H, s] (w[h, j] the bias at
    offset j), ``state`` an ``AFTConvState`` (None: empty); ``gating=False`` returns the ratio
    ungated (q ignored). Returns (o [B, 1, H, Dh] in q's dtype, the state after the token)."""
    B, T, H, Dh = check_conv_qkv(q, k, v)
    _one_token(T, "[B, 1, H, Dh]")
    s = check_kernel(w, H, q)
    cdtype = state_dtype(q.dtype)
    carried = None if state is None else AFTConvState.check(state, B, H, Dh, s, q)
    kernel = wide(w, cdtype).flip(-1).unsqueeze(0)  # [1, H, s], kernel[..., -1 - o] = w[:, o]
    ratio, final = banded_recurrent(wide(k, cdtype), wide(v, cdtype), kernel, s, carried)
    o = gate(q, ratio) if gating else ratio.to(q.dtype)
    return o, AFTConvState(*final)


def merge_simple_states(first: AFTSimpleState, second: AFTSimpleState) -> AFTSimpleState:
    """The AFT-simple state of two stretches of tokens, one after the other (the sums e^a n,
    e^a m add; each [B, D]): what a context-parallel scan combines."""
    a, n, m = merge((first[0], first[1].unsqueeze(-1), first[2]),
                    (second[0], second[1].unsqueeze(-1), second[2]))
    return AFTSimpleState(a, n.squeeze(-1), m)
