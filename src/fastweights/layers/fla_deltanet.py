"""flash-linear-attention's DeltaNet layer, ``FlaDeltaNet``, registered as ``fla-delta``, on
``fastweights.ops.delta_rule`` (docs/maths.md 1.4), with the pieces fla's layers share here:
``FlaMixer`` (their head split, ``expand_k`` / ``expand_v``) and ``ShortConvolution`` (causal
depthwise, its last inputs carried in the state). Its config and language model are
``fastweights.fla.deltanet``.

The layer of fla's ``DeltaNet`` (fla 0.6, ``fla/layers/delta_net.py``) with the same parameter
names, so an fla checkpoint's tensors load unchanged, and the same arithmetic, so float64 outputs
equal fla's own layer code run with its pure-PyTorch references
(tests/fla/test_deltanet_reference.py).

Dimension legend: B batch, T tokens, d hidden size, H heads, Dk = key_dim / H, Dv = value_dim / H,
W the short-convolution width.

Per token, for input x [d]:
    q, k = phi(conv_q(x W_q)), phi(conv_k(x W_k))      conv: causal depthwise, width W
    v    = silu(conv_v(x W_v))
    q, k = norm(q), norm(k)                               per head: L2 (x / sqrt(|x|^2 + 1e-6))
                                                          or sum (x / max(sum |x_i|, 1e-6))
    beta = sigmoid(x W_b) [H] (ones without ``use_beta``), times 2 with ``allow_neg_eigval``
    o    = delta_rule(q, k, v, beta, scale=Dk ** -0.5)    S += k^T beta (v - k S); o = scale q S
    y    = W_o [RMSNorm(o) * silu(x W_g) with ``use_gate``, else RMSNorm(o)]   norm per head
phi is fla's ``qk_activation``: ``silu`` (inside the convolution, or after the projection
without it), ``relu``, ``elu`` (ELU + 1) or ``identity``. v always goes through SiLU.

Decoding state per sequence: ``(conv_q, conv_k, conv_v, S)`` with each convolution's last W - 1
inputs ``[B, channels, W - 1]`` (in the layer input's dtype, as gated-delta's) and ``S [B, H, Dk, Dv]`` (float32 or wider); without
short convolutions the state is ``(S,)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_bool, check_choice, check_positive_int, is_number, state_dtype
from ..ops import fused_kernels_run, rms_norm_gated, short_conv_silu
from ..ops.backend import preferred_chunk_size
from ..ops.delta_rule import delta_rule
from ..ops.feature_maps import elu_plus_one
from .base import (
    ContextParallel,
    Mixer,
    State,
    auxiliary_backend,
    check_backend,
    like_values,
    merge_heads,
    packed_or_single,
    per_document,
    split_heads,
)
from .conv import causal_depthwise_conv
from .gated_delta import l2_normalize
from .norms import RMSNorm

QK_ACTIVATIONS = ("silu", "relu", "elu", "identity")
QK_NORMS = ("l2", "sum")
# fla's floor of the L1 norm (F.normalize(p=1, eps=1e-6)) of its sum_norm (its L2 norm is
# gated_delta.l2_normalize, the same kernel).
SUM_EPS = 1e-6


class ShortConvolution(nn.Module):
    """Causal depthwise convolution of width ``kernel_size`` over time, optionally followed by
    SiLU: ``y_t = act(sum_j weight[:, 0, j] * x_{t - W + 1 + j} + bias)``, inputs before the first
    token being the carried state (zeros at the start of a sequence).

    ``forward(x [B, T, C], state=None [B, C, W - 1]) -> (y [B, T, C], state [B, C, W - 1])``;
    the state is the last W - 1 inputs, so feeding a sequence in pieces equals feeding it whole.
    Parameters ``weight [C, 1, W]`` and ``bias [C]`` (optional), fla's layout (nn.Conv1d's).
    """

    def __init__(self, channels: int, kernel_size: int, *, bias: bool = False,
                 activation: bool = True) -> None:
        super().__init__()
        self.channels = check_positive_int("channels", channels)
        self.kernel_size = check_positive_int("kernel_size", kernel_size)
        self.activation = check_bool("activation", activation)
        check_bool("bias", bias)
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        self.bias = nn.Parameter(torch.zeros(channels)) if bias else None
        # nn.Conv1d's default initialisation (fresh layers only; checkpoints overwrite it)
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def check_state(self, name: str, state: Any, B: int) -> None:
        """ValueError naming ``name`` unless ``state`` is a tensor [B, C, W - 1]."""
        shape = (B, self.channels, self.kernel_size - 1)
        if not isinstance(state, torch.Tensor) or state.shape != shape:
            raise ValueError(
                f"{name} must be a tensor [B, C, W - 1] = {list(shape)}, got "
                f"{tuple(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__}")

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if state is not None:
            self.check_state("short-convolution state", state, x.shape[0])
        return self._run(x, state)

    def _run(self, x: torch.Tensor, state: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` on a state already checked."""
        B, _, C = x.shape
        W = self.kernel_size
        xt = x.transpose(1, 2)  # [B, C, T]
        past = xt.new_zeros(B, C, W - 1) if state is None else state.to(xt.dtype)
        full = torch.cat([past, xt], dim=2)  # [B, C, W - 1 + T]
        y = causal_depthwise_conv(full, self.weight, self.bias)  # [B, C, T]
        if self.activation:
            y = F.silu(y)
        return y.transpose(1, 2), full[:, :, full.shape[2] - (W - 1):]

    def documents(self, x: torch.Tensor, states: Sequence[torch.Tensor | None],
                  bounds: Sequence[int], state_dtype: torch.dtype, *, fused: bool = False,
                  norm_heads: int = 0, head_dim: int = 1, backend: str | None = None
                  ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``forward`` of the documents packed in x [B, T, C] at ``bounds`` (their starts, then
        T), document d continuing ``states[d]`` (checked by the caller, ``check_state``):
        (y [B, T, C], every document's final state in ``state_dtype``). ``fused`` (with the
        SiLU on): one fused op per document (``short_conv_silu`` under ``backend``), which also
        L2-normalises the first ``norm_heads`` heads of ``head_dim`` channels."""
        if norm_heads and not (fused and self.activation):
            raise ValueError("the L2 norm is fused only behind the SiLU (activation=True)")

        def run(piece: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
            if fused and self.activation:
                return short_conv_silu(piece, self.weight, self.bias, initial_state=state,
                                       norm_heads=norm_heads, head_dim=head_dim,
                                       output_final_state=True, backend=backend)
            return self._run(piece, state)

        outs, finals = [], []
        for (start, stop), state in zip(pairwise(bounds), states):
            # one document (every unpacked call, every decoding step): x itself, no slice
            y, final = run(x if len(bounds) == 2 else x[:, start:stop], state)
            outs.append(y)
            finals.append(final if final.dtype == state_dtype else final.to(state_dtype))
        return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), finals

    def extra_repr(self) -> str:
        return (f"{self.channels}, kernel_size={self.kernel_size}, bias={self.bias is not None}, "
                f"activation={'silu' if self.activation else None}")


class FlaMixer(Mixer):
    """What fla's layers share here: ``key_dim = round(d_model * expand_k)`` and
    ``value_dim = round(d_model * expand_v)``, each an integer divisible by n_heads (fla's
    rule), split into ``head_k_dim`` / ``head_v_dim`` per head."""

    static_form = "fixed"  # static_state: docs/design.md, "Decoding graphs"

    def __init__(self, d_model: int, n_heads: int, expand_k: float, expand_v: float) -> None:
        check_positive_int("d_model", d_model)
        check_positive_int("n_heads", n_heads)
        key_dim = _expanded("expand_k", d_model, expand_k, n_heads)
        value_dim = _expanded("expand_v", d_model, expand_v, n_heads)
        super().__init__(d_model, n_heads, head_dim=key_dim // n_heads)
        self.key_dim, self.value_dim = key_dim, value_dim
        self.head_k_dim, self.head_v_dim = key_dim // n_heads, value_dim // n_heads


class FlaDeltaNet(FlaMixer):
    """fla's DeltaNet layer (see the module docstring for the maths).

    Options carry fla's names and defaults (``DeltaNet.__init__`` of fla 0.6): ``expand_k``,
    ``expand_v`` (key_dim = round(d_model * expand_k), value_dim likewise; both must be integers
    divisible by n_heads), ``use_beta``, ``use_gate``, ``use_short_conv``, ``conv_size``,
    ``conv_bias``, ``allow_neg_eigval``, ``qk_activation`` (silu/relu/elu/identity),
    ``qk_norm`` (l2/sum) and ``norm_eps`` (of the output RMSNorm). ``mode`` and ``chunk_size``
    choose fastweights' delta-rule algorithm (docs/maths.md 1.4; equal results up to float
    rounding); ``chunk_size=None`` takes the size measured fastest on the input's device kind.
    Submodule names are fla's: q_proj, k_proj, v_proj, b_proj, q_conv1d, k_conv1d, v_conv1d,
    g_proj, o_norm, o_proj.
    """

    def __init__(
        self, d_model: int, n_heads: int, *, expand_k: float = 1.0, expand_v: float = 1.0,
        use_beta: bool = True, use_gate: bool = False, use_short_conv: bool = True,
        conv_size: int = 4, conv_bias: bool = False, allow_neg_eigval: bool = False,
        qk_activation: str = "silu", qk_norm: str = "l2", norm_eps: float = 1e-5,
        mode: str = "chunk", chunk_size: int | None = None, backend: str | None = None,
    ) -> None:
        super().__init__(d_model, n_heads, expand_k, expand_v)
        self.backend = check_backend(backend)
        key_dim, value_dim = self.key_dim, self.value_dim
        self.use_beta = check_bool("use_beta", use_beta)
        self.use_gate = check_bool("use_gate", use_gate)
        self.use_short_conv = check_bool("use_short_conv", use_short_conv)
        self.allow_neg_eigval = check_bool("allow_neg_eigval", allow_neg_eigval)
        check_bool("conv_bias", conv_bias)
        self.conv_size = check_positive_int("conv_size", conv_size)
        self.qk_activation = check_choice("qk_activation", qk_activation, QK_ACTIVATIONS)
        self.qk_norm = check_choice("qk_norm", qk_norm, QK_NORMS)
        self.mode = check_choice("mode", mode, ("chunk", "recurrent", "naive"))
        self.chunk_size = None if chunk_size is None else check_positive_int("chunk_size", chunk_size)

        self.q_proj = nn.Linear(d_model, key_dim, bias=False)
        self.k_proj = nn.Linear(d_model, key_dim, bias=False)
        self.v_proj = nn.Linear(d_model, value_dim, bias=False)
        if use_beta:
            self.b_proj = nn.Linear(d_model, n_heads, bias=False)
        if use_short_conv:
            qk_silu = qk_activation == "silu"  # fla fuses SiLU into the q/k convolutions
            self.q_conv1d = ShortConvolution(key_dim, conv_size, bias=conv_bias, activation=qk_silu)
            self.k_conv1d = ShortConvolution(key_dim, conv_size, bias=conv_bias, activation=qk_silu)
            self.v_conv1d = ShortConvolution(value_dim, conv_size, bias=conv_bias, activation=True)
        if use_gate:
            self.g_proj = nn.Linear(d_model, value_dim, bias=False)
        self.o_norm = RMSNorm(self.head_v_dim, eps=norm_eps)
        self.o_proj = nn.Linear(value_dim, d_model, bias=False)

    def _feature(self, x: torch.Tensor, normed: bool = False) -> torch.Tensor:
        """q or k per head [B, T, H, Dk] after the projection (and convolution): fla's
        activation (SiLU already applied when it is 'silu') then its normalisation (already
        applied where ``normed``: fused into the convolution), computed in float32 or wider and
        rounded to x's dtype once, as fla's kernels do."""
        if normed:
            return x
        if self.qk_activation == "relu":
            x = F.relu(x)
        elif self.qk_activation == "elu":
            x = elu_plus_one(x)
        xf = x.to(state_dtype(x.dtype))
        if self.qk_norm == "l2":
            xf = l2_normalize(xf)
        else:
            xf = xf / xf.abs().sum(-1, keepdim=True).clamp_min(SUM_EPS)
        return xf.to(x.dtype)

    def _state_parts(self, state: State, B: int) -> tuple[tuple[torch.Tensor | None, ...], Any]:
        """((conv_q, conv_k, conv_v), S) of a carried state, ((None,) * 3, None) for None; the
        convolution states' shapes checked here (the op checks S)."""
        if state is None:
            return (None, None, None), None
        n_state = 4 if self.use_short_conv else 1
        if not (isinstance(state, tuple) and len(state) == n_state):
            raise TypeError(
                f"state must be None or the {n_state}-tuple "
                + ("(conv_q, conv_k, conv_v, S)" if self.use_short_conv else "(S,)")
                + f" this layer returned, got {type(state).__name__}"
                + (f" of length {len(state)}" if isinstance(state, tuple) else ""))
        if not self.use_short_conv:
            return (None, None, None), state[0]
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        for name, conv, past in zip(("conv_q", "conv_k", "conv_v"), convs, state):
            conv.check_state(f"state's {name}", past, B)
        return state[:3], state[3]

    def forward(self, x: torch.Tensor, state: State = None,
                cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, State]:
        bounds, docs = self._documents(x, state, cu_seqlens)
        parts = [self._state_parts(s, x.shape[0]) for s in docs]
        q, k, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        v = values
        # The fused short convolutions where their kernels run (half CUDA inputs): on the CPU
        # the layer's own path costs less per call (a decoding step's three convolutions).
        kernels = self.use_short_conv and fused_kernels_run(values, auxiliary_backend(self.backend))
        fused = kernels and self.qk_activation == "silu" and self.qk_norm == "l2"
        if self.use_short_conv:  # each document continues its own past
            pasts = [[p[0][i] for p in parts] for i in range(3)]  # per convolution, per document
            # The states in x's dtype (float32 under autocast), as gated-delta keeps its own;
            # with SiLU features and the L2 norm, the norm fused into q's and k's convolutions.
            qk = {"fused": kernels, "norm_heads": self.n_heads if fused else 0,
                  "head_dim": self.head_k_dim, "backend": auxiliary_backend(self.backend)}
            q, cq = self.q_conv1d.documents(q, pasts[0], bounds, x.dtype, **qk)
            k, ck = self.k_conv1d.documents(k, pasts[1], bounds, x.dtype, **qk)
            v, cv = self.v_conv1d.documents(v, pasts[2], bounds, x.dtype, fused=kernels,
                                            backend=auxiliary_backend(self.backend))
        else:
            if self.qk_activation == "silu":
                q, k = F.silu(q), F.silu(k)
            v = F.silu(v)
        q = self._feature(split_heads(q, self.n_heads), fused)  # [B, T, H, Dk]
        k = self._feature(split_heads(k, self.n_heads), fused)
        v = split_heads(v, self.n_heads)  # [B, T, H, Dv]
        # Mixed precision (layers/base.py like_values): the op's q, k, v in the projections'
        # dtype; the norms above are computed in float32.
        q, k, v = like_values(values, q, k, v)
        beta = torch.sigmoid(self.b_proj(x)) if self.use_beta else q.new_ones(q.shape[:3])
        if self.allow_neg_eigval:
            beta = beta * 2.0
        chunk = self.chunk_size or preferred_chunk_size("delta_rule", x.device)
        o, S = delta_rule(q, k, v, beta, scale=self.head_k_dim ** -0.5,
                          initial_state=packed_or_single([p[1] for p in parts], cu_seqlens),
                          output_final_state=True, mode=self.mode, chunk_size=chunk,
                          cu_seqlens=cu_seqlens, backend=self.backend)
        gate = split_heads(self.g_proj(x), self.n_heads) if self.use_gate else None
        normed = rms_norm_gated(o, self.o_norm.weight, gate, eps=self.o_norm.eps,  # o_norm's
                                activation=self.o_norm.gate_activation,  # maths, fused
                                backend=auxiliary_backend(self.backend))
        y = self.o_proj(merge_heads(normed))
        finals = per_document(S, cu_seqlens)
        new = (list(zip(cq, ck, cv, finals)) if self.use_short_conv
               else [(s,) for s in finals])
        return y, packed_or_single(new, cu_seqlens)

    def state_size(self, seq_len: int = 1) -> int:
        conv = (self.conv_size - 1) * (2 * self.key_dim + self.value_dim) if self.use_short_conv else 0
        return self.n_heads * self.head_k_dim * self.head_v_dim + conv

    def context_parallel(self) -> ContextParallel:
        """Rank r continues rank r-1's final state (``relay``): exact, sequential."""
        return ContextParallel.relay()

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, key_dim={self.key_dim}, "
                f"value_dim={self.value_dim}, qk_activation={self.qk_activation}, "
                f"qk_norm={self.qk_norm}, use_beta={self.use_beta}, use_gate={self.use_gate}, "
                f"use_short_conv={self.use_short_conv}, conv_size={self.conv_size}")


def _expanded(name: str, d_model: int, ratio: float, n_heads: int) -> int:
    """round(d_model * ratio), checked to be an integer divisible by n_heads (fla's rule)."""
    if not is_number(ratio) or not ratio > 0 or not math.isfinite(ratio):
        raise ValueError(f"{name} must be a positive number, got {ratio!r}")
    size = round(d_model * ratio)
    if not math.isclose(d_model * ratio, size) or size < 1:
        raise ValueError(f"hidden size * {name} must be a positive integer, got "
                         f"{d_model} * {ratio} = {d_model * ratio}")
    if size % n_heads:
        raise ValueError(f"hidden size * {name} = {size} must be divisible by num_heads {n_heads}")
    return size
