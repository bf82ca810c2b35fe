"""Long CPU calls of the chunked forms in pieces along time, the state carried between them.

Why: every intermediate of a chunked form is about as large as its input. On Linux, glibc's
malloc serves allocations above its mmap threshold (dynamic, at most 32 MiB) with fresh
mappings, returned on free, so a call whose [B, T, H, D] tensors exceed it takes a first-touch
page fault per 4 KiB of every intermediate, on every call, and the faults do not get faster with
more threads (the measurement: docs/performance.md). Run in pieces of at most ``PIECE_BYTES`` per
input, the intermediates of one piece are reused by the next from the heap.

Pieces are whole chunks (TTT: whole mini-batches, the first one completing the mini-batch the
state left open), so a chunk is computed by the same operations as in one call: every form's
chunks only meet through the carried state, which is exactly the state an ``initial_state`` /
``output_final_state`` round trip hands on (tests: pieces equal one call). Only on CPU, outside
traced programs; GPU calls and calls that fit run whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

# The largest input slice [B, piece, H, D] a chunked CPU form gets at once: a quarter of glibc's
# largest dynamic mmap threshold (32 MiB), so that a piece's intermediates (a few times its
# input) are heap memory that the next piece reuses.
PIECE_BYTES = 8 * 2**20


def piece_length(x: torch.Tensor, widest: int, unit: int, first: int = 0) -> int | None:
    """Tokens per piece for inputs like x [B, T, H, *] whose widest per-head feature dim is
    ``widest``: a multiple of ``unit`` (chunk or mini-batch size) with B * piece * H * widest
    elements of x's size within ``PIECE_BYTES``, at least one unit; None when the whole call fits
    (or x is not on the CPU, or a program is being traced). ``first``: tokens of the first unit
    that an earlier call consumed (TTT's open mini-batch), so that pieces end on unit bounds."""
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    B, T, H = x.shape[:3]
    per_token = B * H * widest * x.element_size()
    if T * per_token <= PIECE_BYTES or T + first <= unit:
        return None
    return max(unit, PIECE_BYTES // per_token // unit * unit)


def in_pieces(run: Callable[..., tuple[torch.Tensor, Any]], xs: Sequence[torch.Tensor],
              state: Any, piece: int | None, first: int = 0) -> tuple[torch.Tensor, Any]:
    """``run(*x_pieces, state) -> (o_piece [B, t, ...], state)`` over consecutive time pieces of
    xs (each [B, T, ...]) of ``piece`` tokens (the first ``piece - first``), the state of one
    handed to the next; returns (o [B, T, ...] concatenated, last state). ``piece`` None: one
    call."""
    if piece is None:
        return run(*xs, state)
    T = xs[0].shape[1]
    outs, t0 = [], 0
    while t0 < T:
        t1 = min(T, t0 + piece - (first if t0 == 0 else 0))
        o, state = run(*(x[:, t0:t1] for x in xs), state)
        outs.append(o)
        t0 = t1
    return torch.cat(outs, dim=1), state
