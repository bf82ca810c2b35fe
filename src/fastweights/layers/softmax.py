"""Softmax attention layer, the quadratic baseline, with a KV cache as its state."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_arg, check_bool, check_layer_input
from ..ops import KVCache, softmax_attention, softmax_attention_step
from ..state_tree import cat_rows
from .base import (
    ContextParallel,
    Mixer,
    State,
    cache_buffers,
    check_stackable,
    merge_heads,
    split_heads,
)
from .positional import RotaryFrequencies, apply_rotary


class KVCacheRows(NamedTuple):
    """A KV cache whose rows hold different numbers of tokens (streams at their own positions,
    decoded together; ``SoftmaxAttention.stack_states``): row b's keys and values are the last
    ``lengths[b]`` entries of k_cache, v_cache [B, t, H, D] (t = the longest row); the entries
    before them are left padding that attention never sees. ``lengths`` [B] long is also where
    each row's next position starts."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    lengths: torch.Tensor


class SoftmaxAttention(RotaryFrequencies, Mixer):
    """Causal multi-head softmax attention with optional rotary positions (``rope``, base
    ``rope_base``). State: ``(k_cache [B, t, H, D], v_cache [B, t, H, D])`` of every token seen
    (keys stored after rotation), so ``state_size(seq_len)`` grows linearly with ``seq_len``;
    or, for rows at different positions, a ``KVCacheRows`` (left padding and per-row lengths,
    from ``stack_states``), which continues for any T with every row at its own position."""

    def __init__(self, d_model: int, n_heads: int, *, head_dim: int | None = None,
                 rope: bool = True, rope_base: float = 10000.0, bias: bool = False) -> None:
        super().__init__(d_model, n_heads, head_dim)
        self.rope = check_bool("rope", rope)
        H, D = n_heads, self.head_dim
        self.qkv = nn.Linear(d_model, 3 * H * D, bias=bias)
        self.out = nn.Linear(H * D, d_model, bias=bias)
        if rope:
            self._init_rotary(rope_base)

    def forward(self, x: torch.Tensor, state: State = None,
                cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, State]:
        if cu_seqlens is not None:
            # softmax_attention has no document mask, and each document's KV cache has its
            # own length: one call per document.
            return self._forward_per_document(x, state, cu_seqlens)
        check_layer_input(x, self.d_model)
        if isinstance(state, KVCache):  # the buffers of a static decoding step
            if x.shape[1] != 1:
                raise ValueError(f"a KVCache state (buffers of a decoding step) continues one "
                                 f"token per call, got T={x.shape[1]}")
            q, k, v = self._project(x, state.lengths)
            o, state = softmax_attention_step(q, k, v, state=state)
            return self.out(merge_heads(o)), state
        if state is not None:
            self._check_state(state, x)
        rows = isinstance(state, KVCacheRows)
        start = 0 if state is None else state.lengths if rows else state[0].shape[1]
        q, k, v = self._project(x, start)
        if state is not None:
            k = torch.cat([state[0].to(k.dtype), k], dim=1)
            v = torch.cat([state[1].to(v.dtype), v], dim=1)
        if rows:
            lengths = state.lengths + x.shape[1]
            o = self._mix(softmax_attention, q, k, v, causal=True, kv_lengths=lengths)
            return self.out(merge_heads(o)), KVCacheRows(k, v, lengths)
        o = self._mix(softmax_attention, q, k, v, causal=True)
        return self.out(merge_heads(o)), (k, v)

    def _project(self, x: torch.Tensor, start: int | torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v [B, T, H, D] of x's tokens at absolute positions start.. (q, k rotated);
        ``start`` one int, or a long tensor [B] with each row's own."""
        q, k, v = split_heads(self.qkv(x), self.n_heads).chunk(3, dim=-1)
        if self.rope:
            if isinstance(start, torch.Tensor):
                pos = start.unsqueeze(1) + torch.arange(x.shape[1], device=x.device)  # [B, T]
            else:
                pos = torch.arange(start, start + x.shape[1], device=x.device)
            freq = self._rotary_freq(x)  # [D/2] float64
            q, k = apply_rotary(q, pos, freq), apply_rotary(k, pos, freq)
        return q, k, v

    def stack_states(self, states: Sequence[State]) -> KVCacheRows:
        """A ``KVCacheRows`` whose row i continues ``states[i]`` (a (k_cache, v_cache) pair or a
        ``KVCacheRows`` from ``forward``): caches of different lengths are left-padded with zeros
        to the longest, memory O(N x longest)."""
        states = check_stackable(states)
        parts = []
        for i, state in enumerate(states):
            if not (isinstance(state, tuple) and len(state) in (2, 3)
                    and all(isinstance(t, torch.Tensor) for t in state)):
                raise TypeError(f"states[{i}] must be a state SoftmaxAttention returned, got "
                                f"{type(state).__name__}")
            k, v = state[0], state[1]
            lengths = (state.lengths if isinstance(state, KVCacheRows)
                       else torch.full((k.shape[0],), k.shape[1], device=k.device))
            parts.append((k, v, lengths))
        t = max(k.shape[1] for k, _, _ in parts)
        k = cat_rows([F.pad(k, (0, 0, 0, 0, t - k.shape[1], 0)) for k, _, _ in parts], "k_cache")
        v = cat_rows([F.pad(v, (0, 0, 0, 0, t - v.shape[1], 0)) for _, v, _ in parts], "v_cache")
        return KVCacheRows(k, v, torch.cat([n for _, _, n in parts]))

    def static_state(self, state: State, max_len: int) -> KVCache:
        """A ``KVCache`` of capacity ``max_len`` tokens holding the (k_cache, v_cache) pair a
        forward returned (every row at one length)."""
        return KVCache(*cache_buffers(state, max_len, None, "SoftmaxAttention"))

    def keys_values(self, x: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What x's tokens, at absolute positions start.., add to the (k_cache, v_cache) state:
        k, v [B, T, H, D] (k rotated). Context parallelism gathers them across shards."""
        return self._project(x, start)[1:]

    def context_parallel(self) -> ContextParallel:
        """Every earlier (rotated) key and value, all-gathered (``softmax_gather``): O(T)
        memory, like the state itself."""
        return ContextParallel("softmax_gather", self._gather)

    def _gather(self, shard: Any, x: torch.Tensor, state0: State) -> tuple[torch.Tensor, State]:
        past = 0 if state0 is None else state0[0].shape[1]
        K, V = shard.gather(*self.keys_values(x, past + shard.offset))
        if state0 is not None:
            K, V = torch.cat([state0[0].to(K.dtype), K], 1), torch.cat([state0[1].to(V.dtype), V], 1)
        return shard.run(x, (K, V) if K.shape[1] else None)

    def _check_state(self, state: State, x: torch.Tensor) -> None:
        """``state`` is the ``(k_cache, v_cache)`` pair a previous call returned for this batch."""
        rows = isinstance(state, KVCacheRows)
        if not (isinstance(state, tuple) and (len(state) == 2 or rows)
                and all(isinstance(s, torch.Tensor) for s in state)):
            raise TypeError(
                "state must be None, the (k_cache [B, t, H, D], v_cache [B, t, H, D]) tuple "
                f"SoftmaxAttention returned or a KVCacheRows, got {type(state).__name__}"
                + (f" of length {len(state)}" if isinstance(state, tuple) else "")
            )
        expected = [x.shape[0], state[0].shape[1] if state[0].dim() == 4 else None,
                    self.n_heads, self.head_dim]
        for name, s in zip(("state[0] (k_cache)", "state[1] (v_cache)"), state[:2]):
            check_arg(name, s, expected, "[B, t, H, D]", x)
        if rows and not (state.lengths.dtype == torch.long and state.lengths.shape == (x.shape[0],)):
            raise ValueError(f"state.lengths must be a long tensor [B] = [{x.shape[0]}], got "
                             f"{state.lengths.dtype} {tuple(state.lengths.shape)}")

    def state_size(self, seq_len: int = 1) -> int:
        return 2 * self.n_heads * self.head_dim * seq_len
