"""AFT-full's product form (docs/maths.md 4.1, 4.4): the two matrix products of the paper,
num = exp(w) @ (exp(K) * V) and den = exp(w) @ exp(K), stabilised by the row maximum of w and the
column maximum of K, with the rows whose terms underflowed redone in the log-sum-exp form.

Dimension legend: B batch, T the call's rows, L = first + T keys in view (the first ``first`` a
cached past), D channels (every channel its own single-dimensional head), C rows per block, r
rows redone. Inputs are validated and in the compute dtype (float32/float64).

The Triton kernels (``triton.py``) compute the same form with the same references and the
same test for lossy rows; ``redo_lossy`` is the fallback of both.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["exact_rows", "full_product", "lossy_threshold", "redo_lossy"]


def lossy_threshold(dtype: torch.dtype, keys: int) -> float:
    """The denominator below which a row may have lost terms (docs/maths.md 4.4): every term is
    taken relative to the row's reference, so a lost term is below the smallest normal number;
    ``keys`` of them stay below eps times a denominator of ``tiny * keys / eps``. Float32's
    constants for float32 and half operands (bfloat16 has float32's range), float64's for
    float64."""
    info = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32)
    return info.tiny * keys / info.eps


def causal_mask(rows: torch.Tensor, keys: int, first: int) -> torch.Tensor:
    """[r, keys] True where key t' lies after row ``first + rows[i]`` (masked)."""
    return torch.arange(keys, device=rows.device)[None, :] > (first + rows)[:, None]


def full_product(
    k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, first: int, causal: bool, chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ratio R of rows first..L-1 by the product form, and which rows are lossy.

    k, v [B, L, D]; w [T, L], row i the biases of token first + i against every key.
    R_t = [exp(w_t - m_t) @ (exp(K - M) V)] / [exp(w_t - m_t) @ exp(K - M)] with m_t the row
    maximum of w over the keys row t sees (t' <= first + t when causal) and M [B, D] the column
    maximum of K over the keys in view. Causal rows go in blocks of C = ``chunk_size``, each
    against the keys up to its last row (the masked rest of the diagonal block included).
    Returns (R [B, T, D], lossy [T] bool: a denominator below ``lossy_threshold`` in some batch
    row or channel, whose R may have lost terms or be 0 / 0)."""
    B, L, D = k.shape
    T = L - first
    M = k.detach().amax(dim=1, keepdim=True)  # [B, 1, D]
    e = torch.exp(k - M)
    # [L, B * 2D]: the numerator and denominator columns of every batch row, one product
    x = torch.cat([e * v, e], dim=-1).transpose(0, 1).reshape(L, B * 2 * D)
    if causal:
        outs = []
        for r0 in range(0, T, chunk_size):
            r1 = min(r0 + chunk_size, T)
            hi = first + r1  # keys seen by the block's last row
            rows = torch.arange(r0, r1, device=w.device)
            wb = w[r0:r1, :hi].masked_fill(causal_mask(rows, hi, first), float("-inf"))
            a = torch.exp(wb - wb.detach().amax(dim=-1, keepdim=True))
            outs.append(a @ x[:hi])
        out = torch.cat(outs, dim=0)
    else:
        out = torch.exp(w - w.detach().amax(dim=-1, keepdim=True)) @ x
    out = out.view(T, B, 2, D).transpose(0, 1)  # [B, T, 2, D]
    num, den = out[:, :, 0], out[:, :, 1]
    lossy = (den.detach() < lossy_threshold(k.dtype, L)).any(dim=2).any(dim=0)
    # A lossy row is replaced (redo_lossy); the clamp keeps its backward finite meanwhile.
    return num / den.clamp_min(torch.finfo(den.dtype).tiny), lossy


def exact_rows(
    k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, rows: torch.Tensor, first: int,
    causal: bool, budget: int = 2**22,
) -> torch.Tensor:
    """R of the given rows in the log-sum-exp form: the maximum of K + w taken per row and
    channel, exact for keys and biases of any range, O(r L D) elementwise work in blocks of at
    most ``budget`` logits. k, v [B, L, D]; w [T, L]; rows [r] (indices into w's rows).
    Returns [B, r, D]."""
    B, L, D = k.shape
    r = rows.shape[0]
    # A symbolic size (a traced dynamic length) takes every row at once: a block count that
    # depends on it would pin the traced program to one length.
    sizes = (B, L, D, r)
    step = r if any(isinstance(n, torch.SymInt) for n in sizes) else max(1, budget // (B * L * D))
    outs = []
    for s0 in range(0, r, step):
        sel = rows[s0:s0 + step]
        wr = w.index_select(0, sel)
        if causal:
            wr = wr.masked_fill(causal_mask(sel, L, first), float("-inf"))
        logits = k.unsqueeze(1) + wr[None, :, :, None]  # [B, r, L, D]
        p = torch.exp(logits - logits.detach().amax(dim=2, keepdim=True))
        outs.append((p * v.unsqueeze(1)).sum(dim=2) / p.sum(dim=2))
    return torch.cat(outs, dim=1)


def redo_lossy(o: torch.Tensor, lossy: torch.Tensor, redo: Callable[..., torch.Tensor],
               *operands: torch.Tensor) -> torch.Tensor:
    """o [B, T, D] with the rows flagged in ``lossy`` [T] replaced by ``redo(rows, *operands)``
    ([B, r, D] for row indices rows [r]).

    Eager: one device sync reads the flags; only the flagged rows are redone, nothing when none
    is. Traced (torch.compile, torch.export): a ``torch.cond`` on the flags, whose redo branch
    computes every row and keeps the flagged ones (a data-dependent row count would break the
    graph), so no graph break and the same values. Its operands go in as copies: torch.cond
    refuses operands that alias one another (a layer's k and v are views of one projection),
    and they cost O(T D) (w's O(T L)) against the call's O(T L D)."""
    if torch.compiler.is_compiling():
        def fix(o: torch.Tensor, lossy: torch.Tensor, *ops: torch.Tensor) -> torch.Tensor:
            every = torch.arange(o.shape[1], device=o.device)
            return torch.where(lossy[None, :, None], redo(every, *ops), o).contiguous()

        def keep(o: torch.Tensor, lossy: torch.Tensor, *ops: torch.Tensor) -> torch.Tensor:
            return o.clone().contiguous()

        return torch.cond(lossy.any(), fix, keep, (o, lossy, *(x.clone() for x in operands)))
    if not bool(lossy.any()):
        return o
    rows = lossy.nonzero().squeeze(1)
    return o.index_copy(1, rows, redo(rows, *operands).to(o.dtype))
