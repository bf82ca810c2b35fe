"""Evaluation of a language model on a byte split (``evaluate``), and the one forward that
checks a training set-up before anything is written (``try_forward``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .._checks import state_dtype
from ..models import LanguageModel
from ..tasks.text import eval_windows


def loss_logits(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` in the dtype the cross-entropy is taken in: float32, or float64 for a float64
    model (half-precision logits are widened, float64 ones kept: docs/training.md, "Experiments and training")."""
    return logits.to(state_dtype(logits.dtype))


def try_forward(model: LanguageModel, seq_len: int, device: torch.device,
                 carry_state: bool = False) -> None:
    """One forward of a [1, seq_len] batch in eval mode, without gradients and with the random
    streams untouched, so that combinations only a forward can check (a position table shorter
    than seq_len, a context-parallel shard off a block border (``seq_len`` is then the shard's
    length), ...) raise their ValueError before the run folder is written. With
    ``carry_state`` the model must be able to continue: every mixer's state has a fixed size
    (not a cache growing with the context) and a second window from the carried state runs."""
    if carry_state:
        growing = sorted({type(b.mixer).__name__ for b in model.blocks
                          if b.mixer.state_size(2 * seq_len) != b.mixer.state_size(seq_len)})
        if growing:
            raise ValueError(f"carry_state needs mixers with a fixed-size state; the state of "
                             f"{', '.join(growing)} grows with the context (a cache), so carried "
                             "training would attend over the whole stream")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(
                devices=[device] if device.type == "cuda" else []):
            x = torch.zeros(1, seq_len, dtype=torch.long, device=device)
            _, state = model(x)
            if carry_state:
                try:
                    model(x, state)
                except ValueError as err:
                    raise ValueError(f"carry_state: the model cannot continue its state past "
                                     f"a window of seq_len {seq_len}: {err}") from None
    finally:
        model.train(was_training)


@torch.no_grad()
def evaluate(model: LanguageModel, data: torch.Tensor, seq_len: int, max_windows: int,
             carry_state: bool = False, batch_size: int = 16, *,
             shard: tuple[int, int, Any] | None = None) -> float:
    """Mean next-byte cross-entropy (nats) on the first ``max_windows * seq_len`` bytes of
    ``data``. Independent windows by default; with ``carry_state`` the same bytes are one stream
    read segment by segment with the recurrent state carried (no truncation of the context).

    ``shard`` = (rank, size, group): context parallelism; ``model`` runs its mixers on shards
    (``set_mixer_runner``) and this process feeds columns [rank T/size, (rank + 1) T/size) of
    every window; the sums are all-reduced over ``group``, so every rank returns the loss of
    the whole windows."""
    if shard is not None and carry_state:
        raise ValueError("evaluate: carry_state is not supported with shard (context parallelism)")
    was = model.training
    model.eval()
    device = next(model.parameters()).device
    x, y = eval_windows(data, seq_len, max_windows)  # [n, T]
    if shard is not None:
        rank, size, _ = shard
        cols = slice(rank * seq_len // size, (rank + 1) * seq_len // size)
        x, y = x[:, cols], y[:, cols]  # [n, T / size]
    total, count = 0.0, 0
    if carry_state:
        state = None
        for i in range(x.shape[0]):
            logits, state = model(x[i:i + 1].to(device), state)
            total += F.cross_entropy(loss_logits(logits[0]), y[i].to(device), reduction="sum").item()
            count += y[i].numel()
    else:
        for i in range(0, x.shape[0], batch_size):
            logits, _ = model(x[i:i + batch_size].to(device))
            tgt = y[i:i + batch_size].to(device)
            total += F.cross_entropy(loss_logits(logits.flatten(0, 1)), tgt.flatten(), reduction="sum").item()
            count += tgt.numel()
    model.train(was)
    if shard is not None:
        sums = torch.tensor([total, float(count)], dtype=torch.float64, device=device)
        dist.all_reduce(sums, group=shard[2])
        total, count = sums.tolist()
    return total / count
