"""The fast weight paper's synthetic associative retrieval (docs/maths.md 1.8).

One example is a sequence of L (key, value) pairs over S key symbols and S value symbols, a query
key, and as target the value paired with the query's **last** occurrence.

- Setting 1 (``"capacity"``): keys and values drawn without replacement, L = S (every key once).
- Setting 2 (``"update"``): keys and values drawn with replacement, L = 2S, the latest value
  counts; evaluation sequences have length S (the reference code's quirk, kept).

Training batches ask one query per sequence: the key at a uniformly drawn position (so every
key present may be asked; the reference does not say how it picks the query, this is our
choice). Evaluation batches ask every distinct key of each sequence (``mask`` marks the real
queries when sequences hold different numbers of distinct keys).

Dimension legend: N sequences, L pairs per sequence, Q queries per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._checks import check_choice, check_positive_int

SETTINGS = ("capacity", "update")


@dataclass
class RetrievalBatch:
    """keys, values [N, L] long in [0, S); queries, targets [N, Q] long; mask [N, Q] bool."""

    keys: torch.Tensor
    values: torch.Tensor
    queries: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor


def _sequences(setting: str, S: int, N: int, L: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if setting == "capacity":
        # A row-wise random permutation: argsort of uniform noise.
        keys = torch.rand(N, S, generator=gen).argsort(dim=1)[:, :L]
        values = torch.rand(N, S, generator=gen).argsort(dim=1)[:, :L]
    else:
        keys = torch.randint(0, S, (N, L), generator=gen)
        values = torch.randint(0, S, (N, L), generator=gen)
    return keys, values


def last_value(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """The value paired with each query's last occurrence in ``keys`` ([N, L] -> [N, Q]).
    A query that does not occur gets -1."""
    L = keys.shape[1]
    hit = keys[:, None, :] == queries[:, :, None]  # [N, Q, L]
    pos = torch.where(hit, torch.arange(L), -1).amax(dim=-1)  # [N, Q]
    return torch.where(pos >= 0, values.gather(1, pos.clamp(min=0)), -1)


def retrieval_batch(setting: str, S: int, batch_size: int, generator: torch.Generator) -> RetrievalBatch:
    """A training batch: ``batch_size`` sequences (L = S or 2S), one query each."""
    check_choice("setting", setting, SETTINGS)
    check_positive_int("S", S)
    check_positive_int("batch_size", batch_size)
    L = S if setting == "capacity" else 2 * S
    keys, values = _sequences(setting, S, batch_size, L, generator)
    pos = torch.randint(0, L, (batch_size, 1), generator=generator)
    queries = keys.gather(1, pos)
    return RetrievalBatch(keys, values, queries, last_value(keys, values, queries),
                          torch.ones_like(queries, dtype=torch.bool))


def retrieval_eval_batch(setting: str, S: int, generator: torch.Generator, n_sequences: int = 20) -> RetrievalBatch:
    """An evaluation batch: ``n_sequences`` fresh sequences of length S (both settings), each
    queried with every distinct key it holds (Q = S; ``mask`` is False for padding)."""
    check_choice("setting", setting, SETTINGS)
    check_positive_int("S", S)
    check_positive_int("n_sequences", n_sequences)
    keys, values = _sequences(setting, S, n_sequences, S, generator)
    present = torch.zeros(n_sequences, S, dtype=torch.bool).scatter_(1, keys, True)  # [N, S]
    # Present keys first (in key order), absent ones after as masked padding.
    order = (~present).to(torch.int8).argsort(dim=1, stable=True)
    queries = order
    mask = present.gather(1, order)
    return RetrievalBatch(keys, values, queries, last_value(keys, values, queries), mask)
