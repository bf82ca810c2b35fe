"""flash-linear-attention's RetNet layer, ``FlaMultiScaleRetention`` (fla's
``MultiScaleRetention``), registered as ``retnet``, on ``fastweights.ops.decay_linear_attn``
(docs/maths.md 3.5). Its config and language model are ``fastweights.fla.retnet``.

The layer of fla 0.6's ``MultiScaleRetention`` (``fla/layers/multiscale_retention.py``) as fla's
``RetNetBlock`` builds it, with the same parameter names, so an fla RetNet checkpoint's tensors
load unchanged, and the same arithmetic, so float64 outputs equal fla's own layer code run with
its pure-PyTorch references (tests/fla/test_retnet_reference.py).

Dimension legend: B batch, T tokens, d hidden size, H heads, H_kv key/value heads (H_kv divides
H; G = H / H_kv), Dk = key_dim / H, Dv = value_dim / H.

Per token at position t (0 for a sequence's first token), for input x [d]:
    q = phi(x W_q) [H, Dk];  k = phi(x W_k) [H_kv, Dk];  v = x W_v [H_kv, Dv]
    q, k = rope(q, t), rope(k, t)       rotary positions on (x_i, x_{i + Dk/2}), base 10000
    k, v: each key/value head serves G consecutive query heads
    o = decay_linear_attn(q, k, v, gamma, scale=Dk ** -0.5)
                                        S_t = gamma_h S_{t-1} + k_t^T v_t;  o_t = scale q_t S_t
    y = W_o [RMSNorm(o) * silu(x W_g)] with ``use_output_gate``, else W_o RMSNorm(o)
                                        (norm per head; without weight if not elementwise_affine)
phi is fla's ``feature_map`` (None: identity; else one of ``FEATURE_MAPS``, transformers'
activation of that name). The decay is fla's fixed multi-scale one,
gamma_h = 1 - 2^(-5 - h) for h = 0..H-1, rounded to float32 as fla computes it (exact for
h <= 19; fla's float32 rounds it to 1 from h = 20 on, and so does this layer).

Rotary tables as fla computes them: inverse frequencies 1 / 10000^(2i / Dk) and angles
t * inv_freq in float32, their cosines and sines in float32, then cast to the input's dtype
(so a bfloat16 model rotates by bfloat16 tables, as fla's does); the rotation itself runs in
float32 (float64 for float64 inputs).

Decoding state per sequence: ``(S, offset)`` with ``S [B, H, Dk, Dv]`` (float32 or wider) and
``offset [B]`` (long) the number of tokens each row has consumed, from which the next tokens'
rotary positions count on.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_bool, check_choice, check_positive_int, state_dtype
from ..ops import decay_linear_attn, decay_linear_attn_step, rms_norm_gated
from .base import (
    ContextParallel,
    State,
    auxiliary_backend,
    check_backend,
    is_step,
    like_values,
    merge_heads,
    packed_or_single,
    per_document,
    split_heads,
)
from .fla_deltanet import FlaMixer
from .norms import RMSNorm
from .positional import rotate_halves

ROPE_BASE = 10000.0  # fla's RotaryEmbedding default, which MultiScaleRetention keeps

# transformers' activations (ACT2FN) that fla's ``feature_map`` may name and that are plain
# functions of one tensor; the parametrised or clipped ones (prelu, xielu, gelu_10, ...) and the
# variant GELU formulas (gelu_new, gelu_fast, ...) are refused by name.
FEATURE_MAPS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "linear": lambda x: x,
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),
    "relu6": F.relu6,
    "leaky_relu": lambda x: F.leaky_relu(x, 0.01),
    "silu": F.silu,
    "swish": F.silu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "mish": F.mish,
    "hardswish": F.hardswish,
}


def retention_decay(n_heads: int, device: torch.device | str | None = None) -> torch.Tensor:
    """RetNet's per-head decay gamma_h = 1 - 2^(-5 - h), h = 0..n_heads-1, in float32 as fla
    computes it. Returns [n_heads] float32."""
    return 1 - 2.0 ** (-5.0 - torch.arange(n_heads, dtype=torch.float32, device=device))


def fla_rotary_tables(positions: torch.Tensor, dim: int, dtype: torch.dtype
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [..., dim/2] of the angles positions * inv_freq, computed in float32 exactly as
    fla's RotaryEmbedding does (inv_freq = 1 / 10000^(arange(0, dim, 2) / dim) in float32),
    then cast to ``dtype``. positions: integer tensor of any shape."""
    inv_freq = 1.0 / (ROPE_BASE ** (torch.arange(0, dim, 2, dtype=torch.float32,
                                                  device=positions.device) / dim))
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    return angles.cos().to(dtype), angles.sin().to(dtype)


class FlaMultiScaleRetention(FlaMixer):
    """fla's MultiScaleRetention layer (see the module docstring for the maths).

    Options carry fla's names and defaults (``MultiScaleRetention.__init__`` of fla 0.6):
    ``expand_k``, ``expand_v`` (key_dim = round(d_model * expand_k), value_dim likewise; both
    integers divisible by n_heads, key_dim / n_heads even for the rotary pairs),
    ``num_kv_heads`` (None: n_heads), ``feature_map`` (None or a name in ``FEATURE_MAPS``),
    ``use_output_gate``, ``elementwise_affine`` and ``norm_eps`` (of the output RMSNorm),
    ``fuse_norm`` (only names the output norm as fla does: ``g_norm_swish_gate`` when fused with
    the gate, else ``g_norm``; the same maths). ``mode`` and ``chunk_size`` choose fastweights'
    algorithm for the decayed linear attention (docs/maths.md 3.5; equal results up to rounding); a
    one-token step always takes the recurrent form.
    Submodule names are fla's: q_proj, k_proj, v_proj, g_proj, g_norm_swish_gate or g_norm,
    o_proj. fla's layer has short convolutions too, but fla's RetNet model never enables them,
    so this layer has none.
    """

    def __init__(
        self, d_model: int, n_heads: int, *, expand_k: float = 1.0, expand_v: float = 2.0,
        num_kv_heads: int | None = None, feature_map: str | None = None,
        use_output_gate: bool = True, elementwise_affine: bool = True, norm_eps: float = 1e-5,
        fuse_norm: bool = True, mode: str = "chunk", chunk_size: int = 64,
        backend: str | None = None,
    ) -> None:
        super().__init__(d_model, n_heads, expand_k, expand_v)
        self.backend = check_backend(backend)
        key_dim, value_dim = self.key_dim, self.value_dim
        if self.head_k_dim % 2:
            raise ValueError(f"the key head dim (hidden size * expand_k / num_heads = "
                             f"{self.head_k_dim}) must be even for the rotary positions")
        if num_kv_heads is None:
            num_kv_heads = n_heads
        check_positive_int("num_kv_heads", num_kv_heads)
        if n_heads % num_kv_heads:
            raise ValueError(f"num_heads ({n_heads}) must be divisible by num_kv_heads "
                             f"({num_kv_heads})")
        self.num_kv_heads = num_kv_heads
        self.groups = n_heads // num_kv_heads
        if feature_map is not None:
            check_choice("feature_map", feature_map, (None, *FEATURE_MAPS))
        self.feature_map = feature_map
        self.use_output_gate = check_bool("use_output_gate", use_output_gate)
        check_bool("elementwise_affine", elementwise_affine)
        check_bool("fuse_norm", fuse_norm)
        self.mode = check_choice("mode", mode, ("chunk", "recurrent", "naive"))
        self.chunk_size = check_positive_int("chunk_size", chunk_size)

        self.q_proj = nn.Linear(d_model, key_dim, bias=False)
        self.k_proj = nn.Linear(d_model, num_kv_heads * self.head_k_dim, bias=False)
        self.v_proj = nn.Linear(d_model, num_kv_heads * self.head_v_dim, bias=False)
        if use_output_gate:
            self.g_proj = nn.Linear(d_model, value_dim, bias=False)
        self.o_proj = nn.Linear(value_dim, d_model, bias=False)
        norm = RMSNorm(self.head_v_dim, norm_eps, elementwise_affine=elementwise_affine)
        # fla names the norm after whether it is fused with the gate; the maths is the same
        self.norm_name = "g_norm_swish_gate" if fuse_norm and use_output_gate else "g_norm"
        self.add_module(self.norm_name, norm)

    def forward(self, x: torch.Tensor, state: State = None,
                cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, State]:
        bounds, docs = self._documents(x, state, cu_seqlens)
        B, T, _ = x.shape
        Ss, offsets = zip(*(self._check_state(s, B, x.device) for s in docs))  # per document
        q = split_heads(self.q_proj(x), self.n_heads)  # [B, T, H, Dk]
        k = split_heads(self.k_proj(x), self.num_kv_heads)  # [B, T, H_kv, Dk]
        v = split_heads(self.v_proj(x), self.num_kv_heads)  # [B, T, H_kv, Dv]
        if self.feature_map is not None:
            q, k = FEATURE_MAPS[self.feature_map](q), FEATURE_MAPS[self.feature_map](k)
        if cu_seqlens is None:
            positions = offsets[0].unsqueeze(1) + torch.arange(T, device=x.device)  # [B, T]
        else:  # every document counts on from its own offset (B = 1)
            positions = torch.cat([off + torch.arange(b - a, device=x.device)
                                   for off, (a, b) in zip(offsets, pairwise(bounds))]).unsqueeze(0)
        cos, sin = fla_rotary_tables(positions, self.head_k_dim, x.dtype)
        q, k = rotate_halves(q, cos, sin), rotate_halves(k, cos, sin)
        q, k = like_values(v, q, k)  # mixed precision: layers/base.py
        if self.groups > 1:  # key/value head j serves query heads j*G .. j*G + G - 1
            k = k.repeat_interleave(self.groups, dim=2)
            v = v.repeat_interleave(self.groups, dim=2)
        # The decay is made on the fly, never a buffer that a bfloat16 module would round.
        decay = retention_decay(self.n_heads, x.device)
        if self.mode != "naive" and is_step(x, cu_seqlens):
            # One token: the op's step (no chunk tables, no check that reads the decay back).
            o, S = decay_linear_attn_step(q, k, v, decay, state=Ss[0],
                                          scale=self.head_k_dim ** -0.5)
        else:
            o, S = decay_linear_attn(q, k, v, decay, scale=self.head_k_dim ** -0.5,
                                     initial_state=packed_or_single(Ss, cu_seqlens),
                                     output_final_state=True, mode=self.mode,
                                     chunk_size=self.chunk_size, cu_seqlens=cu_seqlens,
                                     backend=self.backend)
        gate = split_heads(self.g_proj(x), self.n_heads) if self.use_output_gate else None
        norm = getattr(self, self.norm_name)
        normed = rms_norm_gated(o, norm.weight, gate, eps=norm.eps,  # the norm's maths, fused
                                activation=norm.gate_activation,
                                backend=auxiliary_backend(self.backend))
        y = self.o_proj(merge_heads(normed))
        finals = [(s, off + (b - a)) for s, off, (a, b)
                  in zip(per_document(S, cu_seqlens), offsets, pairwise(bounds))]
        return y, packed_or_single(finals, cu_seqlens)

    def _check_state(self, state: State, B: int, device: torch.device
                     ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(S or None, offset [B] long) from the state this layer returned, or a fresh start."""
        if state is None:
            return None, torch.zeros(B, dtype=torch.long, device=device)
        if not (isinstance(state, tuple) and len(state) == 2):
            raise TypeError("state must be None or the pair (S, offset) this layer returned, got "
                            f"{type(state).__name__}"
                            + (f" of length {len(state)}" if isinstance(state, tuple) else ""))
        S, offset = state
        if not (isinstance(offset, torch.Tensor) and offset.dtype == torch.long
                and offset.shape == (B,)):
            raise ValueError(f"state offset must be a long tensor [B] = [{B}] (tokens consumed "
                             f"per row), got {offset.dtype if isinstance(offset, torch.Tensor) else type(offset).__name__}"
                             + (f" {tuple(offset.shape)}" if isinstance(offset, torch.Tensor) else ""))
        return S, offset.to(device)

    def state_size(self, seq_len: int = 1) -> int:
        return self.n_heads * self.head_k_dim * self.head_v_dim

    def context_parallel(self) -> ContextParallel:
        """S_out = gamma^T S_in + B (the fixed per-head decays, T the shard's length), a scan
        with per-head scalars, as TransNormer's decayed attention; the offset is the shard's
        global one."""
        return ContextParallel("decay_scan", self._decay_scan)

    def _decay_scan(self, shard: Any, x: torch.Tensor, state0: State) -> tuple[torch.Tensor, State]:
        B = x.shape[0]
        S0, offset0 = self._check_state(state0, B, x.device)
        zero = x.new_zeros(B, self.n_heads, self.head_k_dim, self.head_v_dim,
                           dtype=state_dtype(x.dtype))
        offset = offset0 + shard.offset
        _, (part, _) = shard.run(x, (zero, offset))
        gathered = shard.all_gather([part])
        gamma = retention_decay(self.n_heads, x.device).to(zero.dtype)
        S_in = shard.fold([gamma.pow(n)[:, None, None] for n in shard.lengths],
                          [g[0] for g in gathered], zero if S0 is None else S0.to(zero.dtype))
        return shard.run(x, (S_in, offset))

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, "
                f"num_kv_heads={self.num_kv_heads}, key_dim={self.key_dim}, "
                f"value_dim={self.value_dim}, feature_map={self.feature_map}, "
                f"use_output_gate={self.use_output_gate}")
