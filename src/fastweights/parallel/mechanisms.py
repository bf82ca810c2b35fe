"""The mechanisms a mixer's context-parallel strategy is written with (``Shard``).

Each layer declares its own strategy (``Mixer.context_parallel``, a ``ContextParallel``: its
name, its forward on a shard, and a check of the shard layouts it can take); this module names
no layer. Every strategy builds on the layer contract alone (``forward(x, state) -> (y, state)``,
pieces with the state carried == whole): it finds the state the single-process run would carry
into this rank's first token, then runs the layer on the shard from that state. Three ways to
find it:

- associative scan: every rank runs its shard from an empty state, which gives its
  contribution B (the final state is linear in the incoming one, S_out = A S_in + B); one
  all-gather of the (A, B) of every rank; each rank folds the ranks before it. ``sum_scan``
  (A the identity: states that add up), ``affine_scan`` (A a Dk x Dk matrix read off by running
  the shard once more from the identity, batched as extra sequences, ceil(Dk/Dv) of them),
  ``fold`` (given A and B, a matrix or a per-head scalar), ``prefix`` (sums of the ranks before);
- gather (``gather``): the state is every earlier key and value, all-gathered; O(T) memory per
  rank, like the state itself;
- relay (``relay``): rank r receives rank r-1's final state, runs, sends its own on; sequential
  in time (memory is still split). For state updates that are not affine;
- independent (``independent``): shards that need nothing from other ranks (blocks that never
  cross a shard border, which the layer's check ensures).

Compute: an associative scan runs the layer 2 (sums) or 2 + ceil(Dk/Dv) (affine) times per
shard; the price of reading the state off the unmodified layer rather than a dedicated kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .comm import Channel, Shards

Run = Callable[[torch.Tensor, Any], tuple[torch.Tensor, Any]]  # (x, state) -> (y, state)


def _identity_blocks(Dk: int, Dv: int, like: torch.Tensor) -> list[torch.Tensor]:
    """The Dk x Dk identity as ceil(Dk/Dv) blocks of Dv columns (the last zero-padded)."""
    n = math.ceil(Dk / Dv)
    eye = torch.eye(Dk, n * Dv, dtype=like.dtype, device=like.device)
    return list(eye.split(Dv, dim=1))


class Shard:
    """This rank's shard of one sequence, as a layer's strategy sees it: the layout (``rank``,
    ``world``, ``offset``, ``lengths``), ``run(x, state)`` (the mixer, its random draws replayed
    so every call sees the single-process draw), the collectives of ``chan`` and the mechanisms
    built on them (module docstring)."""

    def __init__(self, shards: Shards, chan: Channel, run: Run) -> None:
        self.shards, self.chan, self.run = shards, chan, run

    @property
    def rank(self) -> int:
        return self.shards.rank

    @property
    def world(self) -> int:
        return self.shards.world

    @property
    def offset(self) -> int:
        """Global position of this shard's first token."""
        return self.shards.offset

    @property
    def lengths(self) -> tuple[int, ...]:
        return self.shards.lengths

    def all_gather(self, tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Every rank's ``tensors`` (same shapes everywhere): ``out[rank][i]``; one collective."""
        return self.chan.all_gather(tensors)

    def prefix(self, values: list[torch.Tensor]) -> torch.Tensor:
        """sum_{j < rank} values[j], the same graph on every rank (weights 0/1, exact)."""
        return sum(v * float(j < self.rank) for j, v in enumerate(values))

    def sum_scan(self, x: torch.Tensor, state0: Any) -> tuple[torch.Tensor, Any]:
        """For states that add up over tokens (a tuple of tensors, e.g. linear attention's
        S, z: LASP-2): the sums of the ranks before, plus ``state0``, start this shard."""
        _, part = self.run(x, None)
        gathered = self.all_gather(list(part))
        start = [self.prefix([g[i] for g in gathered]) for i in range(len(part))]
        if state0 is not None:
            start = [s + s0 for s, s0 in zip(start, state0)]
        return self.run(x, type(part)(*start) if (self.rank or state0 is not None) else None)

    def fold(self, As: list[torch.Tensor], Bs: list[torch.Tensor], S0: torch.Tensor
             ) -> torch.Tensor:
        """S after the ranks before this one: S <- A_j S + B_j from S0 (A_j a matrix
        [B, H, Dk, Dk], or a per-head scalar [H, 1, 1] that multiplies)."""
        S = S0
        for A, B_ in zip(As[:self.rank], Bs[:self.rank]):
            S = (A @ S if A.dim() == S.dim() else A * S) + B_
        return S

    def affine_scan(self, run_batched: Callable[[torch.Tensor], torch.Tensor],
                    S_like: torch.Tensor, S0: torch.Tensor) -> torch.Tensor:
        """The S [B, H, Dk, Dv] that starts this shard, for a shard whose final S is affine in
        its initial one, S_out = A S_in + B_ (the delta rule: A = prod (I - beta k k^T)).

        ``run_batched(S)`` takes S [(1+n) B, H, Dk, Dv] (the zero state then the n identity
        blocks, each for the whole batch) and returns the final S for each; A and B_ are read
        off it, in S's dtype (float32 or wider: the ops keep states there), all-gathered and
        folded from ``S0``."""
        B, H, Dk, Dv = S_like.shape
        blocks = _identity_blocks(Dk, Dv, S_like)
        start = torch.cat([S_like.new_zeros(B, H, Dk, Dv)]
                          + [blk.expand(B, H, Dk, Dv) for blk in blocks])
        out = run_batched(start).unflatten(0, (1 + len(blocks), B))
        const = out[0]
        A = torch.cat([out[1 + j] - const for j in range(len(blocks))], dim=-1)[..., :Dk]
        gathered = self.all_gather([A, const])
        return self.fold([g[0] for g in gathered], [g[1] for g in gathered], S0)

    def gather(self, keys: torch.Tensor, values: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The [B, t, ...] keys and values of the ranks before this one (shards padded to the
        longest for the all-gather, then trimmed)."""
        lengths = self.lengths
        pad = [0, 0] * (keys.dim() - 2) + [0, max(lengths) - keys.shape[1]]
        gathered = self.all_gather([F.pad(keys, pad), F.pad(values, pad)])
        ks = [g[0][:, :n] for g, n in zip(gathered, lengths)][:self.rank]
        vs = [g[1][:, :n] for g, n in zip(gathered, lengths)][:self.rank]
        return torch.cat([keys[:, :0], *ks], dim=1), torch.cat([values[:, :0], *vs], dim=1)

    def relay(self, x: torch.Tensor, state0: Any) -> tuple[torch.Tensor, Any]:
        """Rank r waits for rank r-1's final state (sequential; each rank keeps only its shard's
        activations). The backward pass relays the state's gradient the other way."""
        start = state0 if self.rank == 0 else self.chan.recv_state(self.rank - 1, x.device)
        y, final = self.run(x, start)
        if self.rank < self.world - 1:
            self.chan.send_state(final, self.rank + 1)
        return y, final

    def independent(self, x: torch.Tensor, state0: Any) -> tuple[torch.Tensor, Any]:
        """Shards that need nothing from other ranks: rank 0 continues ``state0``, the others
        start afresh (the layer's check has made sure that is exact)."""
        return self.run(x, state0 if self.rank == 0 else None)
