"""The single-layer retrieval model of the fast weight paper's synthetic tasks (docs/maths.md 1.8).

Value embedding: fixed one-hot in R^S. Key embedding E in R^{2S x e}, e = int(2.2 S), N(0, 1),
trainable. Write inputs x_i = [onehot(v_i); E(k_i)]; keys K = x W_k (d_key, with bias);
values V = onehot(v_i); write strengths beta_i = sigmoid(x_i w_beta + b) (delta rule only);
query Q = E(q) W_q (with bias too: docs/maths.md 1.8 names no bias-free map). The read-out for each
query is the memory's retrieval itself (no output projection, no 1/sqrt(d) factor).

Memory variants (``memory``), all through ``fastweights.ops``:
- ``linear``: phi = ELU+1, sum rule, attention normalisation (eps 1e-6);
- ``dpfp``: phi = DPFP-``nu``, sum rule, attention normalisation;
- ``favor``: phi = FAVOR+ with ``m`` random features, redrawn at every call (the synthetic
  code's policy), sum rule, attention normalisation;
- ``delta``: phi = ``feature_map`` (``elu`` | ``dpfp`` | ``favor``), sum-normalised keys and
  queries (eps 1e-6), delta rule;
- ``softmax``: softmax attention over the written pairs, logits / sqrt(d_key).
Init: W_k, W_q ~ U(+-1/sqrt(d_key)) (weights and biases); softmax: Xavier weights, zero biases.

The memory is written once per sequence; every query then reads the final memory. The read uses
the op itself with zero keys/values (and beta = 0 for the delta rule), which writes nothing.

Dimension legend: N sequences, L pairs, Q queries, S symbols, e key-embedding size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import check_choice, check_positive_int
from ..ops import delta_rule, draw_favor_projection, linear_attn, softmax_attention, sum_norm
from ..ops.feature_maps import feature_map

MEMORIES = ("linear", "dpfp", "favor", "delta", "softmax")
FEATURE_MAPS = ("elu", "dpfp", "favor")


class RetrievalModel(nn.Module):
    """``forward(keys [N, L], values [N, L], queries [N, Q]) -> y_hat [N, Q, S]`` (see module doc)."""

    def __init__(self, n_symbols: int, memory: str = "linear", *, d_key: int = 64,
                 feature_map: str = "elu", nu: int = 1, m: int = 64) -> None:
        super().__init__()
        self.S = check_positive_int("n_symbols", n_symbols)
        self.memory = check_choice("memory", memory, MEMORIES)
        self.d_key = check_positive_int("d_key", d_key)
        self.feature_map = {"linear": "elu", "dpfp": "dpfp", "favor": "favor"}.get(
            memory, check_choice("feature_map", feature_map, FEATURE_MAPS))
        if memory not in ("delta",) and feature_map != "elu":
            raise ValueError(f"feature_map applies to memory='delta' only, got {feature_map!r} "
                             f"with memory={memory!r}")
        self.nu = check_positive_int("nu", nu)
        self.m = check_positive_int("m", m)
        S, e = n_symbols, int(2.2 * n_symbols)
        self.key_embed = nn.Embedding(2 * S, e)  # init N(0, 1)
        self.W_k = nn.Linear(S + e, d_key)
        self.W_q = nn.Linear(e, d_key)
        self.w_beta = nn.Linear(S + e, 1) if memory == "delta" else None
        if memory == "softmax":
            for lin in (self.W_k, self.W_q):
                nn.init.xavier_uniform_(lin.weight)
                nn.init.zeros_(lin.bias)
        else:
            bound = 1.0 / math.sqrt(d_key)
            for p in (self.W_k.weight, self.W_k.bias, self.W_q.weight, self.W_q.bias):
                nn.init.uniform_(p, -bound, bound)

    @property
    def feature_dim(self) -> int:
        """d_dot: the memory's key size."""
        if self.memory == "softmax":
            return self.d_key
        return {"elu": self.d_key, "dpfp": 2 * self.d_key * self.nu, "favor": 2 * self.m}[self.feature_map]

    def state_size(self, seq_len: int) -> int:
        """Floats of memory per sequence after ``seq_len`` written pairs."""
        if self.memory == "softmax":
            return seq_len * (self.d_key + self.S)  # the keys and values attended over
        extra = 0 if self.memory == "delta" else self.feature_dim  # the normaliser z
        return self.feature_dim * self.S + extra

    def _phi(self, x: torch.Tensor, projection: torch.Tensor | None) -> torch.Tensor:
        x = feature_map(x, self.feature_map, nu=self.nu, projection=projection)
        return sum_norm(x) if self.memory == "delta" else x

    def forward(self, keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        for name, t in (("keys", keys), ("values", values), ("queries", queries)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.long or t.dim() != 2:
                raise TypeError(f"{name} must be a 2-D long tensor, got {t!r:.60}")
        if keys.shape != values.shape or queries.shape[0] != keys.shape[0]:
            raise ValueError(f"keys, values must be [N, L] and queries [N, Q], got "
                             f"{tuple(keys.shape)}, {tuple(values.shape)}, {tuple(queries.shape)}")
        dtype = self.W_k.weight.dtype
        v = F.one_hot(values, self.S).to(dtype)  # [N, L, S]
        x = torch.cat([v, self.key_embed(keys)], dim=-1)  # [N, L, S + e]
        k = self.W_k(x)[:, :, None]  # [N, L, 1, d_key]
        q = self.W_q(self.key_embed(queries))[:, :, None]  # [N, Q, 1, d_key]
        v = v[:, :, None]  # [N, L, 1, S]
        N, Q = queries.shape
        if self.memory == "softmax":
            return softmax_attention(q, k, v, causal=False)[:, :, 0]
        # FAVOR+ redraws its projection at every call (the synthetic code's policy), but one draw
        # serves keys and queries alike: phi(q).phi(k) estimates exp(q.k) only under a shared one.
        proj = (draw_favor_projection(self.m, self.d_key, dtype=k.dtype, device=k.device)
                if self.feature_map == "favor" else None)
        k, q = self._phi(k, proj), self._phi(q, proj)
        nothing_k = q.new_zeros(q.shape)
        nothing_v = q.new_zeros(N, Q, 1, self.S)
        if self.memory == "delta":
            beta = torch.sigmoid(self.w_beta(x))  # [N, L, 1]
            _, mem = delta_rule(k, k, v, beta, output_final_state=True)
            o, _ = delta_rule(q, nothing_k, nothing_v, q.new_zeros(N, Q, 1), initial_state=mem)
        else:
            _, mem = linear_attn(k, k, v, normalize=True, output_final_state=True)
            o, _ = linear_attn(q, nothing_k, nothing_v, normalize=True, initial_state=mem)
        return o[:, :, 0]  # [N, Q, S]


def retrieval_loss(y_hat: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1/2 ||onehot(y) - y_hat||^2 summed over the S symbols, averaged over the real queries.
    y_hat [N, Q, S]; targets, mask [N, Q]."""
    onehot = F.one_hot(targets.clamp(min=0), y_hat.shape[-1]).to(y_hat.dtype)
    per_query = 0.5 * (onehot - y_hat).pow(2).sum(-1)  # [N, Q]
    return (per_query * mask).sum() / mask.sum()
