"""File helpers shared by the model's save/load and the trainer's checkpoints."""

from __future__ import annotations

import hashlib
from pathlib import Path


def file_digest(path: Path) -> tuple[int, str]:
    """(size in bytes, SHA-256 hex digest) of a file, read in 1 MiB blocks."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
            size += len(block)
    return size, h.hexdigest()
