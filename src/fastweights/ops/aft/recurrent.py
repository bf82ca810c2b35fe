"""Token-by-token AFT (docs/maths.md 4.3): the decoding form, with an online log-sum-exp per
channel.

Dimension legend: B batch, T time, G key channels, E value channels per key channel, s window.
Inputs ``k [B, T, G]``, ``v [B, T, G, E]`` in the compute dtype; the state layout is the one of
``chunk.py``: (a, n, m) sum the tokens that have left the window as e^a n and e^a m, with a the
running maximum of their keys, and the cache holds the last c <= s - 1 tokens.
"""

from __future__ import annotations

import torch

from .._steps import stack_time
from .chunk import PrefixState, empty_prefix


def _absorb(prefix: PrefixState, k: torch.Tensor, v: torch.Tensor) -> PrefixState:
    """Add one token (k [B, G], v [B, G, E]) to (a, n, m): the online log-sum-exp step,
    ``merge`` with the token's (k, v, 1) written out (its m = 1 needs no tensor, no product)."""
    a, n, m = prefix
    ref = torch.maximum(a, k).detach()  # a reference only: it cancels in n / m
    f, g = torch.exp(a - ref), torch.exp(k - ref)
    return ref, torch.addcmul(v * g.unsqueeze(-1), n, f.unsqueeze(-1)), torch.addcmul(g, m, f)


def simple_recurrent(
    k: torch.Tensor, v: torch.Tensor, prefix: PrefixState | None,
) -> tuple[torch.Tensor, PrefixState]:
    """n_t = n_{t-1} + e^{K_t} V_t, m_t = m_{t-1} + e^{K_t}, R_t = n_t / m_t (stably rescaled).
    Returns R [B, T, G, E] and (a, n, m) after the last token."""
    if prefix is None:
        prefix = empty_prefix(k, v)
    outs = []
    for t in range(k.shape[1]):
        prefix = _absorb(prefix, k[:, t], v[:, t])
        outs.append(prefix[1] / prefix[2].unsqueeze(-1))
    return stack_time(outs), prefix


def banded_recurrent(
    k: torch.Tensor, v: torch.Tensor, band: torch.Tensor, window: int,
    state: tuple[torch.Tensor, ...] | None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Causal AFT-local / AFT-conv one token at a time: read the window (cache + token, biases
    from band [T|1, G|1, Jb], band[..., -1 - o] the bias at offset o = t - t', as in
    ``chunk.banded_causal``; or [T|1, B, G|1, Jb], per row) plus the prefix, then move the oldest cached token into the prefix
    once it leaves the next token's window.
    Returns R [B, T, G, E] and the state after the last token."""
    s = window
    if state is None:
        prefix, k_cache, v_cache = empty_prefix(k, v), k[:, :0], v[:, :0]
    else:
        prefix, (k_cache, v_cache) = state[:3], state[3:]
    outs = []
    for t in range(k.shape[1]):
        k_cache = torch.cat([k_cache, k[:, t:t + 1]], dim=1)  # [B, J, G], J <= s
        v_cache = torch.cat([v_cache, v[:, t:t + 1]], dim=1)
        J = k_cache.shape[1]
        logits = k_cache.transpose(1, 2) + band[t if band.shape[0] > 1 else 0][..., -J:]
        a, n, m = prefix
        rho = torch.maximum(logits.detach().amax(dim=-1), a.detach())  # [B, G]
        e = torch.exp(logits - rho.unsqueeze(-1))  # [B, G, J]
        f = torch.exp(a - rho)  # weight of the prefix; 0 while it is empty
        # sum_j e_j v_j as a product and a sum (J <= s terms per channel): a batched matrix
        # product of [1, J] x [J, E] per channel would first copy the permuted cache.
        num = torch.addcmul((e.unsqueeze(-1) * v_cache.transpose(1, 2)).sum(dim=-2),
                            f.unsqueeze(-1), n)  # [B, G, E]
        outs.append(num / torch.addcmul(e.sum(dim=-1), f, m).unsqueeze(-1))
        if s == J:  # the oldest token is outside the next token's window
            prefix = _absorb(prefix, k_cache[:, 0], v_cache[:, 0])
            k_cache, v_cache = k_cache[:, 1:], v_cache[:, 1:]
    return stack_time(outs), (*prefix, k_cache, v_cache)
