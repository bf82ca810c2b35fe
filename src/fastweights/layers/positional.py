"""Rotary position encodings shared by the layers (pairs (2i, 2i+1), as SPEC 2.1 and 3.3 fix).

Dimension legend: B batch, T time, H heads, D head dim (even).
"""

from __future__ import annotations

import torch

from .._checks import is_number


def rotary_inv_freq(dim: int, base: float = 10000.0, dtype: torch.dtype = torch.float32,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """theta_i = base^(-2i/dim), i = 0..dim/2-1, computed in float64 and returned in ``dtype``.
    Returns [dim // 2]. Layers call it with float64 at every forward rather than keep a buffer:
    a buffer would be rounded to the module's dtype (``.float()`` then ``.double()`` leaves
    float32-accurate angles; a bfloat16 module would get 3-digit frequencies)."""
    if dim % 2:
        raise ValueError(f"rotary positions need an even head dim, got {dim}")
    if not is_number(base) or not 0 < base < float("inf"):
        raise ValueError(f"rope_base (the rotary base) must be a finite number > 0, got {base!r}")
    return (base ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim)).to(dtype)


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_{2i}, x_{2i+1}) of x [B, T, H, D] by angle positions[t] * inv_freq[i].

    positions: [T] or [B, T] (any numeric dtype); inv_freq: [D/2].
    """
    cdtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    angles = positions.to(cdtype).unsqueeze(-1) * inv_freq.to(cdtype)  # [(B,) T, D/2]
    if angles.dim() == 2:
        angles = angles.unsqueeze(0)
    cos, sin = angles.cos().unsqueeze(2), angles.sin().unsqueeze(2)  # [B|1, T, 1, D/2]
    xc = x.to(cdtype)
    even, odd = xc[..., 0::2], xc[..., 1::2]
    out = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
    return out.to(x.dtype)


class RotaryFrequencies:
    """Mixin for layers with rotary positions: ``inv_freq`` [head_dim / 2] from the layer's
    ``head_dim`` and ``rope_base``, always float64 (exact whatever the module's dtype; made on
    the fly, never a buffer that ``.float()``/``.to(bfloat16)`` would round)."""

    head_dim: int
    rope_base: float

    def _init_rotary(self, base: float) -> None:
        """Check ``base`` and the (even) head dim, and keep the base; call from ``__init__``."""
        rotary_inv_freq(self.head_dim, base)
        self.rope_base = float(base)

    @property
    def inv_freq(self) -> torch.Tensor:
        return rotary_inv_freq(self.head_dim, self.rope_base, torch.float64)

    def _rotary_freq(self, x: torch.Tensor) -> torch.Tensor:
        """``inv_freq`` on x's device."""
        return rotary_inv_freq(self.head_dim, self.rope_base, torch.float64, x.device)
