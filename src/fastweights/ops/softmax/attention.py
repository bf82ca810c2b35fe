"""Softmax attention, the quadratic baseline, via PyTorch's scaled_dot_product_attention.

Dimension legend: B batch, Tq query length, Tk key length, H heads, Dk/Dv head dims.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..._checks import check_bool, check_finite_float, check_same_dtype_device, check_tensor
from .._autocast import float32_compute
from .._modes import reads_allowed

__all__ = ["KVCache", "softmax_attention", "softmax_attention_step"]


@float32_compute
def softmax_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
    scale: float | None = None, kv_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """o = softmax(scale q k^T [+ causal mask]) v. q [B, Tq, H, Dk], k [B, Tk, H, Dk],
    v [B, Tk, H, Dv] -> o [B, Tq, H, Dv]; scale defaults to 1/sqrt(Dk).

    With Tq < Tk (decoding against a KV cache) the causal mask is aligned to the end: query i
    sees keys j <= i + (Tk - Tq), i.e. the queries are the last Tq positions.

    ``kv_lengths`` (long [B], optional): row b's keys and values are only its last
    kv_lengths[b] entries, the ones before are left padding that no query sees (rows of
    different lengths in one batch, e.g. streams decoded together); 1 <= kv_lengths <= Tk, and
    with ``causal`` kv_lengths >= Tq (the queries are among the row's last entries).
    """
    check_tensor("q", q, 4, "[B, Tq, H, Dk]")
    check_tensor("k", k, 4, "[B, Tk, H, Dk]")
    check_tensor("v", v, 4, "[B, Tk, H, Dv]")
    if k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
        raise ValueError(
            f"k must have shape [B, Tk, H, Dk] with B, H, Dk = {q.shape[0]}, {q.shape[2]}, "
            f"{q.shape[3]} as in q, got {tuple(k.shape)}"
        )
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(
            f"v must have shape [B, Tk, H, Dv] with B, Tk, H = {tuple(k.shape[:3])} as in k, "
            f"got {tuple(v.shape)}"
        )
    check_same_dtype_device(q=q, k=k, v=v)
    check_bool("causal", causal)
    Tq, Tk = q.shape[1], k.shape[1]
    if min(q.shape) < 1 or min(k.shape) < 1 or v.shape[-1] < 1:
        raise ValueError(f"q, k, v must have non-empty dims, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if causal and Tq > Tk:
        raise ValueError(f"causal attention needs Tq <= Tk, got q length {Tq} and k length {Tk}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    check_finite_float("scale", scale)
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    if kv_lengths is not None:
        check_kv_lengths(kv_lengths, q.shape[0], Tq if causal else 1, Tk, q.device)
        keys = torch.arange(Tk, device=q.device)
        mask = keys >= (Tk - kv_lengths).view(-1, 1, 1, 1)  # [B, 1, 1, Tk]: not padding
        if causal:
            mask = mask & torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(Tk - Tq)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    elif causal and Tq != Tk:
        mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(Tk - Tq)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    else:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale)
    return o.transpose(1, 2)


def check_kv_lengths(lengths: object, B: int, lo: int, hi: int, device: torch.device) -> None:
    """``kv_lengths``: a long tensor [B] on the inputs' device with values in [lo, hi]."""
    if not isinstance(lengths, torch.Tensor) or lengths.dtype != torch.long \
            or lengths.shape != (B,) or lengths.device != device:
        got = (f"{lengths.dtype} {tuple(lengths.shape)} on {lengths.device}"
               if isinstance(lengths, torch.Tensor) else type(lengths).__name__)
        raise ValueError(f"kv_lengths must be a long tensor [B] = [{B}] on {device}, got {got}")
    # Reading the values syncs and branches on data, which a traced program cannot: eager only.
    if reads_allowed() and bool(((lengths < lo) | (lengths > hi)).any()):
        raise ValueError(f"kv_lengths must lie in [{lo}, {hi}] (at least the queries, at most "
                         f"Tk), got {lengths.tolist()}")


class KVCache(NamedTuple):
    """A KV cache in buffers of fixed capacity L (what a decoding step captured in a CUDA graph
    continues: fixed shapes and addresses): k_cache [B, L, H, Dk] and v_cache [B, L, H, Dv],
    row b's keys and values its first ``lengths[b]`` entries (long [B]), the rest not yet
    written. ``softmax_attention_step`` writes into the buffers in place."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    lengths: torch.Tensor


def softmax_attention_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, state: KVCache,
    scale: float | None = None,
) -> tuple[torch.Tensor, KVCache]:
    """One token of causal ``softmax_attention`` against a ``KVCache``: q, k [B, 1, H, Dk],
    v [B, 1, H, Dv]. The token's key and value are written at each row's length, into the
    state's buffers in place (a buffer, not a value: the state passed in is the one returned,
    with lengths + 1), and the query attends over the row's first lengths + 1 entries. Returns
    (o [B, 1, H, Dv] in q's dtype, the state). Shapes are checked, not the lengths' values (a
    row whose cache is full, lengths = L, is outside the buffer: the caller sizes it)."""
    check_tensor("q", q, 4, "[B, 1, H, Dk]")
    B, T, H, Dk = q.shape
    if T != 1:
        raise ValueError(f"a step takes one token: q must have shape [B, 1, H, Dk], got "
                         f"{tuple(q.shape)}")
    k_cache, v_cache, lengths = state
    check_tensor("state.k_cache", k_cache, 4, "[B, L, H, Dk]")
    L = k_cache.shape[1]
    for name, x, shape in (("k", k, (B, 1, H, Dk)), ("v", v, (B, 1, H, v.shape[-1])),
                           ("state.k_cache", k_cache, (B, L, H, Dk)),
                           ("state.v_cache", v_cache, (B, L, H, v.shape[-1]))):
        check_tensor(name, x, 4)
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)}, got {tuple(x.shape)}")
    if not (isinstance(lengths, torch.Tensor) and lengths.dtype == torch.long
            and lengths.shape == (B,)):
        raise ValueError(f"state.lengths must be a long tensor [B] = [{B}]")
    at = lengths.view(B, 1, 1, 1)
    k_cache.scatter_(1, at.expand(B, 1, H, Dk), k.to(k_cache.dtype))
    v_cache.scatter_(1, at.expand(B, 1, H, v.shape[-1]), v.to(v_cache.dtype))
    seen = torch.arange(L, device=q.device) <= at  # [B, 1, 1, L]: the row's keys, this one too
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k_cache.transpose(1, 2).to(q.dtype), v_cache.transpose(1, 2).to(q.dtype),
        attn_mask=seen, scale=Dk ** -0.5 if scale is None else scale)
    return o.transpose(1, 2), KVCache(k_cache, v_cache, lengths + 1)
