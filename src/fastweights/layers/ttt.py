"""Test-time training layers TTT-Linear and TTT-MLP (Sun et al. 2024; docs/maths.md 2.1, 2.3,
2.5, 2.6). The inner loop lives in ``fastweights.ops.ttt``; this module holds the outer
parameters."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from itertools import pairwise
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .._checks import (
    check_bool,
    check_choice,
    check_nonneg_float,
    check_positive_int,
)
from ..ops import (
    TTT_MODES,
    TTTState,
    reads_allowed,
    ttt_linear,
    ttt_linear_step,
    ttt_mlp,
    ttt_mlp_step,
)
from ..state_tree import cat_rows
from .base import (
    ContextParallel,
    Mixer,
    State,
    check_backend,
    check_stackable,
    is_step,
    merge_heads,
    packed_or_single,
    per_document,
    split_heads,
    token_positions,
)
from .conv import causal_depthwise_conv
from .positional import RotaryFrequencies

CONV_KERNEL = 4  # the Mamba backbone's causal depthwise convolutions (docs/maths.md 2.1)
INIT_STD = 0.02  # docs/maths.md 2.6


class TTTLayerState(NamedTuple):
    """A TTT layer's state: ``pos`` tokens into the current mini-batch, ``conv_cache``
    [B, 3, H * D] (Mamba backbone, else None) and ``inner``, the ops' state."""

    pos: int
    conv_cache: torch.Tensor | None
    inner: tuple[Any, ...]


class _TTTLayer(RotaryFrequencies, Mixer):
    """A TTT layer (docs/maths.md 2.1, 2.5): per-head views XQ, XK, XV of x; the inner model is
    trained on (XK, XV) while the sequence streams and read with XQ; heads concatenated,
    post-LayerNorm, output projection.

    Options:
    - ``mini_batch_size`` b (16): inner gradients of b tokens are taken at the same weights.
    - ``eta_base``: inner learning rate eta_t = eta_base * eta_scale * sigmoid(x_t w_lr + b_lr) /
      head_dim per head (w_lr ~ N(0, 0.02), b_lr = 0). ``eta_scale`` (attribute, 1.0) is the
      training schedule's multiplier: TTT-MLP's recipe (docs/maths.md 2.6) ramps it linearly from
      ``eta_warmup_from`` = 0.1 to 1 over the outer warm-up, which the training loop applies
      through ``set_inner_lr_warmup`` (``eta_warmup_from`` None for TTT-Linear: no ramp).
    - ``learn_eta`` (True): the token-dependent learned gate above; False fixes eta_t =
      eta_base * eta_scale * 0.5 / head_dim (the gate's value at sigmoid(0), no w_lr, b_lr): the
      TTT paper's ablation step before "+ learnable inner learning rate".
    - ``checkpoint_group`` (None): in training, recompute the inner scan in groups of this many
      mini-batches in the backward pass instead of storing what every mini-batch's backward
      reads (TTT-Linear: its inner weights; TTT-MLP: its per-token rows)
      (docs/maths.md 2.6's gradient checkpointing; 4 in the paper): same results, much less memory.
    - tau_i = max(0, 1/i + delta_i) with a learned offset delta [b] (init 0), the scale of the
      running gradient sum at position i of a mini-batch (the ops' ``token_scale``).
    - ``rope`` (True): rotary positions (base ``rope_base``) on XQ, XK with the position counted
      modulo b, i.e. restarting every mini-batch (docs/maths.md 2.1).
    - ``inner_norm`` (True): per-head LayerNorm in the inner model with learned gamma, beta [H, D]
      (outer parameters); ``residual`` (True): f(z) = z + LN(f_res(z)).
    - Learned initial inner weights (W ~ N(0, 0.02), biases 0), shared by every sequence.
    - ``mamba_backbone`` (False): one projection shared by Q and K followed by two causal depthwise
      convolutions (kernel 4, with bias) giving XQ and XK, and a GELU (tanh) output gate
      gelu(x W_g) after the post-LayerNorm (docs/maths.md 2.1, 2.5).
    - ``mode``: the ops' "dual" (default), "primal" or "naive".
    - ``backend``: the ops' ``backend=`` (their one-token steps' too): None (default, the
      automatic choice: the Triton kernels of the dual form, and of the one-token step, where
      they can run the call, ops/backend.py), "triton" or "torch".

    State: ``(pos, conv_cache, inner)``: pos (int) the position inside the current mini-batch,
    conv_cache [B, 3, H * D] the last three shared Q/K projections (Mamba backbone, else None),
    inner the op's state: the inner weights at a mini-batch boundary, else a ``TTTState``
    (fastweights.ops: the open mini-batch's start weights and the rows, inputs and eta-scaled
    output gradients, of its tokens so far), the same however the sequence was fed. The
    one-token step (T = 1, mode "dual", ``ttt_linear_step``) reads the start weights and the
    rows and writes weights only when a mini-batch completes.
    """

    static_form = "rows"  # static_state: docs/design.md, "Decoding graphs"

    op = staticmethod(ttt_linear)  # the inner-loop op; TTTMLP sets ttt_mlp
    step = staticmethod(ttt_linear_step)  # its one-token step; TTTMLP sets ttt_mlp_step
    eta_warmup_from: float | None = None  # start of the inner learning-rate ramp, None: no ramp

    def __init__(
        self, d_model: int, n_heads: int, *, head_dim: int | None = None,
        mini_batch_size: int = 16, eta_base: float = 1.0, rope: bool = True,
        rope_base: float = 10000.0, inner_norm: bool = True, residual: bool = True,
        mamba_backbone: bool = False, mode: str = "dual", checkpoint_group: int | None = None,
        learn_eta: bool = True, backend: str | None = None,
    ) -> None:
        super().__init__(d_model, n_heads, head_dim)
        self.mini_batch_size = check_positive_int("mini_batch_size", mini_batch_size)
        self.checkpoint_group = (None if checkpoint_group is None
                                 else check_positive_int("checkpoint_group", checkpoint_group))
        self.eta_base = check_nonneg_float("eta_base", eta_base)
        self.eta_scale = 1.0  # set by the training loop's warm-up ramp (see eta_warmup_from)
        self.rope = check_bool("rope", rope)
        self.inner_norm = check_bool("inner_norm", inner_norm)
        self.residual = check_bool("residual", residual)
        self.mamba_backbone = check_bool("mamba_backbone", mamba_backbone)
        self.learn_eta = check_bool("learn_eta", learn_eta)
        self.mode = check_choice("mode", mode, TTT_MODES)
        self.backend = check_backend(backend)
        H, D, b = n_heads, self.head_dim, mini_batch_size
        width = H * D
        if rope:
            self._init_rotary(rope_base)
        # Mamba backbone: [shared Q/K, V]; otherwise [Q, K, V].
        self.qkv = nn.Linear(d_model, (2 if mamba_backbone else 3) * width, bias=False)
        if mamba_backbone:
            self.conv_q = nn.Conv1d(width, width, CONV_KERNEL, groups=width, bias=True)
            self.conv_k = nn.Conv1d(width, width, CONV_KERNEL, groups=width, bias=True)
            self.gate = nn.Linear(d_model, width, bias=False)
        self.lr = nn.Linear(d_model, H) if learn_eta else None
        self.token_offset = nn.Parameter(torch.zeros(b))
        self.inner_shapes = self._inner_shapes(D)
        for name, shape in self.inner_shapes.items():
            is_bias = len(shape) == 1
            init = torch.zeros(H, *shape) if is_bias else INIT_STD * torch.randn(H, *shape)
            self.register_parameter(f"init_{name}", nn.Parameter(init))
        if inner_norm:
            self.ln_weight = nn.Parameter(torch.ones(H, D))
            self.ln_bias = nn.Parameter(torch.zeros(H, D))
        self.post_norm = nn.LayerNorm(width, eps=1e-6)
        self.out = nn.Linear(width, d_model, bias=False)
        with torch.no_grad():
            for lin in (self.qkv, self.out) + ((self.gate,) if mamba_backbone else ()) \
                    + ((self.lr,) if learn_eta else ()):
                lin.weight.normal_(0.0, INIT_STD)
            if learn_eta:
                self.lr.bias.zero_()

    def _inner_shapes(self, D: int) -> dict[str, tuple[int, ...]]:
        """Per-head shapes of the inner weights, in the ops' state order."""
        raise NotImplementedError

    def set_inner_lr_warmup(self, progress: float) -> None:
        """eta_scale = r + (1 - r) * progress with r = ``eta_warmup_from``: the ramp from r to 1
        over the outer warm-up (docs/maths.md 2.6); no change when the layer has no ramp
        (r None)."""
        if self.eta_warmup_from is not None:
            self.eta_scale = self.eta_warmup_from + (1.0 - self.eta_warmup_from) * progress

    def token_scale(self) -> torch.Tensor:
        """tau [b]: max(0, 1/i + delta_i), 1/i in the parameters' dtype (exact in float64), of
        token_offset as it is now (never a kept copy: ``_kept_tau`` says why). Without
        gradients, where reads are allowed, it is also kept with its values for the decoding
        steps that follow (which then read nothing back) unless a copy of this token_offset at
        this version is kept already."""
        tau = (self._inv_base() + self.token_offset).clamp_min(0.0)
        if not torch.is_grad_enabled() and reads_allowed() and self._current_tau() is None:
            self._keep_tau(tau)
        return tau

    def _inv_base(self) -> torch.Tensor:
        """1/i, i = 1..b, in token_offset's dtype and device. Kept per (b, dtype, device):
        rebuilding it cost a decoding step two operations; not while tracing (the table would
        hold the tracer's tensors)."""
        delta = self.token_offset
        key = (delta.shape[0], delta.dtype, delta.device)
        if torch.compiler.is_compiling():
            return 1.0 / torch.arange(1, key[0] + 1, dtype=key[1], device=key[2])
        cache = self.__dict__.setdefault("_inv_index", {})
        base = cache.get(key)
        if base is None:
            base = cache[key] = 1.0 / torch.arange(1, key[0] + 1, dtype=key[1], device=key[2])
        return base

    def _kept_tau(self) -> tuple[torch.Tensor, tuple[float, ...]]:
        """tau and its values as floats, for a decoding step without gradients (outside
        tracing), so that the step reads nothing back to the host: kept while token_offset is
        the same tensor object at the same version (every in-place update through it moves the
        version: an optimizer step, load_state_dict). Keyed on the object, not on its address:
        another tensor at a recycled address (FSDP2's unsharded parameter where the original
        parameter was freed) once gave evaluation the initial offsets' tau. A write that moves
        no version (FSDP2 refilling its unsharded parameter in place) is not seen by a kept
        copy: full forwards (``token_scale``) never use one."""
        kept = self._current_tau()
        if kept is None:
            kept = self._keep_tau((self._inv_base() + self.token_offset).clamp_min(0.0))
        return kept

    def _current_tau(self) -> tuple[torch.Tensor, tuple[float, ...]] | None:
        """The kept (tau, values) if made from this token_offset object at its version."""
        delta, kept = self.token_offset, self.__dict__.get("_inv_index", {}).get("tau")
        if kept is None or kept[0]() is not delta or kept[1] != delta._version:
            return None
        return kept[2]

    def _keep_tau(self, tau: torch.Tensor) -> tuple[torch.Tensor, tuple[float, ...]]:
        """Keep ``tau`` of the current token_offset and its values (read back) for
        ``_kept_tau``: (a weak reference to token_offset, its version, (tau, values))."""
        delta = self.token_offset
        kept = (weakref.ref(delta), delta._version, (tau, tuple(tau.tolist())))
        self.__dict__.setdefault("_inv_index", {})["tau"] = kept
        return kept[2]

    def _inner_lr(self, x: torch.Tensor) -> torch.Tensor:
        """eta [B, T, H] of x [B, T, d_model]: eta_base * eta_scale * gate / head_dim with the
        learned gate sigmoid(x w_lr + b_lr), or 0.5 without ``learn_eta``."""
        H = self.n_heads
        gate = torch.sigmoid(self.lr(x)) if self.learn_eta else x.new_full((*x.shape[:2], H), 0.5)
        return gate * (self.eta_base * self.eta_scale / self.head_dim)

    def _conv(self, conv: nn.Conv1d, seq: torch.Tensor) -> torch.Tensor:
        """Causal depthwise convolution of seq [B, L + 3, C] (3 carried inputs first) -> [B, L, C]."""
        return causal_depthwise_conv(seq.transpose(1, 2), conv.weight, conv.bias).transpose(1, 2)

    def _split_state(self, state: State, B: int) -> tuple[int, torch.Tensor | None, Any]:
        """(pos, conv_cache, inner) of a carried state (None: the start of a sequence)."""
        if state is None:
            return 0, None, None
        if not isinstance(state, tuple) or len(state) != 3:
            raise TypeError("state must be None or the (pos, conv_cache, inner) tuple this layer returned")
        pos, cache, inner = state
        if self.mamba_backbone and cache is not None:
            shape = (CONV_KERNEL - 1, self.n_heads * self.head_dim)
            if not isinstance(cache, torch.Tensor) or cache.dim() != 3 \
                    or tuple(cache.shape[1:]) != shape or cache.shape[0] not in (1, B):
                got = tuple(cache.shape) if isinstance(cache, torch.Tensor) else type(cache).__name__
                raise ValueError(
                    f"state[1] (conv_cache) must have shape [B, {shape[0]}, {shape[1]}] with "
                    f"B = {B} (x's batch) or 1, got {got}")
            cache = cache.expand(B, *shape)  # a batch of 1 broadcasts, as the inner state
        return pos, cache, inner

    def _backbone_convs(self, qk: torch.Tensor, caches: list[torch.Tensor | None],
                        bounds: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """The Mamba backbone's convolutions of qk [B, T, C] for the documents ``bounds``, each
        behind its own 3 carried inputs (zeros at a start, as a causally padded convolution sees
        before the sequence). Returns XQ, XK [B, T, C] and each document's last 3 inputs."""
        K1 = CONV_KERNEL - 1
        pieces = []
        for (a, b), cache in zip(pairwise(bounds), caches):
            pieces += [qk.new_zeros(qk.shape[0], K1, qk.shape[2]) if cache is None
                       else cache.to(qk.dtype), qk[:, a:b]]
        seq = torch.cat(pieces, dim=1)  # [B, T + 3N, C]
        q, k = self._conv(self.conv_q, seq), self._conv(self.conv_k, seq)  # [B, T + 3N - 3, C]
        n_docs = len(bounds) - 1
        # Output i is the window ending at input i + 3: document d's tokens come out at
        # bounds[d] + 3 d onwards, its last 3 inputs sit at bounds[d + 1] + 3 d onwards.
        if n_docs > 1:
            keep = token_positions(bounds, [a + K1 * d for d, a in enumerate(bounds[:-1])], qk.device)
            q, k = q[:, keep], k[:, keep]
        ends = [b + K1 * d for d, b in enumerate(bounds[1:])]
        return q, k, [seq[:, e:e + K1] for e in ends]

    def forward(self, x: torch.Tensor, state: State = None,
                cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, State]:
        if (self.mode == "dual" and not self.mamba_backbone and is_step(x, cu_seqlens)
                and x.shape[-1] == self.d_model and isinstance(state, TTTLayerState)
                and isinstance(state.pos, int) and state.inner is not None):
            return self._step(x, state)
        bounds, docs = self._documents(x, state, cu_seqlens)  # unpacked: one document
        B, T = x.shape[:2]
        H, D, b = self.n_heads, self.head_dim, self.mini_batch_size
        pos, caches, inners = zip(*(self._split_state(s, B) for s in docs))
        per_row = isinstance(pos[0], torch.Tensor)  # rows at their own places (stack_states)
        if per_row and T != 1:
            raise ValueError(f"a state whose rows sit at different places in their mini-batches "
                             f"(stack_states) continues one token per call, got T={T}")
        proj = self.qkv(x)
        if self.mamba_backbone:
            qk, v = proj.chunk(2, dim=-1)
            q, k, caches = self._backbone_convs(qk, list(caches), bounds)
            qk = None
        else:
            # q and k side by side as 2H heads: rotated in one call. (split, not two slices:
            # its backward is one cat, where each slice's backward zero-fills a [B, T, 3 H D]
            # gradient; docs/performance.md)
            qk, v = proj.split([2 * H * D, H * D], dim=-1)
            qk = split_heads(qk, 2 * H)
        v = split_heads(v, H)  # [B, T, H, D]
        if self.rope:
            # Restart every mini-batch; every document starts its own mini-batches.
            if per_row:
                positions = pos[0].unsqueeze(1)  # [B, 1], already in [0, b)
            elif len(pos) == 1 and pos[0] % b + T <= b:
                positions = slice(pos[0] % b, pos[0] % b + T)  # e.g. every decoding step
            else:
                positions = token_positions(bounds, pos, x.device) % b
            if qk is None:
                q, k = self._rotate_periodic((split_heads(q, H), split_heads(k, H)), positions, b)
            else:
                (qk,) = self._rotate_periodic((qk,), positions, b)
        if qk is not None:
            q, k = qk.split(H, dim=2)
        elif not self.rope:
            q, k = split_heads(q, H), split_heads(k, H)
        eta = self._inner_lr(x)  # [B, T, H]
        norm = {"ln_weight": self.ln_weight if self.inner_norm else None,
                "ln_bias": self.ln_bias if self.inner_norm else None}
        tau = self.token_scale()
        if all(s is None for s in inners):
            inner = self._learned()  # the op shares one start state among packed documents
        else:
            inner = packed_or_single([self._learned() if s is None else s for s in inners],
                                     cu_seqlens)
        o, inner = self.op(
            q, k, v, eta, initial_state=inner, residual=self.residual,
            mini_batch_size=b, token_scale=tau, output_final_state=True,
            mode=self.mode, checkpoint_group=self.checkpoint_group, cu_seqlens=cu_seqlens,
            backend=self.backend, **norm)
        y = self.post_norm(merge_heads(o))
        if self.mamba_backbone:
            y = y * F.gelu(self.gate(x), approximate="tanh")
        finals = [TTTLayerState((p + stop - start) % b, c if self.mamba_backbone else None, s)
                  for p, c, s, start, stop
                  in zip(pos, caches, per_document(inner, cu_seqlens), bounds, bounds[1:])]
        return self.out(y), packed_or_single(finals, cu_seqlens)

    def _step(self, x: torch.Tensor, state: TTTLayerState) -> tuple[torch.Tensor, TTTLayerState]:
        """``forward`` for one token per row continuing a state this layer returned (one place
        for every row, no Mamba backbone, mode "dual", autocast off): the same arithmetic
        without the general path's per-document bookkeeping, for a decoding step's budget."""
        B = x.shape[0]
        H, D, b = self.n_heads, self.head_dim, self.mini_batch_size
        proj = self.qkv(x).view(B, 1, 3 * H, D)
        qk, v = proj[:, :, :2 * H], proj[:, :, 2 * H:]
        if self.rope:
            if qk.dtype in (torch.float32, torch.float64) and not torch.compiler.is_compiling():
                qk = self._rotate_step(qk, state.pos, b)
            else:
                (qk,) = self._rotate_periodic((qk,), slice(state.pos, state.pos + 1), b)
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            tau, values = self.token_scale(), None
        else:  # tau and its values as numbers, kept while token_offset is unchanged
            tau, values = self._kept_tau()
        o, inner = self.step(
            qk[:, :, :H], qk[:, :, H:], v, self._inner_lr(x), state=state.inner,
            ln_weight=self.ln_weight if self.inner_norm else None,
            ln_bias=self.ln_bias if self.inner_norm else None, residual=self.residual,
            mini_batch_size=b, token_scale=tau, token_scale_values=values, backend=self.backend)
        return self.out(self.post_norm(merge_heads(o))), TTTLayerState((state.pos + 1) % b, None,
                                                                       inner)

    def _learned(self) -> tuple[torch.Tensor, ...]:
        """The learned initial inner weights, [1, H, ...] each (the op broadcasts the batch)."""
        return tuple(getattr(self, f"init_{n}").unsqueeze(0) for n in self.inner_shapes)

    def stack_states(self, states: Sequence[State]) -> TTTLayerState:
        """One state for a batch whose row i continues ``states[i]`` (each a state of a batch of
        one from ``forward``), each row at its own place in its mini-batch: ``pos`` and the op's
        place become long tensors [N], and every row carries its mini-batch's start weights and
        gradient sums (zero where the mini-batch is just starting). Such a state continues one
        token per call (T = 1) and stays per row; row i then equals continuing ``states[i]``
        alone."""
        states = check_stackable(states)
        parts = [self._split_state(state, 1) for state in states]
        if any(inner is None for _, _, inner in parts):
            raise ValueError("stack_states needs states returned by forward (not None)")
        inner = TTTState.stack([inner for _, _, inner in parts], self.mini_batch_size)
        conv = None if parts[0][1] is None else cat_rows([c for _, c, _ in parts], "conv_cache")
        return TTTLayerState(inner.pos, conv, inner)

    def state_size(self, seq_len: int = 1) -> int:
        """Floats carried at most: the current mini-batch's start weights and the rows of its
        tokens so far (at most b - 1: inputs and output gradients of each inner layer, 2 D per
        token for TTT-Linear, 10 D for TTT-MLP, per head), plus the Mamba backbone's convolution
        inputs. Constant in ``seq_len``. (States stacked by ``stack_states`` hold b rows per
        stream.)"""
        H = self.n_heads
        weights = sum(H * torch.Size(s).numel() for s in self.inner_shapes.values())
        row = sum(s[0] + s[1] for s in self.inner_shapes.values() if len(s) == 2)  # Din + Dout
        conv = (CONV_KERNEL - 1) * H * self.head_dim if self.mamba_backbone else 0
        return weights + (self.mini_batch_size - 1) * H * row + conv

    def context_parallel(self) -> ContextParallel:
        """The inner LayerNorm makes the update non-affine: the state is relayed rank to
        rank."""
        return ContextParallel.relay()

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, mini_batch_size={self.mini_batch_size}, "
                f"eta_base={self.eta_base}, rope={self.rope}, inner_norm={self.inner_norm}, "
                f"residual={self.residual}, mamba_backbone={self.mamba_backbone}, "
                f"learn_eta={self.learn_eta}, mode={self.mode}"
                + (f", backend={self.backend!r}" if self.backend is not None else ""))


class TTTLinear(_TTTLayer):
    """TTT-Linear: the inner model is f_res(z) = z W + b per head (W [D, D]), eta_base 1.0.
    Options and state as described in ``_TTTLayer``."""

    op = staticmethod(ttt_linear)
    eta_warmup_from: float | None = None  # no inner-learning-rate ramp in TTT-Linear's recipe

    def __init__(self, d_model: int, n_heads: int, *, eta_base: float = 1.0, **options) -> None:
        super().__init__(d_model, n_heads, eta_base=eta_base, **options)

    def _inner_shapes(self, D: int) -> dict[str, tuple[int, ...]]:
        return {"W": (D, D), "b": (D,)}


class TTTMLP(_TTTLayer):
    """TTT-MLP: the inner model is f_res(z) = gelu_tanh(z W1 + b1) W2 + b2 per head with hidden
    size 4 D, eta_base 0.1 (docs/maths.md 2.6). Options and state as described in ``_TTTLayer``."""

    op = staticmethod(ttt_mlp)
    step = staticmethod(ttt_mlp_step)
    eta_warmup_from: float | None = 0.1  # docs/maths.md 2.6: eta ramps from 10% to 100%
    def __init__(self, d_model: int, n_heads: int, *, eta_base: float = 0.1, **options) -> None:
        super().__init__(d_model, n_heads, eta_base=eta_base, **options)

    def _inner_shapes(self, D: int) -> dict[str, tuple[int, ...]]:
        return {"W1": (D, 4 * D), "b1": (4 * D,), "W2": (4 * D, D), "b2": (D,)}
