"""Attention Free Transformer layers (docs/maths.md 4): AFT-full, AFT-local, AFT-simple, AFT-conv.

Every layer projects x to Q, V in R^{d'} and K (R^{d'}, or one channel per head for AFT-conv)
with biases, computes Y = sigmoid(Q) * (sum e^{K + w} V / sum e^{K + w}) with the ops of
``fastweights.ops.aft`` and maps Y back to d_model with an output Linear (with bias), as the
labml reference does. d' = ``d_hidden`` (d_model by default). All are causal.

Position biases of AFT-full/local are factorised, w = U V^T with U, V [max_len, d_bias]
(d_bias = 128 as ComVEX); both factors start N(0, bias_std^2) with bias_std = 0.01 (ComVEX), so
w starts within ~1e-3 of 0 (the layer starts close to AFT-simple) while both factors still get
gradients (two zero factors would never move). A sequence longer than ``max_len`` in total,
streamed past included, raises ValueError.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import (
    check_bool,
    check_choice,
    check_layer_input,
    check_nonneg_float,
    check_positive_int,
)
from ..ops import (
    RECURRENT_MODES,
    AFTConvState,
    AFTFullCache,
    AFTFullState,
    AFTLocalState,
    AFTSimpleState,
    aft,
    aft_conv,
    aft_conv_step,
    aft_local,
    aft_local_step,
    aft_step,
    merge_simple_states,
    reads_allowed,
)
from ..state_tree import cat_rows
from .base import (
    ContextParallel,
    Mixer,
    State,
    cache_buffers,
    check_stackable,
    is_step,
    merge_heads,
    split_heads,
    token_positions,
)


class _AFT(Mixer):
    """Shared projections: x -> Q [d'], K [d_key], V [d'] (one Linear with bias) and the output
    Linear d' -> d_model. Every one of the d' channels is its own single-dimensional head
    (docs/maths.md 4.1), so ``n_heads`` only matters to AFT-conv."""

    def __init__(self, d_model: int, n_heads: int, d_hidden: int | None, d_key: int | None,
                 head_dim: int, with_q: bool = True) -> None:
        super().__init__(d_model, n_heads, head_dim)
        self.d_hidden = d_model if d_hidden is None else check_positive_int("d_hidden", d_hidden)
        self.d_key = self.d_hidden if d_key is None else d_key
        self.d_query = self.d_hidden if with_q else 0  # no Q without the sigmoid(Q) gate
        self.qkv = nn.Linear(d_model, self.d_query + self.d_hidden + self.d_key)
        self.out = nn.Linear(self.d_hidden, d_model)

    def _typed_state(self, state: State, cls: type) -> State:
        """A carried state as the op's typed state ``cls`` (its items are checked by the op)."""
        if state is None:
            return None
        if not isinstance(state, (tuple, list)) or len(state) != len(cls._fields):
            raise TypeError(
                f"state must be None or the {len(cls._fields)}-tuple returned by a previous call "
                f"of this {type(self).__name__}, got {type(state).__name__}"
            )
        return cls(*state)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, d_model] -> q [B, T, d'] ([B, T, 0] without a query), k [B, T, d_key],
        v [B, T, d']."""
        return self.qkv(x).split([self.d_query, self.d_key, self.d_hidden], dim=-1)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, d_hidden={self.d_hidden}"


class _PositionBias(nn.Module):
    """w = U V^T, U and V [max_len, d_bias], both initialised N(0, std^2) (module docstring)."""

    def __init__(self, max_len: int, d_bias: int, std: float) -> None:
        super().__init__()
        self.max_len = check_positive_int("max_len", max_len)
        check_positive_int("d_bias", d_bias)
        check_nonneg_float("bias_std", std)
        self.u = nn.Parameter(torch.randn(max_len, d_bias) * std)
        self.v = nn.Parameter(torch.randn(max_len, d_bias) * std)

    def check_length(self, stop: int) -> None:
        if stop > self.max_len:
            raise ValueError(
                f"sequence length {stop} (streamed past included) exceeds max_len={self.max_len}; "
                "build the layer with a larger max_len"
            )

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """w[start:stop, :stop], the biases of rows start..stop-1 against every key so far."""
        self.check_length(stop)
        return self.u[start:stop] @ self.v[:stop].T

    def keys_row(self, position: int, window: int) -> torch.Tensor:
        """[J] with [j] = w[p, p - J + 1 + j], J = min(p + 1, s): one token's biases against the
        keys of its window in time order (a decoding step's, without ``band``'s blocks)."""
        self.check_length(position + 1)
        return self.v[max(position + 1 - window, 0):position + 1] @ self.u[position]

    def rows_at(self, positions: torch.Tensor, window: int) -> torch.Tensor:
        """[B, 1, s] with [b, 0, o] = w[p_b, p_b - o] for the positions p [B] (each >= s - 1):
        one token's window biases per row, for rows at their own positions."""
        if reads_allowed():  # (a read back to the host: eager calls only)
            self.check_length(int(positions.max()) + 1)
        keys = positions.unsqueeze(1) - torch.arange(window, device=positions.device)  # [B, s]
        return torch.einsum("bd,bsd->bs", self.u[positions], self.v[keys]).unsqueeze(1)

    def band(self, start: int, stop: int, window: int, block: int) -> torch.Tensor:
        """[T, s] with [i, o] = w[start + i, start + i - o], T = stop - start (o = t - t'; keys
        before position 0 give 0, ignored by the op). Rows go in blocks of C = ``block``: one
        [C, d_bias] x [d_bias, C + s - 1] product per block, then each row's s diagonals, so
        memory stays O(T (C + s)) instead of the T x T matrix."""
        self.check_length(stop)
        T, s = stop - start, window
        C = min(block, T)
        N = -(-T // C)
        u = F.pad(self.u[start:stop], (0, 0, 0, N * C - T)).view(N, C, -1)
        lo = start - (s - 1)  # first key any row can see; rows before position 0 are zeros
        keys = F.pad(self.v[max(lo, 0):stop], (0, 0, max(-lo, 0), N * C - T))
        spans = keys.unfold(0, C + s - 1, C)  # [N, d_bias, C + s - 1]
        x = u @ spans  # [N, C, C + s - 1]: row i against keys start + nC - (s-1) + column
        # Unskew: row i's window starts at column i; padding each row by one extra column
        # turns the diagonals into columns.
        x = F.pad(x.flatten(-2), (0, C)).view(N, C, C + s)[..., :s]  # [N, C, s], t' increasing
        return x.reshape(N * C, s)[:T].flip(-1)


class AFTFull(_AFT):
    """AFT-full (docs/maths.md 4.1): a learned bias w_tt' for every pair, factorised as U V^T.

    State: the cache ``(k [B, t, d'], v [B, t, d'])`` of every token seen (an arbitrary pairwise
    bias has no constant-size state), so ``state_size(seq_len)`` grows linearly; or, for a
    decoding step on static buffers (``static_state``), an ``AFTFullCache`` of fixed capacity,
    which continues one token per call.
    """

    static_form = "cache"  # static_state: docs/design.md, "Decoding graphs"

    def __init__(self, d_model: int, n_heads: int, *, d_hidden: int | None = None,
                 max_len: int = 1024, d_bias: int = 128, bias_std: float = 0.01,
                 chunk_size: int = 64) -> None:
        super().__init__(d_model, n_heads, d_hidden, None, head_dim=1)
        self.bias = _PositionBias(max_len, d_bias, bias_std)
        self.chunk_size = check_positive_int("chunk_size", chunk_size)

    def forward(self, x: torch.Tensor, state: State = None,
                cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, State]:
        if cu_seqlens is not None:
            # Each document attends to its own cache of its own length, with its own rows of
            # the position table (built per document: rows of different widths).
            return self._forward_per_document(x, state, cu_seqlens)
        check_layer_input(x, self.d_model)
        if isinstance(state, AFTFullCache):  # the buffers of a static decoding step
            if x.shape[1] != 1:
                raise ValueError(f"an AFTFullCache state (buffers of a decoding step) continues "
                                 f"one token per call, got T={x.shape[1]}")
            q, k, v = self._qkv(x)
            L = state.k_cache.shape[1]
            o, state = aft_step(q, k, v, self.bias.u[state.lengths] @ self.bias.v[:L].T,
                                state=state)
            return self.out(o), state
        state = self._typed_state(state, AFTFullState)
        past = 0 if state is None else state.k_cache.shape[1]
        w = self.bias.rows(past, past + x.shape[1])
        q, k, v = self._qkv(x)
        if is_step(x, cu_seqlens):
            o, state = aft_step(q, k, v, w, state=state)
        else:
            o, state = aft(q, k, v, w, initial_state=state, output_final_state=True,
                           chunk_size=self.chunk_size)
        return self.out(o), state

    def keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What x's tokens add to the (k_cache, v_cache) state: k, v [B, T, d'] (no position
        enters them; the bias rows do). Context parallelism gathers them across shards."""
        _, k, v = self._qkv(x)
        return k, v

    def context_parallel(self) -> ContextParallel:
        """Its arbitrary T x T bias needs every earlier key: all-gathered (``aft_full_gather``),
        O(T) memory, like the state itself."""
        return ContextParallel("aft_full_gather", self._gather)

    def _gather(self, shard: Any, x: torch.Tensor, state0: State) -> tuple[torch.Tensor, State]:
        K, V = shard.gather(*self.keys_values(x))
        if state0 is not None:
            K, V = torch.cat([state0[0].to(K.dtype), K], 1), torch.cat([state0[1].to(V.dtype), V], 1)
        return shard.run(x, AFTFullState(K, V) if K.shape[1] else None)

    def state_size(self, seq_len: int = 1) -> int:
        return 2 * self.d_hidden * seq_len

    def static_state(self, state: State, max_len: int) -> AFTFullCache:
        """An ``AFTFullCache`` of capacity ``max_len`` tokens (at most the layer's own
        ``max_len``, the positions its bias table has) holding the (k_cache, v_cache) a
        forward returned (every row at one length)."""
        return AFTFullCache(*cache_buffers(state, max_len, self.bias.max_len, "AFTFull"))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, max_len={self.bias.max_len}"


class AFTLocal(_AFT):
    """AFT-local (docs/maths.md 4.2): the learned bias inside a causal window of ``window`` tokens
    (0 <= t - t' < s; s = 32 as the labml reference), bias 0 (not a mask) beyond it. ``mode``
    and ``chunk_size`` pick the op's algorithm (``aft_local``), never its result.

    State ``(a, n, m [B, d'], k_cache, v_cache [B, c, d'], pos)``: the stable sums of the tokens
    that have left the window, the last c = min(pos, s - 1) tokens and the absolute position.
    ``state_size`` counts its floats once the cache is full: 3 d' + 2 (s - 1) d'.
    A decoding step (``is_step``: T = 1, not packed, one position for all rows) computes its
    token's window biases alone and runs the op's recurrence on the state it checked.
    """

    static_form = "rows"  # static_state: docs/design.md, "Decoding graphs"

    def __init__(self, d_model: int, n_heads: int, *, d_hidden: int | None = None,
                 window: int = 32, max_len: int = 1024, d_bias: int = 128,
                 bias_std: float = 0.01, mode: str = "chunk", chunk_size: int = 64) -> None:
        super().__init__(d_model, n_heads, d_hidden, None, head_dim=1)
        self.window = check_positive_int("window", window)
        self.bias = _PositionBias(max_len, d_bias, bias_std)
        self.mode = check_choice("mode", mode, RECURRENT_MODES)
        self.chunk_size = check_positive_int("chunk_size", chunk_size)

    def forward(self, x: torch.Tensor, state: State = None,
                cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, State]:
        if is_step(x, cu_seqlens):
            check_layer_input(x, self.d_model)
            state = self._typed_state(state, AFTLocalState)
            if state is None or not isinstance(state.pos, torch.Tensor):
                return self._step(x, state)
        if cu_seqlens is None:
            check_layer_input(x, self.d_model)
            state = self._typed_state(state, AFTLocalState)
            past = 0 if state is None else state.pos
            if isinstance(past, torch.Tensor):  # rows at their own positions (stack_states)
                w = self.bias.rows_at(past, self.window)
            else:
                w = self.bias.band(past, past + x.shape[1], self.window, self.chunk_size)
        else:
            bounds, states = self._documents(x, state, cu_seqlens)
            state = [self._typed_state(s, AFTLocalState) for s in states]
            # Every document counts positions from its own start (or its carried position):
            # row i of the band depends only on the absolute position p of its token, so one
            # band from position 0 to the furthest document end serves all documents.
            starts = [0 if s is None else s.pos for s in state]
            stop = max(p + b - a for p, a, b in zip(starts, bounds, bounds[1:]))
            w = self.bias.band(0, stop, self.window, self.chunk_size)
            w = w[token_positions(bounds, starts, x.device)]  # [T, s]
        q, k, v = self._qkv(x)
        o, state = aft_local(q, k, v, w, window=self.window, initial_state=state,
                             output_final_state=True, mode=self.mode,
                             chunk_size=self.chunk_size, cu_seqlens=cu_seqlens)
        return self.out(o), state

    def _step(self, x: torch.Tensor, state: AFTLocalState | None) -> tuple[torch.Tensor, State]:
        """``forward`` for one token per row at one position (see the class docstring)."""
        q, k, v = self._qkv(x)
        pos = 0 if state is None else state.pos
        row = self.bias.keys_row(pos, self.window)  # [J], J = min(pos + 1, window), time order
        w = F.pad(row, (self.window - row.shape[0], 0)).flip(-1).view(1, -1)  # [1, s], by offset
        o, final = aft_local_step(q, k, v, w, window=self.window, state=state)
        return self.out(o), final

    def state_size(self, seq_len: int = 1) -> int:
        return (3 + 2 * (self.window - 1)) * self.d_hidden

    def stack_states(self, states: Sequence[State]) -> AFTLocalState:
        """An ``AFTLocalState`` whose row i continues ``states[i]``, pos a long tensor [N] of
        the rows' own positions; every stream must have seen at least window - 1 tokens (full
        caches: rows still filling theirs would need padding the stable sums cannot hold)."""
        parts = [self._typed_state(s, AFTLocalState) for s in check_stackable(states)]
        _check_full_caches(parts, self.window)
        tensors = cat_rows([s[:5] for s in parts], "states")
        device = tensors[0].device
        pos = torch.cat([torch.as_tensor(s.pos, device=device).reshape(-1).expand(s.a.shape[0])
                         for s in parts])
        return AFTLocalState(*tensors, pos)

    def context_parallel(self) -> ContextParallel:
        """The window cache and the bias row's position are relayed rank to rank."""
        return ContextParallel.relay()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, window={self.window}, max_len={self.bias.max_len}"


class AFTSimple(_AFT):
    """AFT-simple (docs/maths.md 4.2): no position bias, Y_t = sigmoid(Q_t) * sum_{t' <= t}
    softmax_t'(K) V. State ``(a, n, m)``, each [B, d']: a constant 3 d' floats, for any sequence
    length."""

    static_form = "fixed"  # static_state: docs/design.md, "Decoding graphs"

    def __init__(self, d_model: int, n_heads: int, *, d_hidden: int | None = None,
                 mode: str = "chunk") -> None:
        super().__init__(d_model, n_heads, d_hidden, None, head_dim=1)
        self.mode = check_choice("mode", mode, RECURRENT_MODES)

    def forward(self, x: torch.Tensor, state: State = None,
                cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, State]:
        check_layer_input(x, self.d_model)
        q, k, v = self._qkv(x)
        if self.mode != "naive" and is_step(x, cu_seqlens):
            o, state = aft_step(q, k, v, state=self._typed_state(state, AFTSimpleState))
        else:
            o, state = aft(q, k, v, initial_state=state, output_final_state=True,
                           mode=self.mode, cu_seqlens=cu_seqlens)
        return self.out(o), state

    def state_size(self, seq_len: int = 1) -> int:
        return 3 * self.d_hidden

    def context_parallel(self) -> ContextParallel:
        """The max-stabilised sums (e^a n, e^a m) of the ranks before, merged
        (``aft_simple_scan``)."""
        return ContextParallel("aft_simple_scan", self._scan)

    def _scan(self, shard: Any, x: torch.Tensor, state0: State) -> tuple[torch.Tensor, State]:
        _, part = shard.run(x, None)
        gathered = shard.all_gather(list(part))
        parts = [AFTSimpleState(*g) for g in gathered[:shard.rank]]
        if state0 is not None:
            parts.insert(0, AFTSimpleState(*state0))
        if not parts:
            return shard.run(x, None)
        prefix = parts[0]
        for cur in parts[1:]:
            prefix = merge_simple_states(prefix, cur)
        return shard.run(x, AFTSimpleState(*prefix))


class AFTConv(_AFT):
    """AFT-conv (docs/maths.md 4.2), causal 1-D: ``n_heads`` heads of d'/n_heads channels, one key
    channel per head, and per head a learned kernel of ``window`` offsets (w[h, j] the bias at
    t - t' = j; bias 0 beyond). With ``reparam`` (default) the kernel is
    w_h = gamma_h (w_h - mean w_h) / sqrt(var w_h + 1e-5) + beta_h with the raw kernel N(0, 1)
    and gamma = beta = 0 at the start, as ComVEX's 1-channel BatchNorm: the layer starts as
    AFT-simple and learns the kernel's scale. Without it the raw kernel is used, starting at 0.

    State ``(a [B, H], n [B, H, Dh], m [B, H], k_cache [B, c, H], v_cache [B, c, H, Dh])``;
    ``state_size`` counts it once the cache is full: 2 H + d' + (s - 1)(H + d').

    Ablations of the paper's three ingredients (``aft_conv``; all on by default):
    ``global_context=False`` weighs tokens outside the kernel 0 (a local convolution);
    ``nonneg=False`` uses signed kernel weights c = 1 + w (w the kernel after the
    reparameterisation: the first-order expansion of AFT-conv's e^w, so both start at weight 1,
    as AFT-simple) instead of e^w; ``gating=False`` drops sigmoid(Q) and the Q projection with
    it. The first two have no ``mode="recurrent"``.
    """

    static_form = "rows"  # static_state: docs/design.md, "Decoding graphs"

    eps = 1e-5
    def __init__(self, d_model: int, n_heads: int, *, d_hidden: int | None = None,
                 window: int = 32, reparam: bool = True, mode: str = "chunk",
                 chunk_size: int = 64, global_context: bool = True, nonneg: bool = True,
                 gating: bool = True) -> None:
        d_hidden = d_model if d_hidden is None else check_positive_int("d_hidden", d_hidden)
        if d_hidden % n_heads:
            raise ValueError(f"d_hidden ({d_hidden}) must be divisible by n_heads ({n_heads})")
        self.global_context = check_bool("global_context", global_context)
        self.nonneg = check_bool("nonneg", nonneg)
        self.gating = check_bool("gating", gating)
        super().__init__(d_model, n_heads, d_hidden, n_heads, head_dim=d_hidden // n_heads,
                         with_q=gating)
        self.window = check_positive_int("window", window)
        self.reparam = check_bool("reparam", reparam)
        self.mode = check_choice("mode", mode, RECURRENT_MODES)
        if mode == "recurrent" and not (global_context and nonneg):
            raise ValueError("global_context=False and nonneg=False have no mode='recurrent'; "
                             "use mode='chunk' or 'naive'")
        self.chunk_size = check_positive_int("chunk_size", chunk_size)
        init = torch.randn(n_heads, window) if reparam else torch.zeros(n_heads, window)
        self.kernel = nn.Parameter(init)
        if reparam:
            self.gamma = nn.Parameter(torch.zeros(n_heads))
            self.beta = nn.Parameter(torch.zeros(n_heads))

    def kernel_weight(self) -> torch.Tensor:
        """The kernel the op sees, [H, s] (after the reparameterisation)."""
        if not self.reparam:
            return self.kernel
        w = self.kernel
        mean = w.mean(dim=-1, keepdim=True)
        var = w.var(dim=-1, unbiased=False, keepdim=True)
        return self.gamma[:, None] * (w - mean) / torch.sqrt(var + self.eps) + self.beta[:, None]

    def forward(self, x: torch.Tensor, state: State = None,
                cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, State]:
        check_layer_input(x, self.d_model)
        q, k, v = self._qkv(x)
        H = self.n_heads
        v = split_heads(v, H)
        q = split_heads(q, H) if self.gating else torch.zeros_like(v)  # ignored by the op
        w = self.kernel_weight()
        if (self.mode != "naive" and self.nonneg and self.global_context
                and is_step(x, cu_seqlens)):
            o, state = aft_conv_step(q, k, v, w, state=self._typed_state(state, AFTConvState),
                                     gating=self.gating)
            return self.out(merge_heads(o)), state
        o, state = aft_conv(q, k, v, w if self.nonneg else 1.0 + w,
                            initial_state=state, output_final_state=True, mode=self.mode,
                            chunk_size=self.chunk_size, cu_seqlens=cu_seqlens,
                            global_context=self.global_context, signed=not self.nonneg,
                            gating=self.gating)
        return self.out(merge_heads(o)), state

    def state_size(self, seq_len: int = 1) -> int:
        H, d = self.n_heads, self.d_hidden
        return 2 * H + d + (self.window - 1) * (H + d)

    def stack_states(self, states: Sequence[State]) -> AFTConvState:
        """An ``AFTConvState`` whose row i continues ``states[i]`` (no position to track: the
        bias depends on offsets only); every stream must have seen at least window - 1 tokens
        (full caches)."""
        parts = [self._typed_state(s, AFTConvState) for s in check_stackable(states)]
        _check_full_caches(parts, self.window)
        return cat_rows(parts, "states")

    def context_parallel(self) -> ContextParallel:
        """The convolution's cache of the last window is relayed rank to rank."""
        return ContextParallel.relay()

    def extra_repr(self) -> str:
        ablations = "".join(f", {name}=False" for name in ("global_context", "nonneg", "gating")
                            if not getattr(self, name))
        return (f"{super().extra_repr()}, n_heads={self.n_heads}, window={self.window}, "
                f"reparam={self.reparam}{ablations}")


def _check_full_caches(states: list[tuple], window: int) -> None:
    """Streams stacked for AFT-local/conv decoding hold full caches (window - 1 tokens)."""
    short = [i for i, s in enumerate(states) if s[3].shape[1] != window - 1]
    if short:
        raise ValueError(f"stack_states needs streams that have seen at least window - 1 = "
                         f"{window - 1} tokens (full caches); states {short} have fewer")
