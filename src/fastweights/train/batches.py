"""One rank's training batches: its rows of each global batch, cut into gradient-accumulation
micro-batches, and under context parallelism its shard of their columns; with ``carry_state``
the consecutive windows of every row's stream.

Every rank draws the whole global batch from the same seeded generator (the random stream is the
same everywhere, and the same as one process's), then keeps its part of it, so a run's data does
not depend on its world size or mesh.

Dimension legend: N rows, T sequence length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tasks.text import Corpus, packed_windows, random_windows, stream_shard_len, stream_windows
from .config import TrainConfig

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # x, y [N, T], cu_seqlens or None


@dataclass
class BatchSource:
    """The batches of one rank. ``gen``: the run's data generator (saved with checkpoints);
    ``dp_rank`` / ``cp_rank``: the rank's data- and context-parallel coordinates, ``local``: rows
    of a micro-batch per data-parallel replica, ``cp``: context-parallel size.
    ``stream_pos`` (carry_state): the stream offset of the next window, None before the first."""

    cfg: TrainConfig
    corpus: Corpus
    gen: torch.Generator
    dp_rank: int
    local: int
    cp_rank: int
    cp: int
    device: torch.device
    stream_pos: int | None = None

    def next(self) -> tuple[list[Batch], bool]:
        """This rank's ``grad_accum`` micro-batches of the next global batch, on device, and
        whether the streams restarted (carry_state: the carried state must start fresh).

        The whole global batch of batch_size x grad_accum rows is drawn at once (the same draw
        as one batch of that many rows); the rank's data-parallel replica takes a contiguous
        slice of it, cut into grad_accum micro-batches of batch_size / replicas rows, and under
        context parallelism the rank's shard of their columns."""
        cfg, corpus, k = self.cfg, self.corpus, self.cfg.grad_accum
        rows = cfg.batch_size * k
        first = self.dp_rank * self.local * k
        parts = [(first + m * self.local, first + (m + 1) * self.local) for m in range(k)]
        if cfg.pack:
            # one draw of the row starts for all micro-batches: each packs its rows of it
            start, batches = self.gen.get_state(), []
            for part in parts:
                self.gen.set_state(start)
                x, y, cu = packed_windows(corpus.train, corpus.train_starts, rows, cfg.seq_len,
                                          self.gen, rows=part)
                batches.append((x.to(self.device), y.to(self.device), cu.to(self.device)))
            return batches, False
        restarted = False
        if cfg.carry_state:
            x, y, restarted = self._stream_windows()
        else:
            x, y = random_windows(corpus.train, rows, cfg.seq_len, self.gen)
        width = cfg.seq_len // self.cp
        cols = slice(self.cp_rank * width, (self.cp_rank + 1) * width)
        return [(x[slice(*part), cols].to(self.device), y[slice(*part), cols].to(self.device), None)
                for part in parts], restarted

    def _stream_windows(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """carry_state: the global batch's next consecutive windows (``stream_windows``) and
        whether they restart; the first offset is drawn from the data generator, and where the
        next window does not fit every row restarts at offset 0 (with a fresh state)."""
        cfg = self.cfg
        last = stream_shard_len(self.corpus.train, cfg.batch_size) - cfg.seq_len - 1
        restarted = False
        if self.stream_pos is None:
            self.stream_pos = int(torch.randint(0, last + 1, (1,), generator=self.gen))
        elif self.stream_pos > last:
            self.stream_pos, restarted = 0, True
        x, y = stream_windows(self.corpus.train, cfg.batch_size, cfg.seq_len, self.stream_pos)
        self.stream_pos += cfg.seq_len
        return x, y, restarted
