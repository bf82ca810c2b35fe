"""flash-linear-attention's DeltaNet layer, rebuilt on ``fastweights.ops.delta_rule`` (SPEC 1.4).

The layer of fla's ``DeltaNet`` (fla 0.6, ``fla/layers/delta_net.py``) with the same parameter
names, so an fla checkpoint's tensors load unchanged, and the same arithmetic, so float64 outputs
equal fla's own layer code run with its pure-PyTorch references (tests/models/test_fla.py).

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

import math

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_bool, check_choice, check_layer_input, check_positive_int, is_number
from ..ops._conv import causal_depthwise_conv
from ..ops.fwp import delta_rule, elu_plus_one, preferred_chunk_size
from .base import Mixer, State, merge_heads, split_heads

QK_ACTIVATIONS = ("silu", "relu", "elu", "identity")
QK_NORMS = ("l2", "sum")
# fla's epsilons: inside the square root of its L2-norm kernel, and the floor of the L1 norm
# (F.normalize(p=1, eps=1e-6)) of its sum_norm.
L2_EPS = 1e-6
SUM_EPS = 1e-6


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for half precisions (as fla's kernels compute), float64 stays float64."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class FlaRMSNorm(nn.Module):
    """RMSNorm over the last dim as fla computes it, optionally gated by SiLU of a second input:
    ``y = x / sqrt(mean(x^2) + eps) * weight [* silu(gate)]``, in float32 (float64 stays
    float64) and cast back to x's dtype once at the end (fla's fused kernels round once too).
    The parameter is ``weight`` [dim]; ``elementwise_affine=False`` leaves it out (weight 1)."""

    def __init__(self, dim: int, eps: float = 1e-6, *, elementwise_affine: bool = True) -> None:
        super().__init__()
        check_positive_int("dim", dim)
        if not is_number(eps) or not 0 < eps < 1:
            raise ValueError(f"eps must be a float in (0, 1), got {eps!r}")
        self.dim, self.eps = dim, float(eps)
        if check_bool("elementwise_affine", elementwise_affine):
            self.weight = nn.Parameter(torch.ones(dim))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., dim], gate None or [..., dim] -> [..., dim] in x's dtype."""
        cdtype = _compute_dtype(x)
        xf = x.to(cdtype)
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        if self.weight is not None:
            y = y * self.weight.to(cdtype)
        if gate is not None:
            y = y * F.silu(gate.to(cdtype))
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}" + ("" if self.weight is not None
                                                 else ", elementwise_affine=False")


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

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        B, _, C = x.shape
        W = self.kernel_size
        xt = x.transpose(1, 2)  # [B, C, T]
        if state is None:
            past = xt.new_zeros(B, C, W - 1)
        else:
            if not isinstance(state, torch.Tensor) or state.shape != (B, C, W - 1):
                raise ValueError(
                    f"short-convolution state must be a tensor [B, C, W - 1] = [{B}, {C}, {W - 1}], "
                    f"got {tuple(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__}")
            past = state.to(xt.dtype)
        full = torch.cat([past, xt], dim=2)  # [B, C, W - 1 + T]
        y = causal_depthwise_conv(full, self.weight, self.bias)  # [B, C, T]
        if self.activation:
            y = F.silu(y)
        return y.transpose(1, 2), full[:, :, full.shape[2] - (W - 1):]

    def extra_repr(self) -> str:
        return (f"{self.channels}, kernel_size={self.kernel_size}, bias={self.bias is not None}, "
                f"activation={'silu' if self.activation else None}")


class FlaMixer(Mixer):
    """What fla's layers share here: ``key_dim = round(d_model * expand_k)`` and
    ``value_dim = round(d_model * expand_v)``, each an integer divisible by n_heads (fla's
    rule), split into ``head_k_dim`` / ``head_v_dim`` per head."""

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
    choose fastweights' delta-rule algorithm (SPEC 1.4; equal results up to float rounding);
    ``chunk_size=None`` takes the size measured fastest on the input's device kind.
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
        self.o_norm = FlaRMSNorm(self.head_v_dim, eps=norm_eps)
        self.o_proj = nn.Linear(value_dim, d_model, bias=False)

    def _feature(self, x: torch.Tensor) -> torch.Tensor:
        """q or k per head [B, T, H, Dk] after the projection (and convolution): fla's
        activation (SiLU already applied when it is 'silu') then its normalisation, computed in
        float32 or wider and rounded to x's dtype once, as fla's kernels do."""
        if self.qk_activation == "relu":
            x = F.relu(x)
        elif self.qk_activation == "elu":
            x = elu_plus_one(x)
        xf = x.to(_compute_dtype(x))
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
