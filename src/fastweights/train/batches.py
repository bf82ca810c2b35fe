"""One rank's training batches: its rows of each global batch, cut into gradient-accumulation
micro-batches, and under context parallelism its shard of their columns; with ``carry_state``
the consecutive windows of every row's stream.

Carried-state streams (``carry_state``) have the data diversity of independent windows: every
row of the global batch reads its own segment of ``STREAM_WINDOWS`` consecutive windows from a
random offset of the whole training split (drawn like ``random_windows``' starts), and after
those windows every row jumps to a new random offset and the carried state restarts. So carried
and window training differ only in the truncation: the same number of independent random places
per byte read, uniformly over the split, but the state flows across up to ``STREAM_WINDOWS``
windows instead of being cut at every window. (Until issue 35 each row read one contiguous
shard of the split from one random offset, so a run of S steps saw only B regions of S x T
bytes: other data as well as another truncation.)

Every rank draws the whole global batch from the same seeded generator (the random stream is the
same everywhere, and the same as one process's), then keeps its part of it, so a run's data does
not depend on its world size or mesh.

Dimension legend: N rows, T sequence length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..tasks.text import Corpus, packed_windows, random_windows, segment_windows
from .config import TrainConfig

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # x, y [N, T], cu_seqlens or None

# carry_state: windows per stream segment; after them every row jumps to a new random offset
# (the state restarts). 16 windows of the reproductions' 128 bytes are 2 KB of carried context.
STREAM_WINDOWS = 16


@dataclass
class BatchSource:
    """The batches of one rank. ``gen``: the run's data generator (saved with checkpoints);
    ``dp_rank`` / ``cp_rank``: the rank's data- and context-parallel coordinates, ``local``: rows
    of a micro-batch per data-parallel replica, ``cp``: context-parallel size.
    ``stream_pos`` (carry_state): where the streams are, ``{"starts": [the global batch's
    segment offsets], "window": windows of the segment already read}``; None before the first
    window (an int, a checkpoint of the old one-shard-per-row layout, starts a new segment)."""

    cfg: TrainConfig
    corpus: Corpus
    gen: torch.Generator
    dp_rank: int
    local: int
    cp_rank: int
    cp: int
    device: torch.device
    stream_pos: dict[str, Any] | int | None = None

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
        """carry_state: the global batch's next windows and whether the streams restart (the
        carried state must start fresh). A segment is ``segment_len`` consecutive windows per
        row, each row from its own offset drawn from the data generator uniformly over the
        offsets where the whole segment fits; at the segment's end every row draws a new one."""
        cfg, pos = self.cfg, self.stream_pos
        windows = self.segment_len()
        restarted = False
        if not isinstance(pos, dict) or pos["window"] >= windows:
            limit = self.corpus.train.numel() - windows * cfg.seq_len  # starts in [0, limit)
            starts = torch.randint(0, limit, (cfg.batch_size,), generator=self.gen)
            restarted = pos is not None  # the first segment starts from a fresh state anyway
            pos = self.stream_pos = {"starts": starts.tolist(), "window": 0}
        x, y = segment_windows(self.corpus.train, torch.tensor(pos["starts"]), cfg.seq_len,
                               pos["window"])
        pos["window"] += 1
        return x, y, restarted

    def segment_len(self) -> int:
        """Windows per stream segment: ``STREAM_WINDOWS``, or as many as the training split
        holds (at least one: ``check_settings`` asked for a window per row's share of it)."""
        fit = (self.corpus.train.numel() - 1) // self.cfg.seq_len
        return max(1, min(STREAM_WINDOWS, fit))
