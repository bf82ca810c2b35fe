"""What the chunked forms of every family share: [B, T, H, D] tensors cut into chunks of C
tokens (zero-padding the tail), per-head batches of chunks, the state entering each chunk, and
the products of the CPU bfloat16 path.

Dimension legend: B batch, T time, H heads, D a head dim, C chunk size, N number of chunks.

``products``: None (every product in the compute dtype), or torch.bfloat16 for the CPU
bfloat16 path (ops/_autocast.py, float32 inputs only): the large products outside the state
recursion (a chunk's K^T V or U0 is added to a state, never multiplied by it) take bfloat16
operands, and their results are widened to float32 before anything is added to them. PyTorch's CPU matmul reduces bfloat16 products in float32 but rounds
its result to bfloat16 (it has no wider output for bfloat16 operands: ``out_dtype`` is
CUDA-only), so each product's result carries one bfloat16 rounding on top of its operands'.
States, their hand-off between chunks, the delta rule's K K^T and triangular solve, and the
normalisers stay float32: the error is that of one bfloat16 rounding per product, not one that
grows with the number of chunks as a bfloat16 state's would.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def _to_chunks(x: torch.Tensor, C: int) -> torch.Tensor:
    """[B, T, H, *rest] -> [B, H, N, C, *rest], zero-padding T up to N*C."""
    B, T, H = x.shape[:3]
    N = -(-T // C)
    x = x.movedim(1, 2)  # [B, H, T, ...]
    if N * C != T:
        pad = [0, 0] * (x.dim() - 3) + [0, N * C - T]
        x = F.pad(x, pad)
    return x.reshape(B, H, N, C, *x.shape[3:])


def _from_chunks(x: torch.Tensor, T: int) -> torch.Tensor:
    """[B, H, N, C, D] -> [B, T, H, D], dropping the padded tail."""
    B, H, N, C, D = x.shape
    return x.reshape(B, H, N * C, D)[:, :, :T].transpose(1, 2)


def _head_slices(x: torch.Tensor, C: int) -> tuple[torch.Tensor, ...]:
    """[B, T, H, D] -> H tensors [B*N, C, D]: per head, every chunk of every sequence as one
    batch of C x D matrices. Views with a single batch stride, which batched matmuls read in
    place, so no layout copy is made (zero-padding T up to N*C, where needed, is the only one).
    ``unbind`` rather than indexing: its backward is one stack, not H scatters into zeros."""
    B, T, H, D = x.shape
    N = -(-T // C)
    if N * C != T:
        x = F.pad(x, (0, 0, 0, 0, 0, N * C - T))
    return x.reshape(B * N, C, H, D).unbind(2)


def _per_head(
    H: int, shape: tuple[int, ...], like: torch.Tensor, differentiable: bool,
    fn: Callable[[int, torch.Tensor | None], torch.Tensor],
) -> torch.Tensor:
    """[H, *shape]: the stack of ``fn(h, out)`` over heads. Without autograd every head's
    result is written by ``fn`` straight into its slot ``out`` of one buffer (no stack copy);
    with it ``out`` is None and the results are stacked."""
    if differentiable:
        return torch.stack([fn(h, None) for h in range(H)])
    buf = like.new_empty(H, *shape)
    for h in range(H):
        fn(h, buf[h])
    return buf


def _merge_heads(o: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """[H, B*N, C, D] -> [B, T, H, D]: a view, dropping the padded tail. Its consumer merges
    the heads with one copy either way."""
    H, D = o.shape[0], o.shape[-1]
    return o.view(H, B, -1, D)[:, :, :T].permute(1, 2, 0, 3)


def _matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b in float32/float64, into ``out`` when given. bfloat16 operands (the CPU bfloat16
    path) give a bfloat16-rounded result, widened exactly here (see the module docstring)."""
    if a.dtype != torch.bfloat16:
        return torch.matmul(a, b, out=out)
    ab = a @ b
    return ab.float() if out is None else out.copy_(ab)


def _low(x: torch.Tensor, products: torch.dtype | None) -> torch.Tensor:
    """x as a product operand: rounded to ``products`` (None: unchanged)."""
    return x if products is None else x.to(products)


def _entering_states(
    first: torch.Tensor, per_chunk: torch.Tensor, decay: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The states entering each chunk and the final one, for S_{n+1} = decay_n S_n + U_n:
    first [H, B, *s], per_chunk U [H, B, N, *s], decay None (1) or [N, H, 1, ...] broadcasting
    against [H, B, *s]. Returns (entering [H, B, N, *s], final [H, B, *s]).

    A loop of N elementwise steps: cumsum along a middle dimension is several times slower on
    CPU. Without autograd the steps write straight into the stacked result."""
    N = per_chunk.shape[2]

    def step(n: int, S: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if decay is None:
            return torch.add(per_chunk[:, :, n], S, out=out)
        return torch.addcmul(per_chunk[:, :, n], decay[n], S, out=out)

    # The in-place path below writes through non-contiguous out= views, which torch.compile
    # cannot trace: traced programs take the out-of-place path (same values).
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (first, per_chunk, decay)
    )):
        if decay is None:  # one cumsum: a short autograd graph (its backward is one more)
            entering = torch.cat([first.unsqueeze(2), per_chunk[:, :, :-1]], dim=2).cumsum(dim=2)
            return entering, entering[:, :, -1] + per_chunk[:, :, -1]
        states = [first]
        for n in range(N):
            states.append(step(n, states[-1]))
        return torch.stack(states[:-1], dim=2), states[-1]
    entering = per_chunk.new_empty(per_chunk.shape)
    entering[:, :, 0] = first
    for n in range(N - 1):
        step(n, entering[:, :, n], out=entering[:, :, n + 1])
    return entering, step(N - 1, entering[:, :, N - 1])
