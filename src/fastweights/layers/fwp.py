"""Fast weight programmer layers: linear attention with a choice of feature map, normalisation and
update rule, and DeltaNet (docs/maths.md 1.1-1.4). The mathematics lives in
``fastweights.ops.linear_attn``, ``fastweights.ops.delta_rule`` and
``fastweights.ops.feature_maps``."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .._checks import (
    check_bool,
    check_choice,
    check_nonneg_float,
    check_positive_int,
    is_int,
    state_dtype,
)
from ..ops import (
    RECURRENT_MODES,
    delta_rule,
    delta_rule_attn_norm,
    delta_rule_step,
    linear_attn,
    linear_attn_step,
)
from ..ops.backend import preferred_chunk_size
from ..ops.feature_maps import FEATURE_MAPS, draw_favor_projection, feature_map, sum_norm
from .base import (
    ContextParallel,
    Mixer,
    State,
    check_backend,
    is_step,
    like_values,
    merge_heads,
    packed_or_single,
    per_document,
    split_heads,
)

NORMALIZATIONS = ("none", "attention", "sum", "sum+attention")
UPDATES = ("sum", "delta")


class LinearAttention(Mixer):
    """Linear attention as a fast weight programmer.

    One bias-free projection gives per head q, k, v (and a write-strength logit for the delta
    rule, beta = sigmoid(logit)); q and k go through the feature map phi (``elu`` = ELU+1,
    ``relu``, ``dpfp`` with ``nu``, ``favor`` with ``m`` random features, ``identity``);
    ``normalize`` is ``none``, ``attention`` (divide by phi(q).z + eps), ``sum`` (phi / sum phi,
    as DeltaNet) or ``sum+attention`` (both: sum-normalised features, then the attention
    normaliser; the fast weight paper's ablation); ``update`` is ``sum`` (W += k^T v) or ``delta``.
    The delta rule with ``attention`` or ``sum+attention`` is the paper's Table 3 ablation
    (``ops.delta_rule_attn_norm``: the retrieved value and the read-out divided by the
    normaliser; packed documents run one by one). Heads are concatenated,
    multiplied by ``out_scale`` (default 1/sqrt(head_dim), as every lmtool fast-weight layer) and
    projected back to d_model. FAVOR+ redraws its projection on every training forward and keeps
    the last draw in eval mode (``redraw=False`` keeps it fixed always). ``chunk_size`` None (the
    default) takes the size measured fastest on the input's device kind
    (``ops.backend.preferred_chunk_size``: 32 for the delta rule on CPU, 64 otherwise; the choice
    changes only float rounding, and is fixed per device kind, so runs stay reproducible).
    The defaults ``nu=2``
    and ``m=16`` are lmtool's (docs/maths.md 1.2); the op ``dpfp(x, nu=1)`` keeps its own default.

    ``backend`` (None: the automatic choice) goes to the op (``linear_attn``, ``delta_rule``;
    the attention-normalised delta rule has torch's forms only).

    State: ``(S [B, H, d_dot, head_dim], z [B, H, d_dot])`` for the sum rule and the
    attention-normalised delta rule, ``(S,)`` for delta.
    """

    static_form = "fixed"  # static_state: docs/design.md, "Decoding graphs"

    def __init__(
        self, d_model: int, n_heads: int, *, head_dim: int | None = None,
        feature_map: str = "elu", normalize: str = "attention", update: str = "sum",
        nu: int = 2, m: int = 16, eps: float = 1e-6, sum_norm_eps: float = 1e-6,
        out_scale: float | None = None, redraw: bool = True, orthogonal: bool = True,
        mode: str = "chunk", chunk_size: int | None = None, backend: str | None = None,
    ) -> None:
        super().__init__(d_model, n_heads, head_dim)
        self.backend = check_backend(backend)
        self.feature_map = check_choice("feature_map", feature_map, FEATURE_MAPS)
        self.normalize = check_choice("normalize", normalize, NORMALIZATIONS)
        self.update = check_choice("update", update, UPDATES)
        if not is_int(nu) or nu < 1:
            raise ValueError(f"nu must be an int >= 1, got {nu!r}")
        check_positive_int("m", m)
        self.nu, self.m = nu, m
        self.eps = check_nonneg_float("eps", eps)
        self.sum_norm_eps = check_nonneg_float("sum_norm_eps", sum_norm_eps)
        self.out_scale = 1.0 / math.sqrt(self.head_dim) if out_scale is None else float(out_scale)
        self.redraw = check_bool("redraw", redraw)
        self.orthogonal = check_bool("orthogonal", orthogonal)
        self.mode = check_choice("mode", mode, RECURRENT_MODES)
        # None: the size measured fastest for this op on the input's device kind
        # (ops.backend.preferred_chunk_size: 32 for the delta rule on CPU, else 64).
        self.chunk_size = None if chunk_size is None else check_positive_int("chunk_size", chunk_size)
        H, D = n_heads, self.head_dim
        self.n_beta = 1 if update == "delta" else 0
        self.qkvb = nn.Linear(d_model, H * (3 * D + self.n_beta), bias=False)
        self.out = nn.Linear(H * D, d_model, bias=False)
        if feature_map == "favor":
            self.register_buffer("projection", draw_favor_projection(m, D, orthogonal=orthogonal))

    @property
    def feature_dim(self) -> int:
        """d_dot, the size of phi(x) per head."""
        D = self.head_dim
        return {"dpfp": 2 * D * self.nu, "favor": 2 * self.m}.get(self.feature_map, D)

    def _phi(self, x: torch.Tensor) -> torch.Tensor:
        x = feature_map(x, self.feature_map, nu=self.nu,
                        projection=self.projection if self.feature_map == "favor" else None)
        return sum_norm(x, self.sum_norm_eps) if self.normalize.startswith("sum") else x

    def forward(self, x: torch.Tensor, state: State = None,
                cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, State]:
        delta_attention = self.update == "delta" and self.normalize.endswith("attention")
        if delta_attention and cu_seqlens is not None:
            return self._forward_per_document(x, state, cu_seqlens)
        _, docs = self._documents(x, state, cu_seqlens)
        if self.feature_map == "favor" and self.training and self.redraw:
            # A new buffer, not an in-place copy: the previous piece's graph (state carried
            # across calls) still holds the old projection for its backward pass.
            self.projection = draw_favor_projection(
                self.m, self.head_dim, orthogonal=self.orthogonal,
                dtype=self.projection.dtype, device=self.projection.device)
        H, D = self.n_heads, self.head_dim
        proj = split_heads(self.qkvb(x), H)  # [B, T, H, 3D (+1)]
        q, k, v = proj[..., :D], proj[..., D:2 * D], proj[..., 2 * D:3 * D]
        q, k = like_values(v, self._phi(q), self._phi(k))  # mixed precision: layers/base.py
        if not delta_attention and self.mode != "naive" and is_step(x, cu_seqlens):
            return self._step(proj, q, k, v, state)
        chunk = self.chunk_size or preferred_chunk_size(
            "delta_rule" if self.update == "delta" else "linear_attn", x.device)
        opts = {"output_final_state": True, "mode": self.mode, "chunk_size": chunk,
                "cu_seqlens": cu_seqlens, "backend": self.backend}
        if delta_attention:
            beta = torch.sigmoid(proj[..., 3 * D])
            o, new_state = delta_rule_attn_norm(q, k, v, beta, eps=self.eps, initial_state=state,
                                                output_final_state=True, mode=self.mode,
                                                chunk_size=chunk)
        elif self.update == "delta":
            # The layer carries the 1-tuple (S,), the op takes and returns S.
            init = packed_or_single([_delta_matrix(s) for s in docs], cu_seqlens)
            beta = torch.sigmoid(proj[..., 3 * D])
            o, S = delta_rule(q, k, v, beta, initial_state=init, **opts)
            new_state: State = packed_or_single([(s,) for s in per_document(S, cu_seqlens)],
                                                cu_seqlens)
        else:
            o, new_state = self._mix(
                linear_attn, q, k, v, normalize=self.normalize.endswith("attention"), eps=self.eps,
                initial_state=state, **opts)
        return self.out(merge_heads(o) * self.out_scale), new_state

    def _step(self, proj: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              state: State) -> tuple[torch.Tensor, State]:
        """The decoding step (T = 1, not packed): the op's one-token step on the carried state."""
        if self.update == "delta":
            beta = torch.sigmoid(proj[..., 3 * self.head_dim])
            o, S = delta_rule_step(q, k, v, beta, state=_delta_matrix(state))
            new_state: State = (S,)
        else:
            o, new_state = linear_attn_step(q, k, v, state=state,
                                            normalize=self.normalize.endswith("attention"),
                                            eps=self.eps)
        return self.out(merge_heads(o) * self.out_scale), new_state

    def state_size(self, seq_len: int = 1) -> int:
        H, dd, D = self.n_heads, self.feature_dim, self.head_dim
        with_z = self.update == "sum" or self.normalize.endswith("attention")
        return H * dd * D + (H * dd if with_z else 0)

    def context_parallel(self) -> ContextParallel:
        """The sum rule's S, z add up over ranks (``sum_scan``, LASP-2); under the delta rule
        the final S is affine in the incoming one, S_out = A S_in + B with
        A = prod (I - beta k k^T), read off the layer (``delta_scan``); the attention-normalised
        delta rule's (S, z) is passed rank to rank (``relay``)."""
        if self.update == "delta" and self.normalize.endswith("attention"):
            return ContextParallel.relay()
        if self.update == "delta":
            return ContextParallel("delta_scan", self._delta_scan)
        return ContextParallel.sum_scan()

    def _delta_scan(self, shard: Any, x: torch.Tensor, state0: State) -> tuple[torch.Tensor, State]:
        B = x.shape[0]
        like = x.new_zeros(B, self.n_heads, self.feature_dim, self.head_dim,
                           dtype=state_dtype(x.dtype))

        def run_batched(S: torch.Tensor) -> torch.Tensor:
            reps = S.shape[0] // B
            return shard.run(x.repeat(reps, 1, 1), (S,))[1][0]

        S0 = like if state0 is None else state0[0].to(like.dtype)
        S_in = shard.affine_scan(run_batched, like, S0)
        return shard.run(x, (S_in,) if (shard.rank or state0 is not None) else None)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, feature_map={self.feature_map}, normalize={self.normalize}, "
                f"update={self.update}, feature_dim={self.feature_dim}")


def _delta_matrix(state: State) -> torch.Tensor | None:
    """S from the delta rule's state ``(S,)``; other layers' states are rejected (a
    NormAttention (S, position) pair would otherwise pass the op's shape check on S)."""
    if state is None:
        return None
    if not (isinstance(state, tuple) and len(state) == 1):
        raise TypeError(
            "state must be None or the (S [B, H, Dk, Dv],) tuple this delta-rule layer "
            f"returned, got {type(state).__name__}"
            + (f" of length {len(state)}" if isinstance(state, tuple) else "")
        )
    return state[0]


class DeltaNet(LinearAttention):
    """DeltaNet (Schlag et al. 2021): the delta rule with sum-normalised ELU+1 features and a
    learned per-head write strength beta = sigmoid(x w_beta), the paper's best configuration."""

    fixed_options = ("update",)  # LinearAttention's update rule, pinned to "delta"

    def __init__(self, d_model: int, n_heads: int, *, feature_map: str = "elu",
                 normalize: str = "sum", **options) -> None:
        super().__init__(d_model, n_heads, feature_map=feature_map, normalize=normalize,
                         update="delta", **options)
