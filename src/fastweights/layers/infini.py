"""Infini-attention layer (Munkhdalai et al. 2024; docs/maths.md 5): segment-local softmax attention
with rotary positions plus a compressive memory, mixed by a learned per-head gate. The
mathematics lives in ``fastweights.ops.infini``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import (
    check_bool,
    check_choice,
    check_finite_float,
    check_layer_input,
    check_nonneg_float,
    check_positive_int,
    state_dtype,
)
from ..ops import InfiniRowsState, InfiniSegmentState, infini_attention, infini_attention_step
from ..ops.infini import MODES, UPDATES
from ..state_tree import cat_rows
from .base import (
    ContextParallel,
    Mixer,
    State,
    check_stackable,
    is_step,
    merge_heads,
    packed_or_single,
    per_document,
    split_heads,
    token_positions,
)
from .positional import RotaryFrequencies


class InfiniAttention(RotaryFrequencies, Mixer):
    """Infini-attention: Q/K/V projections (one linear map, bias-free by default), per head
    causal softmax attention inside segments of ``segment_len`` tokens (default 64: a CPU-friendly
    size; the paper uses 2048 and lucidrains' code 512) and a compressive memory (M, z) with
    sigma = ELU+1, read before and written after each segment (``update`` "linear" or "delta");
    the per-head gate logit beta_h mixes them, A = sigmoid(beta_h) A_mem + (1 - sigmoid(beta_h))
    A_dot, and the concatenated heads go through an output projection.

    Positions: rotary encodings (``rope``, base ``rope_base``) on the dot-product path only, with
    segment-local positions (0 .. segment_len - 1, restarting at each segment). Softmax attention
    inside a segment only sees relative positions, so this equals global positions for that path
    while keeping the angles small; the memory receives the un-rotated q, k (the paper's figure,
    lucidrains' code). ``rope_memory=True`` feeds it the rotated ones instead (jlamprou's code);
    with segment-local positions every segment's memory keys then share one set of angles.

    Gate: ``gate_init`` (default 0.0, the paper convention, half memory and half local) is the
    initial beta_h of every head; ``gate_init=-10.0`` matches lucidrains' initialisation
    (sigmoid(10) on the local side, i.e. start almost purely local). While the memory is empty
    A_mem = 0 and the gate is still applied (docs/maths.md 5.3). ``eps`` clamps the memory
    denominators (see ``infini_attention``); ``mode`` picks the op's algorithm.

    State: the op's ``InfiniState.open_segment``, an ``InfiniSegmentState`` ``(M [B, H, D, D], z [B, H, D], k_seg, v_seg,
    k_mem_seg)`` with M, z the memory of the complete segments; the last three
    cache the open segment's (rotated) keys, values and memory keys ``[B, n, H, D]``, n <
    segment_len, so pieces and single-token steps equal the whole sequence. ``state_size()``
    counts the compressive memory, H (D^2 + D) floats, independent of the context length as in
    the paper's memory-footprint count; the open-segment cache adds at most
    (segment_len - 1) * 3 * H * D floats on top.

    A decoding step (``is_step``: T = 1, not packed) of mode "chunk" or "recurrent" from such a
    state runs the op's streaming form itself on the state checked here (the op would also
    write the open segment into a memory the layer does not carry); rows at their own places
    (``stack_states``) and mode "naive" go through the op.
    """

    static_form = "rows"  # static_state: docs/design.md, "Decoding graphs"

    def __init__(
        self, d_model: int, n_heads: int, *, head_dim: int | None = None, segment_len: int = 64,
        update: str = "linear", rope: bool = True, rope_memory: bool = False,
        rope_base: float = 10000.0, gate_init: float = 0.0, eps: float = 1e-6,
        mode: str = "chunk", bias: bool = False,
    ) -> None:
        super().__init__(d_model, n_heads, head_dim)
        self.segment_len = check_positive_int("segment_len", segment_len)
        self.update = check_choice("update", update, UPDATES)
        self.rope = check_bool("rope", rope)
        self.rope_memory = check_bool("rope_memory", rope_memory)
        if rope_memory and not rope:
            raise ValueError("rope_memory=True needs rope=True (there are no rotated q, k to give "
                             "the memory), got rope=False")
        check_finite_float("gate_init", gate_init)
        self.eps = check_nonneg_float("eps", eps)
        if self.eps == 0.0:
            raise ValueError("eps must be > 0, got 0")
        self.mode = check_choice("mode", mode, MODES)
        check_bool("bias", bias)
        H, D = n_heads, self.head_dim
        if rope and D % 2:
            raise ValueError(f"rope=True needs an even head_dim, got {D}")
        self.qkv = nn.Linear(d_model, 3 * H * D, bias=bias)
        self.out = nn.Linear(H * D, d_model, bias=bias)
        self.gate = nn.Parameter(torch.full((H,), float(gate_init)))
        if rope:
            self._init_rotary(rope_base)

    def forward(self, x: torch.Tensor, state: State = None,
                cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, State]:
        if (self.mode != "naive" and not isinstance(state, InfiniRowsState)
                and is_step(x, cu_seqlens)):
            return self._step(x, state)
        bounds, docs = self._documents(x, state, cu_seqlens)
        rows = isinstance(state, InfiniRowsState)  # rows at their own places (stack_states)
        q, k, v = split_heads(self.qkv(x), self.n_heads).chunk(3, dim=-1)  # [B, T, H, D] each
        q_mem, k_mem = q, k
        if self.rope:
            if rows:
                pos = state.fill.unsqueeze(1)  # [B, 1] (T = 1, checked by the op)
            else:
                # Segment-local positions, counted on from the open segment of the carried
                # state (of each document's own state when packed).
                starts = [InfiniSegmentState.open_len(s) for s in docs]
                pos = token_positions(bounds, starts, x.device) % self.segment_len
            q, k = self._rotate_periodic((q, k), pos, self.segment_len)
            if self.rope_memory:
                q_mem, k_mem = q, k
        o, new_state = infini_attention(
            q, k, v, self.gate, segment_len=self.segment_len, update=self.update,
            q_mem=q_mem, k_mem=k_mem, eps=self.eps, initial_state=state,
            output_final_state=True, mode=self.mode, cu_seqlens=cu_seqlens)
        if rows:
            return self.out(merge_heads(o)), new_state
        # The layer carries the 5 tensors (M_closed, z_closed, k_seg, v_seg, k_mem_seg) as a
        # NamedTuple, without InfiniState's extra attribute, for code that maps over states.
        finals = [s.open_segment for s in per_document(new_state, cu_seqlens)]
        return self.out(merge_heads(o)), packed_or_single(finals, cu_seqlens)

    def _step(self, x: torch.Tensor, state: State) -> tuple[torch.Tensor, InfiniSegmentState]:
        """``forward`` for one token per row, x [B, 1, d_model] (see the class docstring)."""
        check_layer_input(x, self.d_model)
        H, D, N = self.n_heads, self.head_dim, self.segment_len
        q, k, v = split_heads(self.qkv(x), H).chunk(3, dim=-1)  # [B, 1, H, D] each
        q_mem, k_mem = q, k
        if self.rope:
            # The token's place in its segment (modulo N: a cache too long for the segment is
            # the step's to refuse).
            r = InfiniSegmentState.open_len(state) % N
            q, k = self._rotate_periodic((q, k), slice(r, r + 1), N)
            if self.rope_memory:
                q_mem, k_mem = q, k
        o, final = infini_attention_step(
            q, k, v, self.gate, state=state, segment_len=N, update=self.update,
            scale=1.0 / math.sqrt(D), q_mem=q_mem, k_mem=k_mem, eps=self.eps)
        o = merge_heads(o)
        return self.out(o if o.dtype == x.dtype else o.to(x.dtype)), final

    def state_size(self, seq_len: int = 1) -> int:
        H, D = self.n_heads, self.head_dim
        return H * (D * D + D)

    def stack_states(self, states: Sequence[State]) -> InfiniRowsState:
        """An ``InfiniRowsState`` whose row i continues ``states[i]`` (an InfiniSegmentState or
        InfiniRowsState from ``forward``): each open segment left-padded with zeros to
        segment_len - 1 tokens, its length in ``fill``."""
        N = self.segment_len
        parts = []
        for i, state in enumerate(check_stackable(states)):
            if isinstance(state, InfiniRowsState):
                parts.append(state)
                continue
            if not (isinstance(state, tuple) and len(state) == 5):
                raise TypeError(f"states[{i}] must be a state InfiniAttention returned")
            M, z, *cache = state
            n = cache[0].shape[1]
            cache = [F.pad(c, (0, 0, 0, 0, N - 1 - n, 0)) for c in cache]
            parts.append(InfiniRowsState(M, z, *cache, torch.full((M.shape[0],), n,
                                                                 device=M.device)))
        return InfiniRowsState(*cat_rows([p[:5] for p in parts], "states"),
                               torch.cat([p.fill for p in parts]))

    def context_parallel(self) -> ContextParallel:
        """On shards starting at segment borders (others are refused): the memory (M, z) is a
        sum (linear update), or for the delta update z is a sum and, given z, M is affine in M
        (``infini_scan``)."""
        def check(shards: Any, state0: State) -> str | None:
            already = InfiniSegmentState.open_len(state0)
            return shards.border_problem(type(self).__name__, "segment", self.segment_len, already)

        return ContextParallel("infini_scan", self._infini_scan, check)

    def _infini_scan(self, shard: Any, x: torch.Tensor, state0: State
                     ) -> tuple[torch.Tensor, State]:
        B, H, D = x.shape[0], self.n_heads, self.head_dim
        sdtype = state_dtype(x.dtype)
        zeros = x.new_zeros(B, H, D, D, dtype=sdtype), x.new_zeros(B, H, D, dtype=sdtype)
        if state0 is None:
            M0, z0, first = zeros[0], zeros[1], None
        else:
            full = InfiniSegmentState.check(state0, B, H, D, D, self.segment_len, x)
            M0, z0 = full.M, full.z
            first = full._replace(M=zeros[0], z=zeros[1])  # rank 0 keeps the open segment
        empty = first if shard.rank == 0 else None
        _, part = shard.run(x, empty)
        gathered = shard.all_gather([part.z] if self.update == "delta" else [part.M, part.z])
        z_in = z0 + shard.prefix([g[-1] for g in gathered])
        if self.update == "linear":
            M_in = M0 + shard.prefix([g[0] for g in gathered])
        else:
            def run_batched(M: torch.Tensor) -> torch.Tensor:
                reps = M.shape[0] // B
                base = empty if empty is not None else InfiniSegmentState.empty(
                    zeros[0], zeros[1], B, H, D, D)
                start = InfiniSegmentState(
                    M, z_in.repeat(reps, 1, 1), *(t.repeat(reps, 1, 1, 1) for t in base[2:]))
                return shard.run(x.repeat(reps, 1, 1), start)[1].M

            M_in = shard.affine_scan(run_batched, zeros[0], M0)
        if shard.rank == 0 and state0 is not None:
            return shard.run(x, first._replace(M=M_in, z=z_in))
        return shard.run(x, (M_in, z_in))

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, segment_len={self.segment_len}, update={self.update}, "
                f"rope={self.rope}, rope_memory={self.rope_memory}")
