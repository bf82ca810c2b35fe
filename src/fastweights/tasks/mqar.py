"""Multi-query associative recall (MQAR) for multi-layer language models.

A sequence lists ``n_pairs`` key-value pairs ``k1 v1 k2 v2 ...`` followed by ``n_queries``
queries, each a key seen before followed by its value: ``q1 a1 q2 a2 ...``. Keys come from the
lower half of the vocabulary (distinct within a sequence), values from the upper half (with
replacement); queries are distinct keys of the sequence. The model reads ``input_ids`` and is
scored only where the next token is an answer (``labels`` is -100 elsewhere, the
``cross_entropy`` ignore index).

Dimension legend: N sequences, T = 2 * (n_pairs + n_queries) tokens.
"""

from __future__ import annotations

import torch

from .._checks import check_positive_int

IGNORE = -100


def mqar_batch(n_pairs: int, n_queries: int, vocab_size: int, batch_size: int,
               generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(input_ids [N, T], labels [N, T])`` (long); ``labels[:, t]`` is the answer the
    model must give after reading ``input_ids[:, :t+1]``, or -100."""
    for name, v in (("n_pairs", n_pairs), ("n_queries", n_queries), ("vocab_size", vocab_size),
                    ("batch_size", batch_size)):
        check_positive_int(name, v)
    n_keys = vocab_size // 2
    if n_pairs > n_keys:
        raise ValueError(f"n_pairs ({n_pairs}) must be <= vocab_size // 2 ({n_keys}): keys are distinct")
    if n_queries > n_pairs:
        raise ValueError(f"n_queries ({n_queries}) must be <= n_pairs ({n_pairs})")
    N = batch_size
    keys = torch.rand(N, n_keys, generator=generator).argsort(dim=1)[:, :n_pairs]
    values = n_keys + torch.randint(0, vocab_size - n_keys, (N, n_pairs), generator=generator)
    which = torch.rand(N, n_pairs, generator=generator).argsort(dim=1)[:, :n_queries]
    queries, answers = keys.gather(1, which), values.gather(1, which)
    ctx = torch.stack([keys, values], dim=2).flatten(1)  # [N, 2 * n_pairs]
    qa = torch.stack([queries, answers], dim=2).flatten(1)  # [N, 2 * n_queries]
    input_ids = torch.cat([ctx, qa], dim=1)
    labels = torch.full_like(input_ids, IGNORE)
    q_pos = 2 * n_pairs + 2 * torch.arange(n_queries)  # positions of the queries
    labels[:, q_pos] = answers
    return input_ids, labels
