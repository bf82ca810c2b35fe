"""Oracles for the Attention Free Transformer, written straight from docs/maths.md 4.1-4.2.

Dimension legend: B batch, T time, D channels (AFT-full/local/simple: every channel is its own
single-dimensional head), H heads and Dh channels per head (AFT-conv), s window / kernel size.
Inputs are validated and already in the compute dtype (float32/float64). Each output row is a
literal sum over t' of exp(K_t' + w_tt') V_t' / sum exp(K_t' + w_tt'), with the maximum over t'
subtracted first (a constant along the summed axis, docs/maths.md 4.4), so the oracle itself is
stable.
"""

from __future__ import annotations

import torch


def aft_naive(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor | None, causal: bool,
) -> torch.Tensor:
    """AFT-full (docs/maths.md 4.1); ``w=None`` is AFT-simple. q, k, v [B, T, D]; w [>=T, >=T] (its
    top-left T x T block is used). Causal rows sum over t' <= t. Returns [B, T, D]."""
    T = q.shape[1]
    outs = []
    for t in range(T):
        n = t + 1 if causal else T
        logits = k[:, :n] if w is None else k[:, :n] + w[t, :n, None]  # [B, n, D]
        e = torch.exp(logits - logits.amax(dim=1, keepdim=True))
        outs.append(torch.sigmoid(q[:, t]) * (e * v[:, :n]).sum(1) / e.sum(1))
    return torch.stack(outs, dim=1)


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
    """AFT-local (docs/maths.md 4.2): AFT-full with the windowed bias ``local_bias``. Returns
    [B, T, D]."""
    T = q.shape[1]
    return aft_naive(q, k, v, local_bias(w[:T, :T], window, causal), causal)


def aft_conv_naive(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, causal: bool, *,
    global_context: bool = True, signed: bool = False, gating: bool = True,
) -> torch.Tensor:
    """AFT-conv (docs/maths.md 4.2), per head h with one key channel k[..., h] shared by its Dh
    value channels: the bias of pair (t, t') is w[h, t - t'] for offsets 0..s-1 (causal) or
    w[h, t - t' + (s-1)/2] for |t - t'| <= (s-1)/2 (bidirectional, odd s), and 0 elsewhere.
    q, v [B, T, H, Dh]; k [B, T, H]; w [H, s]. Returns [B, T, H, Dh].
    Ablations (``aft_conv_stream``): ``global_context=False`` gives pairs outside the kernel
    weight 0; ``signed`` reads w as weights c (pair weight c e^{K} in the numerator, |c| e^{K} in
    the denominator, c = 1 outside the kernel); ``gating=False`` drops sigmoid(Q)."""
    T = q.shape[1]
    s = w.shape[1]
    centre = 0 if causal else (s - 1) // 2
    outs = []
    for t in range(T):
        n = t + 1 if causal else T
        j = t - torch.arange(n, device=w.device) + centre  # kernel index of each t'
        inside = (j >= 0) & (j < s)
        if signed:  # weights c inside the kernel, 1 (= bias 0) outside
            c = torch.where(inside, w[:, j.clamp(0, s - 1)], torch.ones_like(w[:, :1])).T  # [n, H]
            logits, sign = k[:, :n] + torch.log(c.abs()), torch.sign(c)
        else:
            bias = torch.where(inside, w[:, j.clamp(0, s - 1)], torch.zeros_like(w[:, :1]))  # [H, n]
            logits, sign = k[:, :n] + bias.T, 1.0  # [B, n, H]
        if not global_context:
            logits = logits.masked_fill(~inside[None, :, None], float("-inf"))
        e = torch.exp(logits - logits.amax(dim=1, keepdim=True))
        num = ((e * sign).unsqueeze(-1) * v[:, :n]).sum(1)  # [B, H, Dh]
        g = torch.sigmoid(q[:, t]) if gating else 1.0
        outs.append(g * num / e.sum(1).unsqueeze(-1))
    return torch.stack(outs, dim=1)
