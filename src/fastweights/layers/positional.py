"""Rotary position encodings shared by the layers: pairs (2i, 2i+1), as docs/maths.md 2.1 and
3.3 fix them.

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
    cdtype = _angle_dtype(x)
    angles = positions.to(cdtype).unsqueeze(-1) * inv_freq.to(cdtype)  # [(B,) T, D/2]
    return rotate_pairs(x, angles.cos(), angles.sin())


def _angle_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_{2i}, x_{2i+1}) of x [B, T, H, D] by the angles whose cosines and sines
    are cos, sin [(B,) T, D/2] (float64 for float64 x, else float32)."""
    if cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    if torch.compiler.is_compiling():
        # Traced (torch.export / torch.compile): complex views do not trace, the real form does.
        even, odd = x.to(cos.dtype).unflatten(-1, (-1, 2)).unbind(-1)
        c, s = cos.unsqueeze(2), sin.unsqueeze(2)
        return torch.stack((even * c - odd * s, even * s + odd * c), -1).flatten(-2).to(x.dtype)
    return _rotate_complex(x, torch.complex(cos, sin))


def _rotate_complex(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """``rotate_pairs`` with the rotations as unit complex numbers rot [(B,) T, D/2] (eager)."""
    if rot.dim() == 2:
        rot = rot.unsqueeze(0)
    # As one complex product (even + i odd) * (cos + i sin): the same arithmetic as
    # (even cos - odd sin, even sin + odd cos) in one pass over x instead of six and a stack.
    real = torch.float64 if rot.dtype == torch.complex128 else torch.float32
    pairs = (x if x.dtype == real else x.to(real)).unflatten(-1, (-1, 2))  # [B, T, H, D/2, 2]
    if pairs.storage_offset() % 2 or any(st % 2 for st in pairs.stride()[:-1]):
        pairs = pairs.contiguous()  # a complex view needs whole (re, im) pairs
    out = torch.view_as_real(torch.view_as_complex(pairs) * rot.unsqueeze(2)).flatten(-2)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i + D/2}) of x [B, T, H, D] (the GPT-NeoX layout, which
    flash-linear-attention's rotary embedding uses; the layers of this project pair (2i, 2i+1))
    by the angles whose cosines and sines are cos, sin [(B,) T, D/2] (any float dtype):
    (x_i cos - x_{i+D/2} sin, x_{i+D/2} cos + x_i sin). Computed in cos's dtype promoted with
    x's compute dtype (float32, or float64 for float64 x), returned in x's dtype."""
    if cos.dim() == 2:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    cdtype = torch.promote_types(cos.dtype, _angle_dtype(x))
    c, s = cos.to(cdtype).unsqueeze(2), sin.to(cdtype).unsqueeze(2)  # [B|1, T, 1, D/2]
    first, second = x.to(cdtype).chunk(2, dim=-1)
    return torch.cat((first * c - second * s, second * c + first * s), dim=-1).to(x.dtype)


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

    def _rotary_table(self, x: torch.Tensor, period: int) -> tuple[torch.Tensor, ...]:
        """(cos, sin, cos + i sin) [period, D/2] of the places 0..period-1 in x's angle dtype,
        kept per (period, base, device, dtype) outside tracing (the complex one is None while
        tracing, where no table is kept: it would hold the tracer's tensors)."""
        key = (period, self.rope_base, x.device, _angle_dtype(x))
        compiling = torch.compiler.is_compiling()
        cache = {} if compiling else self.__dict__.setdefault("_rotary_tables", {})
        if key not in cache:
            cdtype = _angle_dtype(x)
            angles = (torch.arange(period, device=x.device).to(cdtype).unsqueeze(-1)
                      * self._rotary_freq(x).to(cdtype))  # [period, D/2]
            cos, sin = angles.cos(), angles.sin()
            cache[key] = (cos, sin, None if compiling else torch.complex(cos, sin))
        return cache[key]

    def _rotate_step(self, x: torch.Tensor, pos: int, period: int) -> torch.Tensor:
        """``_rotate_periodic((x,), slice(pos, pos + 1), period)[0]`` for one token x [B, 1, *, D]
        (float32/float64, pairs contiguous) outside tracing: the rotation of each place is kept
        as its own tensor, so a decoding step multiplies without indexing the table."""
        key = (period, self.rope_base, x.device, x.dtype)
        kept = self.__dict__.setdefault("_rotary_steps", {})
        rots = kept.get(key)
        if rots is None:
            rots = kept[key] = self._rotary_table(x, period)[2].unbind(0)  # [D/2] each
        pairs = torch.view_as_complex(x.unflatten(-1, (-1, 2)))
        return torch.view_as_real(pairs * rots[pos]).flatten(-2)

    def _rotate_periodic(self, xs: tuple[torch.Tensor, ...], positions: torch.Tensor,
                         period: int) -> tuple[torch.Tensor, ...]:
        """``apply_rotary`` of every x in xs at ``positions`` in [0, period) (positions that
        restart every mini-batch or segment), reading cos/sin from a [period, D/2] table kept
        per (device, dtype): the same values apply_rotary computes, without recomputing them
        on every call (the cost that dominates a decoding step's position encoding).
        ``positions``: [T], [B, T] for rows at different places, or a slice of [0, period)
        (consecutive places, read from the table without an index tensor)."""
        cos, sin, rot = self._rotary_table(xs[0], period)
        if rot is None:  # tracing
            cos, sin = cos[positions], sin[positions]
            return tuple(rotate_pairs(x, cos, sin) for x in xs)
        rot = rot[positions]
        return tuple(_rotate_complex(x, rot) for x in xs)
