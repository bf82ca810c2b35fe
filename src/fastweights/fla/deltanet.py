"""flash-linear-attention's DeltaNet: the layer ``FlaDeltaNet``, rebuilt on
``fastweights.ops.delta_rule`` (docs/maths.md 1.4), its config ``FlaDeltaNetConfig`` (fla 0.6's
``DeltaNetConfig``; ``FLA_OPTIONS`` says what each field does here) and ``FlaDeltaNetLM``.

The layer of fla's ``DeltaNet`` (fla 0.6, ``fla/layers/delta_net.py``) with the same parameter
names, so an fla checkpoint's tensors load unchanged, and the same arithmetic, so float64 outputs
equal fla's own layer code run with its pure-PyTorch references (tests/fla/test_deltanet.py).

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
inputs ``[B, channels, W - 1]`` (input dtype) and ``S [B, H, Dk, Dv]`` (float32 or wider); without
short convolutions the state is ``(S,)``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import (
    check_bool,
    check_choice,
    check_layer_input,
    check_positive_int,
    state_dtype,
)
from ..layers.base import State, merge_heads, split_heads
from ..layers.norms import RMSNorm
from ..ops.fwp import delta_rule, elu_plus_one, preferred_chunk_size
from .model import COMMON_FLA_OPTIONS, FlaConfig, FlaLM
from .modules import FlaMixer, ShortConvolution

QK_ACTIVATIONS = ("silu", "relu", "elu", "identity")
QK_NORMS = ("l2", "sum")
# fla's epsilons: inside the square root of its L2-norm kernel, and the floor of the L1 norm
# (F.normalize(p=1, eps=1e-6)) of its sum_norm.
L2_EPS = 1e-6
SUM_EPS = 1e-6


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
        mode: str = "chunk", chunk_size: int | None = None,
    ) -> None:
        super().__init__(d_model, n_heads, expand_k, expand_v)
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

    def _feature(self, x: torch.Tensor) -> torch.Tensor:
        """q or k per head [B, T, H, Dk] after the projection (and convolution): fla's
        activation (SiLU already applied when it is 'silu') then its normalisation, computed in
        float32 or wider and rounded to x's dtype once, as fla's kernels do."""
        if self.qk_activation == "relu":
            x = F.relu(x)
        elif self.qk_activation == "elu":
            x = elu_plus_one(x)
        xf = x.to(state_dtype(x.dtype))
        if self.qk_norm == "l2":
            xf = xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + L2_EPS)
        else:
            xf = xf / xf.abs().sum(-1, keepdim=True).clamp_min(SUM_EPS)
        return xf.to(x.dtype)

    def forward(self, x: torch.Tensor, state: State = None) -> tuple[torch.Tensor, State]:
        check_layer_input(x, self.d_model)
        n_state = 4 if self.use_short_conv else 1
        if state is not None and not (isinstance(state, tuple) and len(state) == n_state):
            raise TypeError(
                f"state must be None or the {n_state}-tuple "
                + ("(conv_q, conv_k, conv_v, S)" if self.use_short_conv else "(S,)")
                + f" this layer returned, got {type(state).__name__}"
                + (f" of length {len(state)}" if isinstance(state, tuple) else ""))
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.use_short_conv:
            cq, ck, cv = (None, None, None) if state is None else state[:3]
            q, cq = self.q_conv1d(q, cq)
            k, ck = self.k_conv1d(k, ck)
            v, cv = self.v_conv1d(v, cv)
        else:
            if self.qk_activation == "silu":
                q, k = F.silu(q), F.silu(k)
            v = F.silu(v)
        q = self._feature(split_heads(q, self.n_heads))  # [B, T, H, Dk]
        k = self._feature(split_heads(k, self.n_heads))
        v = split_heads(v, self.n_heads)  # [B, T, H, Dv]
        beta = torch.sigmoid(self.b_proj(x)) if self.use_beta else q.new_ones(q.shape[:3])
        if self.allow_neg_eigval:
            beta = beta * 2.0
        chunk = self.chunk_size or preferred_chunk_size("delta_rule", x.device)
        o, S = delta_rule(q, k, v, beta, scale=self.head_k_dim ** -0.5,
                          initial_state=None if state is None else state[-1],
                          output_final_state=True, mode=self.mode, chunk_size=chunk)
        gate = split_heads(self.g_proj(x), self.n_heads) if self.use_gate else None
        y = self.o_proj(merge_heads(self.o_norm(o, gate)))
        return y, ((cq, ck, cv, S) if self.use_short_conv else (S,))

    def state_size(self, seq_len: int = 1) -> int:
        conv = (self.conv_size - 1) * (2 * self.key_dim + self.value_dim) if self.use_short_conv else 0
        return self.n_heads * self.head_k_dim * self.head_v_dim + conv

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, key_dim={self.key_dim}, "
                f"value_dim={self.value_dim}, qk_activation={self.qk_activation}, "
                f"qk_norm={self.qk_norm}, use_beta={self.use_beta}, use_gate={self.use_gate}, "
                f"use_short_conv={self.use_short_conv}, conv_size={self.conv_size}")


MODEL_TYPE = "delta_net"  # fla's model_type for DeltaNet

# Every argument of fla 0.6's DeltaNetConfig and what fastweights does with it.
FLA_OPTIONS: dict[str, str] = {
    **COMMON_FLA_OPTIONS,
    "expand_k": "supported",
    "expand_v": "supported",
    "use_gate": "supported (g_proj and the SiLU-gated output RMSNorm)",
    "use_short_conv": "supported (causal depthwise convolutions with SiLU, carried in the state)",
    "conv_size": "supported",
    "use_beta": "supported (beta = 1 when False)",
    "allow_neg_eigval": "supported (beta doubled)",
    "qk_norm": "supported: 'l2', 'sum'",
    "qk_activation": "supported: 'silu', 'relu', 'elu' (ELU + 1), 'identity'",
    "hidden_act": "supported: 'swish'; refused: 'powlu'",
    "attn_mode": "accepted, no effect: 'chunk' and 'fused_recurrent' pick fla's GPU kernel for "
                 "the same delta rule; refused: 'fused_chunk' (fla refuses it too)",
    "fuse_norm": "accepted, no effect: fused and unfused RMSNorm + residual are the same maths",
    "use_output_norm": "accepted, no effect: fla 0.6's DeltaNet layer ignores it and always "
                       "applies its output RMSNorm, and so does fastweights (warning when False)",
    "max_position_embeddings": "accepted, no effect: DeltaNet layers have no positions",
}

@dataclass
class FlaDeltaNetConfig(FlaConfig):
    """fla 0.6's ``DeltaNetConfig`` fields with its defaults. ``FLA_OPTIONS`` says what each
    field does here; refused values raise ValueError naming the field."""

    MODEL_TYPE: ClassVar[str] = MODEL_TYPE
    FAMILY: ClassVar[str] = "DeltaNet"
    OPTIONS: ClassVar[dict[str, str]] = FLA_OPTIONS
    BOOL_FIELDS: ClassVar[tuple[str, ...]] = (
        *FlaConfig.BOOL_FIELDS, "use_gate", "use_short_conv", "allow_neg_eigval", "use_beta",
        "use_output_norm")
    SIZE_FIELDS: ClassVar[tuple[str, ...]] = (*FlaConfig.SIZE_FIELDS, "conv_size")

    attn_mode: str = "chunk"
    expand_k: float = 1.0
    expand_v: float = 1.0
    use_gate: bool = False
    use_short_conv: bool = True
    allow_neg_eigval: bool = False
    conv_size: int = 4
    use_beta: bool = True
    use_output_norm: bool = True
    num_heads: int = 16
    qk_norm: str = "l2"
    qk_activation: str = "silu"
    hidden_ratio: int | float | None = 4

    def __post_init__(self) -> None:
        self._check_common()
        if self.attn_mode not in ("chunk", "fused_recurrent"):
            raise ValueError(
                f"FlaDeltaNetConfig.attn_mode must be 'chunk' or 'fused_recurrent' (fla's kernel "
                f"choice; the maths is the same), got {self.attn_mode!r}")
        if not self.use_output_norm:
            warnings.warn(
                "use_output_norm=False: fla 0.6's DeltaNet layer ignores this option and always "
                "applies its output RMSNorm (its checkpoints have o_norm weights); fastweights "
                "does the same to stay equal to fla", stacklevel=3)
        # The layer's own checks (qk options, expand ratios, head split), on the meta device.
        with torch.device("meta"):
            self.layer()

    def layer(self) -> FlaDeltaNet:
        """A fresh DeltaNet layer of this config (fla's ``DeltaNetBlock`` arguments)."""
        return FlaDeltaNet(
            self.hidden_size, self.num_heads, expand_k=self.expand_k, expand_v=self.expand_v,
            use_beta=self.use_beta, use_gate=self.use_gate, use_short_conv=self.use_short_conv,
            conv_size=self.conv_size, allow_neg_eigval=self.allow_neg_eigval,
            qk_activation=self.qk_activation, qk_norm=self.qk_norm, norm_eps=self.norm_eps)


class FlaDeltaNetLM(FlaLM):
    """fla's DeltaNetForCausalLM on fastweights' ops (``FlaLM`` of a ``FlaDeltaNetConfig``)."""

    config_class = FlaDeltaNetConfig
