"""AFT-local over a whole sequence (docs/maths.md 4.2): ``aft_local``.

Dimension legend: B batch, T time, D channels (every channel its own head), s window.
Here ``w`` is the [T_max, T_max] table of pairwise biases; ``band`` the [T, 1, J] window of it
that each row sees.
"""

from __future__ import annotations

import torch

from ..._checks import check_bool, check_int, check_positive_int, state_dtype
from .._autocast import float32_compute
from .chunk import banded_bidirectional, banded_causal
from .common import check_bias_matrix, check_btd, gate
from .full import aft


def _local_band(w_rows: torch.Tensor, first: int, r_left: int, r_right: int) -> torch.Tensor:
    """Biases of the window [t - r_left, t + r_right] of rows t = first .. first + T - 1.

    w_rows [T, P]: the rows' biases against key positions 0..P-1. Returns [T, 1, J] with
    [i, 0, j] = w_rows[i, first + i - r_left + j]; positions outside 0..P-1 are clamped (their
    keys are -inf in the window, so these finite stand-ins never count)."""
    T, P = w_rows.shape
    i = torch.arange(T, device=w_rows.device).unsqueeze(1)
    j = torch.arange(r_left + r_right + 1, device=w_rows.device)
    cols = (first + i - r_left + j).clamp(0, P - 1)
    return w_rows.gather(1, cols).unsqueeze(1)


@float32_compute
def aft_local(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, *, window: int,
    causal: bool = True, chunk_size: int = 64,
) -> torch.Tensor:
    """AFT-local (docs/maths.md 4.2): AFT-full whose bias is w_tt' inside the window
    (0 <= t - t' < s causal, |t - t'| < s bidirectional, s = ``window``) and 0 outside it
    (those pairs still count).

    q, k, v: [B, T, D]; w: [T_max, T_max] with T_max >= T (top-left block used).
    ``window`` is an int >= 0; 0 leaves no pair in the window, which is AFT-simple
    (docs/maths.md 4.5). O(T s D): prefix (and suffix) sums for the pairs outside the window plus
    the window itself, as banded matrix products over blocks of ``chunk_size`` rows. Returns o
    [B, T, D] in q's dtype.
    """
    T = check_btd(q, k, v)[1]
    check_int("window", window, 0)  # 0: no window, AFT-simple
    check_bias_matrix("w", w, T, T, False, q, "[T_max, T_max]")
    check_bool("causal", causal)
    check_positive_int("chunk_size", chunk_size)
    if window == 0:
        return aft(q, k, v, None, causal=causal, chunk_size=chunk_size)
    cdtype = state_dtype(q.dtype)
    k_c, v_c, w_c = k.to(cdtype), v.to(cdtype).unsqueeze(-1), w[:T, :T].to(cdtype)
    r = min(window, T) - 1  # offsets beyond T - 1 cannot occur
    if causal:
        ratio = banded_causal(k_c, v_c, _local_band(w_c, 0, r, 0), window, None, chunk_size)[0]
    else:
        ratio = banded_bidirectional(k_c, v_c, _local_band(w_c, 0, r, r), r, r, chunk_size)
    return gate(q, ratio.squeeze(-1))
