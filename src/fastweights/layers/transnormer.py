"""TransNormer layers (docs/maths.md 3): NormAttention (global, linear), DiagAttention (local,
block-diagonal), their LRPE positions and the TransNormerLLM decay variant (SRMSNorm is
``layers/norms.py``'s).
The mathematics lives in ``fastweights.ops.transnormer`` and ``fastweights.ops.linear_attn``.

Dimension legend: B batch, T time, H heads, D head dim, w block size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import (
    check_bool,
    check_choice,
    check_layer_input,
    check_nonneg_float,
    check_positive_int,
    check_shape,
    check_tensor,
    is_int,
    state_dtype,
)
from ..ops import (
    RECURRENT_MODES,
    block_attention,
    decay_linear_attn,
    decay_linear_attn_step,
    linear_attn,
    open_block_attention,
    srms_norm,
)
from ..ops.feature_maps import elu_plus_one
from ..ops.transnormer import KERNELS
from ..state_tree import cat_rows
from .base import (
    ContextParallel,
    Mixer,
    State,
    check_backend,
    check_stackable,
    is_step,
    like_values,
    merge_heads,
    packed_or_single,
    per_document,
    split_heads,
    token_positions,
)
from .positional import rotary_inv_freq, rotate_pairs

ACTIVATIONS = {
    "1+elu": elu_plus_one,
    "elu": F.elu,
    "silu": F.silu,
    "relu": F.relu,
    "identity": lambda x: x,
}
HALF = (torch.float16, torch.bfloat16)


class LRPE(nn.Module):
    """Learned-frequency relative positions (docs/maths.md 3.3): x -> RoPE_theta(H x) per head.

    H = I - 2 v v^T is a Householder reflection with a fixed random unit v (a buffer, saved with
    the weights, not learned); the rotary frequencies theta_i (init base^{-2i/D}) are learned.
    Both are shared by all heads. H is orthogonal, so RoPE(H q)_i . RoPE(H k)_j depends on i - j
    only. An odd head dim leaves its last coordinate unrotated (still relative).
    """

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        check_positive_int("head_dim", head_dim)
        if head_dim < 2:
            raise ValueError(f"LRPE needs head_dim >= 2 to rotate a pair, got {head_dim}")
        v = torch.randn(head_dim, dtype=torch.float64)
        self.register_buffer("householder", (v / v.norm()).float())
        self.theta = nn.Parameter(rotary_inv_freq(head_dim - head_dim % 2, base))

    def forward(self, x: torch.Tensor, positions: torch.Tensor | int) -> torch.Tensor:
        """x [B, T, H, D] -> [B, T, H, D] in x's dtype, token t at ``positions[t]`` ([T]), at
        ``positions[b, t]`` ([B, T]: rows at their own places), or at ``positions + t`` (an
        int: every row from one place, as a decoding step at a sequence-global position)."""
        cdtype = state_dtype(x.dtype)
        xc = x if x.dtype == cdtype else x.to(cdtype)
        u = self.householder
        u = u if u.dtype == cdtype else u.to(cdtype)
        # Renormalise in the compute dtype: the stored float32 v is unit only to ~1e-8, and
        # H = I - 2uu^T is orthogonal exactly when u is a unit vector.
        u = u / u.norm()
        hx = torch.addcmul(xc, (xc @ u).unsqueeze(-1), u, value=-2.0)  # H x = x - 2 (x.u) u
        n = self.theta.shape[0] * 2
        theta = self.theta if self.theta.dtype == cdtype else self.theta.to(cdtype)
        if not isinstance(positions, torch.Tensor) and x.shape[1] == 1:
            angles = (theta * positions).unsqueeze(0)  # [T = 1, D/2], no position tensor built
        else:
            if not isinstance(positions, torch.Tensor):
                positions = torch.arange(positions, positions + x.shape[1], device=x.device)
            angles = positions.to(cdtype).unsqueeze(-1) * theta  # [(B,) T, D/2]
        if n < x.shape[-1]:
            rotated = torch.cat([rotate_pairs(hx[..., :n], angles.cos(), angles.sin()),
                                 hx[..., n:]], dim=-1)
        else:
            rotated = rotate_pairs(hx, angles.cos(), angles.sin())
        return rotated if rotated.dtype == x.dtype else rotated.to(x.dtype)

    def pair(self, q: torch.Tensor, k: torch.Tensor,
             positions: torch.Tensor | int) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(q, positions), self(k, positions)) for q, k [B, T, H, D]. A one-token step
        (T = 1) takes them through as one tensor [B, 1, 2H, D]: its cost is the number of
        operations, not their size."""
        if q.shape[1] != 1 or q.shape != k.shape:
            return self(q, positions), self(k, positions)
        both = self(torch.cat((q, k), dim=2), positions)
        return both[:, :, :q.shape[2]], both[:, :, q.shape[2]:]


def alibi_slopes(n_heads: int) -> list[float]:
    """ALiBi slopes s_h = 2^{-8h/H}, h = 1..H, for H a power of two; otherwise the slopes of
    the largest power of two p < H followed by every other slope of 2p (Press et al.)."""
    check_positive_int("n_heads", n_heads)
    p = 2 ** math.floor(math.log2(n_heads))
    slopes = [2.0 ** (-8.0 * h / p) for h in range(1, p + 1)]
    if p < n_heads:
        slopes += [2.0 ** (-8.0 * h / (2 * p)) for h in range(1, 2 * p + 1, 2)][: n_heads - p]
    return slopes


def _qkv_projections(module: nn.Module, d_model: int, width: int) -> None:
    """Q/K/V/out projections with biases; xavier_uniform with gain 1/sqrt(2) on W_Q, W_K, W_V
    and plain xavier with a zero bias on W_out (docs/maths.md 3.1)."""
    module.q_proj = nn.Linear(d_model, width)
    module.k_proj = nn.Linear(d_model, width)
    module.v_proj = nn.Linear(d_model, width)
    module.out = nn.Linear(width, d_model)
    for lin in (module.q_proj, module.k_proj, module.v_proj):
        nn.init.xavier_uniform_(lin.weight, gain=1.0 / math.sqrt(2.0))
    nn.init.xavier_uniform_(module.out.weight)
    nn.init.zeros_(module.out.bias)


class NormAttention(Mixer):
    """TransNormer's global linear attention (docs/maths.md 3.1): q = act(x W_Q + b),
    k = act(x W_K + b), v = x W_V + b, LRPE on q and k with sequence-global positions (``lrpe``),
    un-normalised causal linear attention o_t = q_t sum_{s<=t} k_s^T v_s (no 1/sqrt(D), no
    denominator), SRMSNorm over the concatenated heads, then W_out.

    ``activation``: ``"1+elu"`` (default, T2, the paper's better model), ``"elu"`` (T1), also
    ``"silu"``, ``"relu"``, ``"identity"``. ``decay=True`` gives the TransNormerLLM / Lightning
    variant (docs/maths.md 3.5): S_t = lambda_h S_{t-1} + k_t^T v_t with
    lambda_h = exp(-decay_scale * s_h), s_h the ALiBi slopes (TransNormerLLM uses
    decay_scale = 1 - l/(L-1) + 1e-5 in layer l), and the output norm -> sigmoid(x W_g + b_g)
    gate -> W_out. ``mode``/``chunk_size``/``backend`` go to the op.

    State: ``(S [B, H, D, D] float32/float64, position: int)``; the position keeps LRPE
    sequence-global when the sequence is fed in pieces. ``decay_values`` holds the lambda_h.
    A decoding step (``is_step``: T = 1, not packed) of mode "chunk" or "recurrent" runs the
    recurrence itself on the state checked here, q and k side by side through one activation
    and one LRPE pass; mode "naive" always takes the op's oracle.
    """

    static_form = "rows"  # static_state: docs/design.md, "Decoding graphs"

    def __init__(
        self, d_model: int, n_heads: int, *, head_dim: int | None = None,
        activation: str = "1+elu", lrpe: bool = True, decay: bool = False,
        decay_scale: float = 1.0, mode: str = "chunk", chunk_size: int = 64,
        backend: str | None = None,
    ) -> None:
        super().__init__(d_model, n_heads, head_dim)
        self.backend = check_backend(backend)
        self.activation = check_choice("activation", activation, ACTIVATIONS)
        check_bool("lrpe", lrpe)
        check_bool("decay", decay)
        self.decay_scale = check_nonneg_float("decay_scale", decay_scale)
        self.mode = check_choice("mode", mode, RECURRENT_MODES)
        self.chunk_size = check_positive_int("chunk_size", chunk_size)
        H, D = n_heads, self.head_dim
        _qkv_projections(self, d_model, H * D)
        self.lrpe = LRPE(D) if lrpe else None
        # Plain floats rather than a buffer: module.to(bfloat16) would round lambda = 0.996 to 1.
        self.decay_values = (
            tuple(math.exp(-self.decay_scale * s) for s in alibi_slopes(H)) if decay else None
        )
        if decay:
            self.gate = nn.Linear(d_model, H * D)

    def forward(self, x: torch.Tensor, state: State = None,
                cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, State]:
        if self.mode != "naive" and is_step(x, cu_seqlens):
            return self._step(x, state)
        bounds, docs = self._documents(x, state, cu_seqlens)
        S, pos = zip(*(NormState.check(s) for s in docs))  # per document
        H = self.n_heads
        act = ACTIVATIONS[self.activation]
        q = act(split_heads(self.q_proj(x), H))
        k = act(split_heads(self.k_proj(x), H))
        v = split_heads(self.v_proj(x), H)
        if self.lrpe is not None:
            if isinstance(pos[0], torch.Tensor):
                if cu_seqlens is not None:
                    raise ValueError("states with per-row positions (stack_states) cannot be "
                                     "packed with cu_seqlens")
                positions = pos[0].unsqueeze(1)  # [B, 1]
                if x.shape[1] > 1:
                    positions = positions + torch.arange(x.shape[1], device=x.device)
            elif cu_seqlens is None:
                positions = pos[0]  # sequence-global: the first token's place
            else:
                # Sequence-global positions, restarting at every document.
                positions = token_positions(bounds, pos, x.device)
            q, k = self.lrpe.pair(q, k, positions)
        q, k = like_values(v, q, k)  # mixed precision: layers/base.py
        if v.dtype == torch.float16:
            # Without a denominator o_t grows like t (docs/maths.md 3.6): keep it in float32 until
            # SRMSNorm has brought it back to RMS 1, or float16 overflows on long sequences
            # (bfloat16 has float32's range: its operands stay bfloat16, for the kernels).
            q, k, v = q.float(), k.float(), v.float()
        opts = {"output_final_state": True, "mode": self.mode, "chunk_size": self.chunk_size,
                "cu_seqlens": cu_seqlens, "backend": self.backend}
        if self.decay_values is not None:
            lam = self._decay(state_dtype(q.dtype), q.device)
            o, final = decay_linear_attn(q, k, v, lam, initial_state=packed_or_single(S, cu_seqlens),
                                         **opts)
            S = per_document(final, cu_seqlens)
        else:
            # linear_attn carries (S, z); z is unused without the normaliser.
            init = packed_or_single([_with_z(s) for s in S], cu_seqlens)
            o, final = self._mix(linear_attn, q, k, v, normalize=False, initial_state=init, **opts)
            S = [s for s, _ in per_document(final, cu_seqlens)]
        o = srms_norm(merge_heads(o))
        if self.decay_values is not None:
            o = o * torch.sigmoid(self.gate(x)).to(o.dtype)
        finals = [NormState(s, p + b - a) for s, p, a, b in zip(S, pos, bounds, bounds[1:])]
        return self.out(o.to(x.dtype)), packed_or_single(finals, cu_seqlens)

    def _step(self, x: torch.Tensor, state: State) -> tuple[torch.Tensor, NormState]:
        """``forward`` for one token per row, x [B, 1, d_model] (see the class docstring)."""
        check_layer_input(x, self.d_model)
        S, pos = NormState.check(state)
        H = self.n_heads
        sdtype = state_dtype(x.dtype)
        qk = ACTIVATIONS[self.activation](
            split_heads(torch.cat((self.q_proj(x), self.k_proj(x)), dim=-1), 2 * H))
        if self.lrpe is not None:
            qk = self.lrpe(qk, pos.unsqueeze(1) if isinstance(pos, torch.Tensor) else pos)
        v = split_heads(self.v_proj(x), H)
        if qk.dtype != sdtype:  # half inputs: see forward
            qk, v = qk.to(sdtype), v.to(sdtype)
        lam = None if self.decay_values is None else self._decay(sdtype, x.device)
        o, S = decay_linear_attn_step(qk[:, :, :H], qk[:, :, H:], v, lam, state=S)
        o = srms_norm(merge_heads(o))
        if self.decay_values is not None:
            o = o * torch.sigmoid(self.gate(x)).to(o.dtype)
        return self.out(o if o.dtype == x.dtype else o.to(x.dtype)), NormState(S, pos + 1)

    def _decay(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The lambda_h [H] as a tensor, kept per (dtype, device): made from the floats once, not
        every step (a copy from the host each time; a captured CUDA graph cannot make one). Not
        kept while tracing (the table would hold the tracer's tensors)."""
        if torch.compiler.is_compiling():
            return torch.tensor(self.decay_values, dtype=dtype, device=device)
        kept = self.__dict__.setdefault("_decays", {})
        lam = kept.get((dtype, device))
        if lam is None:
            lam = kept[(dtype, device)] = torch.tensor(self.decay_values, dtype=dtype,
                                                       device=device)
        return lam

    def state_size(self, seq_len: int = 1) -> int:
        return self.n_heads * self.head_dim * self.head_dim

    def stack_states(self, states: Sequence[State]) -> NormState:
        """A ``NormState`` whose row i continues ``states[i]``: S stacked, the positions a long
        tensor [N] (each row's own LRPE position)."""
        parts = [NormState.check(s) for s in check_stackable(states)]
        S = cat_rows([s.S for s in parts], "S")
        pos = torch.cat([torch.as_tensor(s.pos, device=S.device).reshape(-1).expand(s.S.shape[0])
                         for s in parts])
        return NormState(S, pos)

    def context_parallel(self) -> ContextParallel:
        """TransNormer's global attention: S_out = lambda^T S_in + B (lambda = 1 without
        decay), a scan with per-head scalars; the state's position is the shard's global
        offset."""
        return ContextParallel("decay_scan", self._decay_scan)

    def _decay_scan(self, shard: Any, x: torch.Tensor, state0: State) -> tuple[torch.Tensor, State]:
        B, H, D = x.shape[0], self.n_heads, self.head_dim
        S0, pos0 = NormState.check(state0)
        zero = x.new_zeros(B, H, D, D, dtype=state_dtype(x.dtype))
        S0 = zero if S0 is None else S0.to(zero.dtype)
        _, part = shard.run(x, NormState(zero, pos0 + shard.offset))
        gathered = shard.all_gather([part.S])
        lam = torch.tensor(self.decay_values or (1.0,) * H, dtype=zero.dtype, device=x.device)
        As = [lam.pow(n)[:, None, None] for n in shard.lengths]
        S_in = shard.fold(As, [g[0] for g in gathered], S0)
        return shard.run(x, NormState(S_in, pos0 + shard.offset))

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, activation={self.activation}, "
                f"lrpe={self.lrpe is not None}, decay={self.decay_values is not None}")


def _with_z(S: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """linear_attn's (S, z) state for NormAttention's S (no normaliser, so z = 0)."""
    return None if S is None else (S, S.new_zeros(S.shape[:-1]))


class NormState(NamedTuple):
    """NormAttention's state: the fast weights S [B, H, D, D] (float32 or wider) and the
    absolute position of the next token, which keeps LRPE sequence-global across pieces: an
    int, or a long tensor [B] for rows at their own positions (``stack_states``)."""

    S: torch.Tensor | None
    pos: int | torch.Tensor

    @classmethod
    def check(cls, state: Any) -> NormState:
        """A carried state, or the empty one for None (S is then None, position 0)."""
        if state is None:
            return cls(None, 0)
        if not isinstance(state, (tuple, list)) or len(state) != 2:
            raise TypeError("state must be None or the (S [B, H, D, D], position) tuple NormAttention returned")
        S, pos = state
        check_tensor("state[0] (S)", S, 4, "[B, H, D, D]")
        if isinstance(pos, torch.Tensor):
            if pos.dtype != torch.long or pos.shape != S.shape[:1]:
                raise TypeError(f"state[1] (position) given per row must be a long tensor [B] = "
                                f"[{S.shape[0]}], got {pos.dtype} {tuple(pos.shape)}")
        elif not is_int(pos) or pos < 0:
            raise TypeError(f"state[1] (position) must be an int >= 0 or a long tensor [B] of "
                            f"per-row positions, got {pos!r}")
        return cls(S, pos)


class DiagState(NamedTuple):
    """DiagAttention's state: the keys (after LRPE) and values of the r < block_size tokens of
    the still open block, k_open and v_open [B, r, H, D] in float32 or wider."""

    k_open: torch.Tensor
    v_open: torch.Tensor

    @classmethod
    def check(cls, state: Any, B: int | None, H: int, D: int, w: int) -> DiagState | None:
        """A carried state for a batch of B (None: any; a None state stays None) and blocks of
        w tokens (so r < w)."""
        if state is None:
            return None
        if not isinstance(state, (tuple, list)) or len(state) != 2:
            raise TypeError("state must be None or the (k_open, v_open) tuple DiagAttention returned")
        for i, name in enumerate(cls._fields):
            check_tensor(f"state[{i}] ({name})", state[i], 4, "[B, r, H, D]")
            check_shape(f"state[{i}] ({name})", state[i], (B, state[0].shape[1], H, D),
                        "[B, r, H, D]")
        if state[0].shape[1] >= w:
            raise ValueError(f"state[0] (k_open) holds the r tokens of the open block, so r must "
                             f"be < block_size = {w}, got shape {tuple(state[0].shape)}")
        return cls(*state)


class DiagRowsState(NamedTuple):
    """DiagAttention's state for rows at different places in their blocks (streams decoded
    together, ``DiagAttention.stack_states``): the keys (after LRPE) and values of the last
    block_size - 1 tokens, k_open and v_open [B, block_size - 1, H, D] (float32 or wider), of
    which row b's open block is the last ``fill[b]`` (long [B], 0 <= fill < block_size); the
    rest is padding. It continues one token per call (T = 1)."""

    k_open: torch.Tensor
    v_open: torch.Tensor
    fill: torch.Tensor


class DiagAttention(Mixer):
    """TransNormer's local attention (docs/maths.md 3.2): causal attention inside non-overlapping
    blocks of ``block_size`` tokens (block-local LRPE when ``lrpe``), nothing crosses a block
    border.

    ``kernel="softmax"`` (default, T2): softmax(q k^T / sqrt(D)) v, no norm. ``kernel="relu"``
    (T1): relu(q k^T / sqrt(D)) v, then SRMSNorm over the concatenated heads. No activation on
    q and k. Q/K/V/out projections and their init as in NormAttention.

    State: ``(k_open [B, r, H, D], v_open [B, r, H, D])``, the keys (after LRPE) and values of
    the r < block_size tokens of the still open block, kept in float32 or wider. Blocks start at
    the beginning of the sequence, so r is also the position inside the block.
    ``state_size()`` reports the largest such state, 2 H D (block_size - 1).
    """

    static_form = "rows"  # static_state: docs/design.md, "Decoding graphs"

    def __init__(
        self, d_model: int, n_heads: int, *, head_dim: int | None = None, block_size: int = 64,
        kernel: str = "softmax", lrpe: bool = True,
    ) -> None:
        super().__init__(d_model, n_heads, head_dim)
        self.block_size = check_positive_int("block_size", block_size)
        self.kernel = check_choice("kernel", kernel, KERNELS)
        check_bool("lrpe", lrpe)
        _qkv_projections(self, d_model, n_heads * self.head_dim)
        self.lrpe = LRPE(self.head_dim) if lrpe else None

    def forward(self, x: torch.Tensor, state: State = None,
                cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, State]:
        if cu_seqlens is not None:
            # block_attention has no document boundaries, blocks start at each document's start
            # and every document has its own open block: one call per document.
            return self._forward_per_document(x, state, cu_seqlens)
        check_layer_input(x, self.d_model)
        if isinstance(state, DiagRowsState):
            return self._step_rows(x, state)
        if is_step(x, cu_seqlens):
            return self._step(x, state)
        B, T, _ = x.shape
        H, D, w = self.n_heads, self.head_dim, self.block_size
        state = DiagState.check(state, B, H, D, w)
        r = 0 if state is None else state.k_open.shape[1]
        # Block-local positions: LRPE restarts in every block.
        q, k, v = self._project(x, torch.arange(r, r + T, device=x.device) % w)
        if self.kernel == "relu" and q.dtype in HALF:  # (q's dtype: autocast's, if on)
            # Unnormalised ReLU sums: keep them in float32 until SRMSNorm rescales them.
            q, k, v = q.float(), k.float(), v.float()
        if r:
            # Re-run the open block from its start: the cached tokens get zero queries whose
            # outputs are dropped, so the block alignment matches the one-shot forward.
            k = torch.cat([state.k_open.to(k.dtype), k], dim=1)
            v = torch.cat([state.v_open.to(v.dtype), v], dim=1)
            q = torch.cat([q.new_zeros(B, r, H, D), q], dim=1)
        o = self._mix(block_attention, q, k, v, block_size=w, kernel=self.kernel)[:, r:]
        o = merge_heads(o)
        if self.kernel == "relu":
            o = srms_norm(o)
        n_open = (r + T) % w
        sdtype = state_dtype(x.dtype)
        new_state = DiagState(k[:, r + T - n_open:].to(sdtype), v[:, r + T - n_open:].to(sdtype))
        return self.out(o.to(x.dtype)), new_state

    def _project(self, x: torch.Tensor,
                 positions: torch.Tensor | int) -> tuple[torch.Tensor, ...]:
        """q, k, v [B, T, H, D] (q, k through LRPE at block-local ``positions`` when on)."""
        H = self.n_heads
        q, k, v = (split_heads(proj(x), H) for proj in (self.q_proj, self.k_proj, self.v_proj))
        if self.lrpe is not None:
            q, k = self.lrpe.pair(q, k, positions)
        return q, k, v

    def _step(self, x: torch.Tensor, state: State) -> tuple[torch.Tensor, DiagState]:
        """One token per row, all rows at one place r of their blocks: the query attends to the
        open block's cached keys and its own, without re-running the block."""
        B, H, D, w = x.shape[0], self.n_heads, self.head_dim, self.block_size
        state = DiagState.check(state, B, H, D, w)
        r = 0 if state is None else state.k_open.shape[1]
        q, k, v = self._project(x, r)  # LRPE at the block-local place r
        sdtype = state_dtype(x.dtype)
        # The cache is kept in the compute dtype; the ReLU kernel's q too (see forward).
        q = q.to(sdtype) if self.kernel == "relu" and q.dtype != sdtype else q
        k, v = (t if t.dtype == sdtype else t.to(sdtype) for t in (k, v))
        if r:
            k = torch.cat([state.k_open.to(sdtype), k], dim=1)  # [B, r + 1, H, D]
            v = torch.cat([state.v_open.to(sdtype), v], dim=1)
        o = merge_heads(open_block_attention(q, k, v, scale=D ** -0.5, kernel=self.kernel))
        if self.kernel == "relu":
            o = srms_norm(o)
        n_open = (r + 1) % w
        return self.out(o if o.dtype == x.dtype else o.to(x.dtype)), DiagState(k[:, r + 1 - n_open:],
                                                                              v[:, r + 1 - n_open:])

    def _step_rows(self, x: torch.Tensor, state: DiagRowsState) -> tuple[torch.Tensor, State]:
        """One token per row, each row at its own place ``state.fill`` in its block."""
        B, T, _ = x.shape
        H, D, w = self.n_heads, self.head_dim, self.block_size
        if T != 1:
            raise ValueError(f"a DiagRowsState (rows at different places in their blocks) "
                             f"continues one token per call, got T={T}")
        for i, name in enumerate(("k_open", "v_open")):
            check_tensor(f"state[{i}] ({name})", state[i], 4, "[B, block_size - 1, H, D]")
            check_shape(f"state[{i}] ({name})", state[i], (B, w - 1, H, D),
                        "[B, block_size - 1, H, D]")
        fill = state.fill
        if not (isinstance(fill, torch.Tensor) and fill.dtype == torch.long and fill.shape == (B,)):
            raise ValueError(f"state[2] (fill) must be a long tensor [B] = [{B}]")
        q, k, v = self._project(x, fill.unsqueeze(1))
        sdtype = state_dtype(x.dtype)
        keys = torch.cat([state.k_open.to(sdtype), k.to(sdtype)], dim=1)  # [B, w, H, D]
        values = torch.cat([state.v_open.to(sdtype), v.to(sdtype)], dim=1)
        o = open_block_attention(q, keys, values, fill + 1, kernel=self.kernel)
        o = merge_heads(o)
        if self.kernel == "relu":
            o = srms_norm(o.to(sdtype))
        new = DiagRowsState(keys[:, 1:], values[:, 1:], (fill + 1) % w)
        return self.out(o.to(x.dtype)), new

    def stack_states(self, states: Sequence[State]) -> DiagRowsState:
        """A ``DiagRowsState`` whose row i continues ``states[i]`` (a DiagState or DiagRowsState
        from ``forward``): the open blocks left-padded with zeros to block_size - 1 tokens."""
        H, D, w = self.n_heads, self.head_dim, self.block_size
        keys, values, fills = [], [], []
        for state in check_stackable(states):
            if isinstance(state, DiagRowsState):
                keys.append(state.k_open)
                values.append(state.v_open)
                fills.append(state.fill)
                continue
            state = DiagState.check(state, None, H, D, w)  # any batch
            r = state.k_open.shape[1]
            pad = (0, 0, 0, 0, w - 1 - r, 0)
            keys.append(F.pad(state.k_open, pad))
            values.append(F.pad(state.v_open, pad))
            fills.append(torch.full((state.k_open.shape[0],), r, device=state.k_open.device))
        return DiagRowsState(cat_rows(keys, "k_open"), cat_rows(values, "v_open"),
                             torch.cat(fills))

    def state_size(self, seq_len: int = 1) -> int:
        return 2 * self.n_heads * self.head_dim * (self.block_size - 1)

    def context_parallel(self) -> ContextParallel:
        """Blocks never cross a block border, so shards starting on one need nothing from
        other ranks (``aligned_blocks``); other layouts are refused."""
        def check(shards: Any, state0: State) -> str | None:
            already = 0 if state0 is None else state0[0].shape[1]
            return shards.border_problem(type(self).__name__, "block", self.block_size, already)

        return ContextParallel("aligned_blocks",
                               lambda shard, x, state0: shard.independent(x, state0), check)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, block_size={self.block_size}, kernel={self.kernel}, "
                f"lrpe={self.lrpe is not None}")
