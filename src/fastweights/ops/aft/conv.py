"""AFT-conv (docs/maths.md 4.2-4.3): ``aft_conv``, with its state ``AFTConvState``.

Dimension legend: B batch, T time, H heads, Dh channels per head, s kernel size,
c = min(tokens seen, s - 1) cached tokens. ``w`` is the [H, s] kernel.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..._checks import check_bool, check_tensor, state_dtype
from .._autocast import float32_compute
from .._state import check_items, checked_tensors
from .._varlen import run_packed
from .chunk import banded_bidirectional
from .common import banded_stream, check_conv_qkv, check_flags, check_kernel, gate
from .naive import banded_naive


class AFTConvState(NamedTuple):
    """The past of causal AFT-conv: the prefix that has left the kernel (a [B, H],
    n [B, H, Dh], m [B, H]) and the last c tokens (k_cache [B, c, H], v_cache [B, c, H, Dh]);
    no position is needed since the bias depends on offsets only."""

    a: torch.Tensor
    n: torch.Tensor
    m: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor

    @classmethod
    def check(cls, state: Any, B: int, H: int, Dh: int, s: int, q: torch.Tensor) -> AFTConvState:
        """A carried state for q [B, T, H, Dh] and a kernel of size s, in the compute dtype."""
        check_items(state, cls)
        check_tensor("initial_state[3] (k_cache)", state[3], 3, "[B, c, H]")
        c = state[3].shape[1]
        if c > s - 1:
            raise ValueError(
                f"initial_state[3] (k_cache) must have shape [B, c, H] with c <= s - 1 = {s - 1}, "
                f"got {tuple(state[3].shape)}")
        specs = {"a": ((B, H), "[B, H]"), "n": ((B, H, Dh), "[B, H, Dh]"), "m": ((B, H), "[B, H]"),
                 "k_cache": ((B, c, H), "[B, c, H]"), "v_cache": ((B, c, H, Dh), "[B, c, H, Dh]")}
        return cls(**checked_tensors(state, cls, specs, q, state_dtype(q.dtype)))


@float32_compute
def aft_conv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, *, causal: bool = True,
    initial_state: tuple | None = None, output_final_state: bool = False, mode: str = "chunk",
    chunk_size: int = 64, cu_seqlens: torch.Tensor | None = None, global_context: bool = True,
    signed: bool = False, gating: bool = True,
) -> tuple[torch.Tensor, AFTConvState | None]:
    """AFT-conv (docs/maths.md 4.2): per head h, one key channel k[..., h] shared by the head's Dh
    value channels and a bias depending only on the offset t - t':

    - causal: w[h, j] is the bias at t - t' = j for j = 0..s-1 (a causal convolution kernel);
    - bidirectional: s must be odd and w[h, j] is the bias at t - t' = j - (s - 1) / 2 (a centred
      kernel, index (s - 1) / 2 being t itself).

    Pairs at other offsets count with bias 0, so this equals AFT-local with window s (causal) or
    (s + 1) / 2 (bidirectional) and the per-head Toeplitz bias.
    q, v: [B, T, H, Dh]; k: [B, T, H]; w: [H, s].
    Returns (o [B, T, H, Dh] in q's dtype, state in float32/float64 or None).

    State (causal only): an ``AFTConvState`` (a, n, m, k_cache, v_cache). ``mode``: "chunk"
    (default; banded matrix products over blocks of ``chunk_size`` rows, O(T s H Dh); a
    one-token call runs the recurrent step), "recurrent" (causal only: token by token with an
    online log-sum-exp) or "naive" (the literal sums, the oracle). ``cu_seqlens``: packed
    documents in a batch of one, each on its own (ops/_varlen.py).

    Ablations of AFT-conv's three ingredients (the paper's reading of it as a convnet with global
    connectivity, non-negative weights and divisive/multiplicative gating; defaults = AFT-conv):
    - ``global_context=False``: pairs outside the kernel weigh 0 (a purely local, normalised
      convolution) instead of e^{K_t'};
    - ``signed=True``: ``w`` holds the kernel's weights c themselves, not biases: pair (t, t')
      weighs c[h, t - t'] e^{K_t'} in the numerator and |c[h, t - t']| e^{K_t'} in the
      denominator (weight 1 outside the kernel), so c = e^{w} gives AFT-conv with biases w and a
      negative c subtracts its values;
    - ``gating=False``: o = the ratio itself, q is ignored (not gated by sigmoid(Q)).
    The first two have the causal chunked form and the naive one (mode="recurrent", and
    mode="chunk" with causal=False, raise ValueError).
    """
    B, _, H, Dh = check_conv_qkv(q, k, v)
    s = check_kernel(w, H, q)
    check_flags(causal, initial_state, output_final_state, mode, chunk_size)
    for name, flag in (("global_context", global_context), ("signed", signed), ("gating", gating)):
        check_bool(name, flag)
    if not causal and s % 2 == 0:
        raise ValueError(f"w must have an odd kernel size s for causal=False (centred kernel), got s = {s}")
    ablated = signed or not global_context
    if ablated and (mode == "recurrent" or (mode == "chunk" and not causal)):
        raise ValueError(f"global_context=False and signed=True have the causal chunk form and the "
                         f"naive one only, got mode={mode!r} with causal={causal}")
    flags = {"global_context": global_context, "signed": signed}
    if cu_seqlens is not None:
        return run_packed(aft_conv, (q, k, v), cu_seqlens, initial_state, output_final_state,
                          w=w, causal=causal, mode=mode, chunk_size=chunk_size, gating=gating,
                          **flags)
    cdtype = state_dtype(q.dtype)
    kc, vc, wc = k.to(cdtype), v.to(cdtype), w.to(cdtype)
    final = None
    if not causal:
        r = (s - 1) // 2
        if mode == "naive":
            ratio = banded_naive(kc, vc, wc[None, None], r, False, s, None, **flags)[0]
        else:  # band[..., j]: t' = t - r + j, the flipped kernel
            ratio = banded_bidirectional(kc, vc, wc.flip(-1).unsqueeze(0), r, r, chunk_size)
    else:
        carried = None if initial_state is None else AFTConvState.check(initial_state, B, H, Dh, s, q)
        kernel = wc.flip(-1).unsqueeze(0)  # [1, H, s], kernel[..., -1 - o] = w[:, o]
        ratio, final = banded_stream(kc, vc, kernel, s, carried, mode, chunk_size, **flags)
    o = gate(q, ratio) if gating else ratio.to(q.dtype)
    return o, (AFTConvState(*final) if output_final_state else None)
