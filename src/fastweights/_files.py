"""File helpers shared by the model's save/load and the trainer's checkpoints: sizes and SHA-256
digests of a folder's files, written as a listing ``{name: {"size": int, "sha256": str}}`` and
checked against it."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def file_digest(path: Path) -> tuple[int, str]:
    """(size in bytes, SHA-256 hex digest) of a file, read in 1 MiB blocks."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
            size += len(block)
    return size, h.hexdigest()


def file_listing(folder: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The listing of files ``names`` in ``folder``: {name: {"size": ..., "sha256": ...}}."""
    listing = {}
    for name in names:
        size, sha = file_digest(folder / name)
        listing[name] = {"size": size, "sha256": sha}
    return listing


def listing_problem(folder: Path, listing_path: Path, files: Any,
                    required: Iterable[str]) -> str | None:
    """What is wrong with ``folder`` against ``files``, the listing read from ``listing_path``
    (a corrupt listing, a required file it does not list, a listed file missing, truncated or
    altered, each named with its path); None when every listed file matches."""
    try:
        listed = {name: (int(meta["size"]), str(meta["sha256"])) for name, meta in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        return f"{listing_path} is corrupt ({type(err).__name__}: {err})"
    unlisted = sorted(set(required) - set(listed))
    if unlisted:
        return f"{listing_path} is corrupt: it does not list {', '.join(unlisted)}"
    for name, (size, sha) in listed.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing (listed in {listing_path.name})"
        actual_size, actual_sha = file_digest(path)
        if actual_size != size:
            return f"{path} is truncated or altered: {actual_size} bytes, {listing_path.name} says {size}"
        if actual_sha != sha:
            return f"{path} is corrupted: its SHA-256 differs from the one in {listing_path.name}"
    return None
