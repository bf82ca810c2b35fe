"""Oracles for the Attention Free Transformer, written straight from docs/maths.md 4.1-4.3: the
``mode="naive"`` form of every AFT op, and the references the tests compare the fast forms with.

Dimension legend: B batch, T time, L tokens in view (the cached past and the call's T), D channels
(AFT-full/local/simple: every channel is its own single-dimensional head), H heads and Dh channels
per head (AFT-conv), G key channels and E value channels per key channel (the ops' common layout:
G = D, E = 1, or G = H, E = Dh), J band width, s window / kernel size. Inputs are validated and
already in the compute dtype (float32/float64). Each output row is a literal sum over t' of
exp(K_t' + w_tt') V_t' / sum exp(K_t' + w_tt'), with the maximum over t' subtracted first (a
constant along the summed axis, docs/maths.md 4.4), so the oracle itself is stable.
"""

from __future__ import annotations

import torch


def full_naive(
    k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None, first: int, causal: bool,
) -> torch.Tensor:
    """AFT-full (docs/maths.md 4.1; ``w=None``: AFT-simple) rows ``first``..L-1: k [B, L, G],
    v [B, L, G, E], the first ``first`` tokens a cached past; w [>= L - first, >= L] with row i the
    biases of token first + i against key positions 0..L-1. Causal rows sum over t' <= t.
    Returns R [B, L - first, G, E]."""
    L = k.shape[1]
    outs = []
    for i in range(L - first):
        n = first + i + 1 if causal else L
        logits = k[:, :n] if w is None else k[:, :n] + w[i, :n, None]  # [B, n, G]
        e = torch.exp(logits - logits.amax(dim=1, keepdim=True)).unsqueeze(-1)
        outs.append((e * v[:, :n]).sum(1) / e.sum(1))
    return torch.stack(outs, dim=1)


def aft_naive(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None, causal: bool,
) -> torch.Tensor:
    """AFT-full (docs/maths.md 4.1); ``w=None`` is AFT-simple. q, k, v [B, T, D]; w [>=T, >=T] (its
    top-left T x T block is used). Causal rows sum over t' <= t. Returns [B, T, D]."""
    return torch.sigmoid(q) * full_naive(k, v.unsqueeze(-1), w, 0, causal).squeeze(-1)


def local_bias(w: torch.Tensor, window: int, causal: bool) -> torch.Tensor:
    """docs/maths.md 4.2: w'_tt' = w_tt' inside the window (0 <= t - t' < s causal, |t - t'| < s
    otherwise) and 0 outside it (the pair still contributes, it is not masked). w [T, T]."""
    T = w.shape[0]
    offset = torch.arange(T)[:, None] - torch.arange(T)[None, :]  # t - t'
    inside = (offset >= 0) & (offset < window) if causal else offset.abs() < window
    return torch.where(inside.to(w.device), w, torch.zeros_like(w))


def aft_local_naive(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, window: int,
    causal: bool,
) -> torch.Tensor:
    """AFT-local (docs/maths.md 4.2) from the whole [>=T, >=T] table of pairwise biases: AFT-full
    with the windowed bias ``local_bias``. Returns [B, T, D]."""
    T = q.shape[1]
    return aft_naive(q, k, v, local_bias(w[:T, :T], window, causal), causal)


def banded_naive(
    k: torch.Tensor, v: torch.Tensor, band: torch.Tensor, centre: int, causal: bool, window: int,
    state: tuple[torch.Tensor, ...] | None, *, global_context: bool = True, signed: bool = False,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """AFT-local, AFT-conv and AFT-simple (docs/maths.md 4.2-4.3) from their band of biases, with
    the past as a state.

    k [B, T, G], v [B, T, G, E]; band [T|1, B|1, G|1, J]: band[i, ..., o + centre] is the bias of
    row i's pair at offset o = t - t' where 0 <= o + centre < J; every other pair counts with
    bias 0 (its e^{K_t'}), or not at all with ``global_context=False``. ``signed``: the band holds
    weights c instead, c e^{K} in the numerator and |c| e^{K} in the denominator (weight 1
    outside the band). Causal rows see the state and the tokens up to themselves; bidirectional
    rows every token of the call (no state).

    The state (causal; None = nothing seen): (a, n, m [B, G(, E)], k_cache [B, c, G], v_cache
    [B, c, G, E]): e^a n and e^a m sum e^K V and e^K over the tokens before the cache, all
    outside every later window; the cache holds the last c <= window - 1 tokens.
    Returns R [B, T, G, E] and, causal, the state after the tokens (a the largest key summed)."""
    B, T, G = k.shape
    J = band.shape[-1]
    if state is None:
        a, n, m = k.new_full((B, G), float("-inf")), v.new_zeros(B, G, v.shape[-1]), k.new_zeros(B, G)
        k_cache, v_cache = k[:, :0], v[:, :0]
    else:
        a, n, m, k_cache, v_cache = state
    kx, vx = torch.cat([k_cache, k], dim=1), torch.cat([v_cache, v], dim=1)  # [B, L, ...]
    c, L = k_cache.shape[1], k_cache.shape[1] + T
    outs = []
    for i in range(T):
        n_keys = c + i + 1 if causal else L
        o = c + i - torch.arange(n_keys, device=k.device)  # offset t - t' of every key in view
        j = o + centre
        inside = (j >= 0) & (j < J)
        b = band[i if band.shape[0] > 1 else 0][..., j.clamp(0, J - 1)].transpose(-1, -2)
        b = torch.where(inside[:, None], b, 1.0 if signed else 0.0)  # [B|1, n_keys, G|1]
        logits = kx[:, :n_keys] + (torch.log(b.abs()) if signed else b)
        if not global_context:
            logits = logits.masked_fill(~inside[:, None], float("-inf"))
        past = causal and global_context  # the summed tokens before the cache, bias 0
        top = logits.detach().amax(dim=1)
        top = torch.maximum(top, a.detach()) if past else top
        e = torch.exp(logits - top.unsqueeze(1))  # [B, n_keys, G]
        num = ((e * torch.sign(b) if signed else e).unsqueeze(-1) * vx[:, :n_keys]).sum(1)
        den = e.sum(1)
        if past:
            f = torch.exp(a - top)  # 0 while nothing is summed
            num, den = num + f.unsqueeze(-1) * n, den + f * m
        outs.append(num / den.unsqueeze(-1))
    R = torch.stack(outs, dim=1)
    if not causal:
        return R, None
    keep = L - min(L, window - 1)  # tokens that leave the cache for the sums
    if keep > 0:
        top = torch.maximum(a, kx[:, :keep].amax(dim=1)).detach()
        f, e = torch.exp(a - top), torch.exp(kx[:, :keep] - top.unsqueeze(1))
        a, m = top, f * m + e.sum(1)
        n = f.unsqueeze(-1) * n + (e.unsqueeze(-1) * vx[:, :keep]).sum(1)
    return R, (a, n, m, kx[:, keep:], vx[:, keep:])


def aft_conv_naive(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, causal: bool, *,
    global_context: bool = True, signed: bool = False, gating: bool = True,
) -> torch.Tensor:
    """AFT-conv (docs/maths.md 4.2), per head h with one key channel k[..., h] shared by its Dh
    value channels: the bias of pair (t, t') is w[h, t - t'] for offsets 0..s-1 (causal) or
    w[h, t - t' + (s-1)/2] for |t - t'| <= (s-1)/2 (bidirectional, odd s), and 0 elsewhere.
    q, v [B, T, H, Dh]; k [B, T, H]; w [H, s]. Returns [B, T, H, Dh].
    Ablations (``aft_conv``): ``global_context=False`` gives pairs outside the kernel weight 0;
    ``signed`` reads w as weights c (pair weight c e^{K} in the numerator, |c| e^{K} in the
    denominator, c = 1 outside the kernel); ``gating=False`` drops sigmoid(Q)."""
    s = w.shape[1]
    R, _ = banded_naive(k, v, w[None, None], 0 if causal else (s - 1) // 2, causal, s, None,
                        global_context=global_context, signed=signed)
    return torch.sigmoid(q) * R if gating else R
