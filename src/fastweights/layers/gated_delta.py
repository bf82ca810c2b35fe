"""Gated DeltaNet (Yang, Kautz, Hatamizadeh 2024; docs/maths.md 5b): the layer ``GatedDeltaNet``,
registered as ``gated-delta``. The mathematics is ``fastweights.ops.gated_delta_rule``.

The layer as published and as flash-linear-attention 0.6 builds it (``fla/layers/
gated_deltanet.py``, whose parameter names it keeps, so fla's tensors load unchanged:
``fastweights.fla.gated_deltanet``), which is also the layer of transformers' Qwen3.5,
Qwen3-Next and OLMo-hybrid (their projections fused or ordered differently).

Dimension legend: B batch, T tokens, d d_model, Hk key heads (``n_heads``), H value heads
(``num_v_heads``, a multiple of Hk), Dk key head dim (``head_dim``), Dv = Dk * expand_v value
head dim, C = 2 Hk Dk + H Dv the convolved channels, W ``conv_size``.

Per token, for input x [d]:
    q, k, v = silu(conv(x W_q)), silu(conv(x W_k)), silu(conv(x W_v))   causal depthwise, width W
    q, k    = q / sqrt(|q|^2 + 1e-6), k / sqrt(|k|^2 + 1e-6)            per key head, L2
    beta    = sigmoid(x W_b) [H]   (times 2 with ``allow_neg_eigval``: eigenvalues in (-1, 1])
    g       = -exp(A_log) softplus(x W_a + dt_bias) [H]                 log decay, <= 0
    S       = exp(g) (I - beta k k^T) S + beta k v^T                     value head h reads
    o       = S^T (q / sqrt(Dk))                                         key head h // (H / Hk)
    y       = W_o [RMSNorm(o) * act(x W_g)]   per value head; without ``use_gate``: RMSNorm(o)
act is SiLU (fla's default 'swish') or sigmoid (``gate_activation``). Without short
convolutions q, k, v are silu(x W) (fla's choice).

State per sequence: ``(conv, S)``: ``conv [B, C, W - 1]`` the last W - 1 projected inputs
(q, k, v channels concatenated; input dtype) and ``S [B, H, Dk, Dv]`` (float32, float64 for
float64 inputs); ``(S,)`` without short convolutions.
"""

from __future__ import annotations

import math
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import (
    check_bool,
    check_choice,
    check_positive_int,
    is_number,
    state_dtype,
)
from ..ops import (
    RECURRENT_MODES,
    gated_delta_rule,
    gated_delta_rule_step,
    l2_normalize,
    rms_norm_gated,
    short_conv_silu,
)
from ..ops.backend import preferred_chunk_size
from .base import (
    ContextParallel,
    Mixer,
    State,
    auxiliary_backend,
    check_backend,
    is_step,
    like_values,
    merge_heads,
    packed_or_single,
    split_heads,
)
from .norms import GATE_ACTIVATIONS, RMSNorm

__all__ = ["GatedDeltaNet", "l2_normalize"]

# From this many tokens per call the input projections run as one product of the concatenated
# weights (one read of x, one input gradient); below it, a product each (docs/performance.md,
# "The gated-delta layer around its op").
ONE_PRODUCT_TOKENS = 64


class GatedDeltaNet(Mixer):
    """Gated DeltaNet (see the module docstring for the maths and the state).

    ``n_heads`` is the number of query/key heads; ``num_v_heads`` (default ``n_heads``) value
    heads, a multiple of it, each key head serving ``num_v_heads / n_heads`` consecutive value
    heads (Qwen3.5's 16 key / 32 value heads; fla's GVA). ``head_dim`` (default
    d_model / n_heads) is the query/key head size, ``expand_v`` the value head size over it
    (fla's default 2; Qwen3.5 and Qwen3-Next use 1 with more value heads). The other defaults
    are fla 0.6's ``GatedDeltaNet``: output gate on (``use_gate``, SiLU; ``gate_activation``
    'sigmoid' is fla's other choice), short convolutions of width 4 without bias on q, k, v,
    ``allow_neg_eigval`` off, output-norm eps 1e-5, and its initialisation of A_log
    (log U(0, 16)) and dt_bias (softplus^-1 of dt log-uniform in [0.001, 0.1]).
    ``mode``/``chunk_size`` choose the op's algorithm (equal up to rounding); ``chunk_size``
    None takes the size measured fastest on the input's device kind (32 on CPU); ``backend``
    (None: the automatic choice) goes to ``gated_delta_rule``, and to the fused short
    convolution and output norm (``short_conv_silu``, ``rms_norm_gated``: Triton kernels for
    half CUDA inputs), which have no fla kernel: for them "fla" is the automatic choice.

    Submodules carry fla's names: q_proj, k_proj, v_proj, a_proj, b_proj, A_log, dt_bias,
    q_conv1d, k_conv1d, v_conv1d, g_proj, o_norm, o_proj.
    """

    static_form = "fixed"  # static_state: docs/design.md, "Decoding graphs"

    def __init__(
        self, d_model: int, n_heads: int, *, head_dim: int | None = None,
        num_v_heads: int | None = None, expand_v: float = 2.0, use_gate: bool = True,
        gate_activation: str = "swish", use_short_conv: bool = True, conv_size: int = 4,
        conv_bias: bool = False, allow_neg_eigval: bool = False, norm_eps: float = 1e-5,
        mode: str = "chunk", chunk_size: int | None = None, backend: str | None = None,
    ) -> None:
        super().__init__(d_model, n_heads, head_dim)
        self.backend = check_backend(backend)
        Hk, Dk = n_heads, self.head_dim
        H = Hk if num_v_heads is None else check_positive_int("num_v_heads", num_v_heads)
        if H % Hk:
            raise ValueError(f"num_v_heads ({H}) must be a multiple of n_heads ({Hk}): each key "
                             "head serves num_v_heads / n_heads value heads")
        if not is_number(expand_v) or not expand_v > 0 or not math.isfinite(expand_v):
            raise ValueError(f"expand_v must be a positive number, got {expand_v!r}")
        Dv = round(Dk * expand_v)
        if Dv < 1 or not math.isclose(Dk * expand_v, Dv):
            raise ValueError(f"head_dim * expand_v must be a positive integer (the value head "
                             f"size), got {Dk} * {expand_v}")
        self.num_v_heads, self.head_v_dim, self.expand_v = H, Dv, expand_v
        self.key_dim, self.value_dim = Hk * Dk, H * Dv
        self.use_gate = check_bool("use_gate", use_gate)
        self.gate_activation = check_choice("gate_activation", gate_activation, GATE_ACTIVATIONS)
        self.use_short_conv = check_bool("use_short_conv", use_short_conv)
        self.conv_size = check_positive_int("conv_size", conv_size)
        self.conv_bias = check_bool("conv_bias", conv_bias)
        self.allow_neg_eigval = check_bool("allow_neg_eigval", allow_neg_eigval)
        if not is_number(norm_eps) or not 0 < norm_eps < 1:
            raise ValueError(f"norm_eps must be a float in (0, 1), got {norm_eps!r}")
        self.norm_eps = float(norm_eps)
        self.mode = check_choice("mode", mode, RECURRENT_MODES)
        self.chunk_size = None if chunk_size is None else check_positive_int("chunk_size", chunk_size)

        self.q_proj = nn.Linear(d_model, self.key_dim, bias=False)
        self.k_proj = nn.Linear(d_model, self.key_dim, bias=False)
        self.v_proj = nn.Linear(d_model, self.value_dim, bias=False)
        self.a_proj = nn.Linear(d_model, H, bias=False)
        self.b_proj = nn.Linear(d_model, H, bias=False)
        # fla's initialisation: A in U(0, 16); dt log-uniform in [1e-3, 0.1] (floor 1e-4), kept
        # as softplus^-1(dt) so that softplus(a + dt_bias) starts near dt.
        self.A_log = nn.Parameter(torch.empty(H).uniform_(0, 16).log())
        dt = torch.exp(torch.rand(H) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        dt = dt.clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))
        if use_short_conv:
            # nn.Conv1d for fla's parameter layout ([C, 1, W]) and initialisation; the forward is
            # causal_depthwise_conv on the three concatenated.
            self.q_conv1d, self.k_conv1d, self.v_conv1d = (
                nn.Conv1d(c, c, conv_size, groups=c, bias=conv_bias)
                for c in (self.key_dim, self.key_dim, self.value_dim))
        if use_gate:
            self.g_proj = nn.Linear(d_model, self.value_dim, bias=False)
        self.o_norm = RMSNorm(Dv, self.norm_eps, gate_activation=gate_activation)
        self.o_proj = nn.Linear(self.value_dim, d_model, bias=False)

    @property
    def conv_channels(self) -> int:
        """C, the channels of the short convolutions (q, k, v concatenated)."""
        return 2 * self.key_dim + self.value_dim

    def _projections(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """All the input projections of x [B, T, d] in one product (one read of x, one input
        gradient): (q, k, v concatenated [B, T, C] as ``project``, b_proj(x), a_proj(x),
        g_proj(x) or None)."""
        parts = [self.q_proj, self.k_proj, self.v_proj, self.b_proj, self.a_proj]
        if self.use_gate:
            parts.append(self.g_proj)
        if x.numel() < ONE_PRODUCT_TOKENS * x.shape[-1]:
            # A few tokens (a decoding step): the weights' concatenation would copy more than
            # the products read; one product per projection, the outputs concatenated.
            out = torch.cat([F.linear(x, p.weight) for p in parts], dim=-1)
        else:
            out = F.linear(x, torch.cat([p.weight for p in parts]))
        C, H = self.conv_channels, self.num_v_heads
        sizes = (C, H, H) + ((self.value_dim,) if self.use_gate else ())
        projected, b, a, *gate = out.split(sizes, dim=-1)
        return projected, b, a, gate[0] if gate else None

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, d] -> the q, k, v projections concatenated [B, T, C] (before the convolution:
        what the convolution state holds)."""
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)

    def _qkv(self, projected: torch.Tensor, bounds: list[int],
             pasts: list[torch.Tensor | None], out_dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor | None]]:
        """The op's q, k [B, T, Hk, Dk] and v [B, T, H, Dv] from the projections [B, T, C]
        (in their dtype), and each document's new convolution past [B, C, W - 1] in
        ``out_dtype`` (None without short convolutions). With them, one fused op per document
        (``short_conv_silu``: the convolution continuing the document's past, SiLU, the L2 norm
        of q's and k's heads); without, SiLU and the L2 norm in the compute dtype."""
        Hk, H, Dk = self.n_heads, self.num_v_heads, self.head_dim
        sizes = (self.key_dim, self.key_dim, self.value_dim)
        if not self.use_short_conv:
            q, k, v = F.silu(projected.to(state_dtype(projected.dtype))).split(sizes, dim=-1)
            q, k = l2_normalize(split_heads(q, Hk)), l2_normalize(split_heads(k, Hk))
            return *like_values(projected, q, k, split_heads(v, H)), [None] * len(pasts)
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        weight = torch.cat([c.weight for c in convs])
        bias = torch.cat([c.bias for c in convs]) if self.conv_bias else None
        pieces, finals = [], []
        for (start, stop), past in zip(pairwise(bounds), pasts):  # each continues its own past
            y, final = short_conv_silu(
                projected[:, start:stop], weight, bias, initial_state=past, norm_heads=2 * Hk,
                head_dim=Dk, output_final_state=True, backend=auxiliary_backend(self.backend))
            pieces.append(y)
            finals.append(final.to(out_dtype))
        mixed = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
        # one split (its backward one concatenation, not a zero-filled gradient per slice)
        q, k, v = mixed.split(sizes, dim=-1)
        return split_heads(q, Hk), split_heads(k, Hk), split_heads(v, H), finals

    def _state_parts(self, state: State, B: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(conv, S) of a carried state (None, None for None), conv's shape checked (the op
        checks S)."""
        n = 2 if self.use_short_conv else 1
        if state is None:
            return None, None
        if not (isinstance(state, tuple) and len(state) == n):
            raise TypeError(
                f"state must be None or the {n}-tuple "
                + ("(conv [B, C, W - 1], S [B, H, Dk, Dv])" if n == 2 else "(S [B, H, Dk, Dv],)")
                + f" this gated-delta layer returned, got {type(state).__name__}"
                + (f" of length {len(state)}" if isinstance(state, tuple) else ""))
        if n == 1:
            return None, state[0]
        conv, S = state
        shape = (B, self.conv_channels, self.conv_size - 1)
        if not isinstance(conv, torch.Tensor) or tuple(conv.shape) != shape:
            raise ValueError(f"state's conv must be a tensor [B, C, W - 1] = {list(shape)}, got "
                             + (str(tuple(conv.shape)) if isinstance(conv, torch.Tensor)
                                else type(conv).__name__))
        return conv, S

    def forward(self, x: torch.Tensor, state: State = None,
                cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, State]:
        bounds, states = self._documents(x, state, cu_seqlens)
        B = x.shape[0]
        cdtype = state_dtype(x.dtype)
        parts = [self._state_parts(s, B) for s in states]
        # [B, T, C], in the activation dtype (layers/base.py); and the gates' projections
        projected, b_proj, a_proj, gate_proj = self._projections(x)
        # Mixed precision (like_values): the op's q, k, v in the projections' dtype (bfloat16
        # in a bfloat16 model and under bfloat16 autocast, where the kernels run); the
        # convolution, the L2 norm and the gates below are computed in float32.
        q, k, v, convs = self._qkv(projected, bounds, [past for past, _ in parts], x.dtype)
        H, Dk = self.num_v_heads, self.head_dim
        beta = torch.sigmoid(b_proj.to(cdtype))  # [B, T, H]
        if self.allow_neg_eigval:
            beta = beta * 2.0
        g = -self.A_log.to(cdtype).exp() * F.softplus(a_proj.to(cdtype)
                                                       + self.dt_bias.to(cdtype))
        scale = Dk ** -0.5
        if is_step(x, cu_seqlens) and self.mode != "naive":
            # The decoding step: the op's one-token step (the operands rounded as the chunked
            # form's, then in the state's dtype).
            o, S = gated_delta_rule_step(q, k, v, beta, g, state=parts[0][1], scale=scale)
            finals = [S]
        else:
            chunk = self.chunk_size or preferred_chunk_size("gated_delta_rule", x.device)
            o, S = gated_delta_rule(
                q, k, v, beta, g, scale=scale, output_final_state=True, mode=self.mode,
                chunk_size=chunk, cu_seqlens=cu_seqlens, backend=self.backend,
                initial_state=packed_or_single([S0 for _, S0 in parts], cu_seqlens))
            finals = list(S) if cu_seqlens is not None else [S]
        gate = split_heads(gate_proj, H) if self.use_gate else None
        normed = rms_norm_gated(  # o_norm's maths, fused with the gate (in float32)
            o, self.o_norm.weight, gate, eps=self.o_norm.eps,
            activation=self.o_norm.gate_activation, out_dtype=x.dtype,
            backend=auxiliary_backend(self.backend))
        y = self.o_proj(merge_heads(normed))
        new = [(c, s) if self.use_short_conv else (s,) for c, s in zip(convs, finals)]
        return y, packed_or_single(new, cu_seqlens)

    def state_size(self, seq_len: int = 1) -> int:
        conv = (self.conv_size - 1) * self.conv_channels if self.use_short_conv else 0
        return self.num_v_heads * self.head_dim * self.head_v_dim + conv

    def context_parallel(self) -> ContextParallel:
        """The final S is affine in the incoming one, S_out = A S_in + B with
        A = prod exp(g) (I - beta k k^T), read off the layer (``affine_scan``, as the delta
        rule's); the convolution's past is the last W - 1 tokens before the shard, all-gathered
        from the ranks before (shards shorter than W - 1 included) and projected here."""
        return ContextParallel("gated_delta_scan", self._scan)

    def _scan(self, shard: Any, x: torch.Tensor, state0: State) -> tuple[torch.Tensor, State]:
        B = x.shape[0]
        conv0, S0 = self._state_parts(state0, B)
        conv_in = self._conv_before(shard, x, conv0) if self.use_short_conv else None
        like = x.new_zeros(B, self.num_v_heads, self.head_dim, self.head_v_dim,
                           dtype=state_dtype(x.dtype))

        def with_conv(S: torch.Tensor) -> State:
            if conv_in is None:
                return (S,)
            return (conv_in.repeat(S.shape[0] // B, 1, 1), S)

        def run_batched(S: torch.Tensor) -> torch.Tensor:
            return shard.run(x.repeat(S.shape[0] // B, 1, 1), with_conv(S))[1][-1]

        S_in = shard.affine_scan(run_batched, like, like if S0 is None else S0.to(like.dtype))
        return shard.run(x, with_conv(S_in))

    def _conv_before(self, shard: Any, x: torch.Tensor, conv0: torch.Tensor | None
                     ) -> torch.Tensor:
        """The convolution state at this shard's first token: the projections of the last
        W - 1 tokens before it (on the ranks before, after ``conv0``)."""
        B, T, _ = x.shape
        Wm = self.conv_size - 1
        tail = x[:, max(0, T - Wm):]
        tail = F.pad(tail, (0, 0, Wm - tail.shape[1], 0))  # left-padded to W - 1 tokens
        gathered = shard.all_gather([tail])
        before = [g[0][:, Wm - min(Wm, n):] for g, n in
                  zip(gathered[:shard.rank], shard.lengths)]
        tokens = torch.cat([x[:, :0], *before], dim=1)
        past = x.new_zeros(B, self.conv_channels, Wm) if conv0 is None else conv0.to(x.dtype)
        full = torch.cat([past, self.project(tokens).transpose(1, 2)], dim=2)
        return full[:, :, full.shape[2] - Wm:]

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, num_v_heads={self.num_v_heads}, "
                f"head_v_dim={self.head_v_dim}, use_gate={self.use_gate}, "
                f"use_short_conv={self.use_short_conv}, conv_size={self.conv_size}, "
                f"allow_neg_eigval={self.allow_neg_eigval}")
