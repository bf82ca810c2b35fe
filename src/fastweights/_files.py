"""Checkpoint folders on disk, below every user of them (the model's save/load, the trainer,
the Hugging Face conversion, the command line): the files' names, sizes and SHA-256 digests
written as a listing ``{name: {"size": int, "sha256": str}}`` and checked against it, and the
reading of a checkpoint or training run folder (``resolve_checkpoint``). Writing training
checkpoints is ``fastweights.train.checkpoint``'s.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
CHECKSUM_FILE = "checksums.json"  # size and SHA-256 of the two above (and of a carried tokenizer)
# A training checkpoint also holds these (manifest.json, written last, lists every other file).
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.json"
MANIFEST_FILE = "manifest.json"
SHARDS_INDEX = ".metadata"  # torch.distributed.checkpoint's index of a sharded checkpoint's shards
SHARDED = "sharded"  # manifest.json's "layout" of a sharded (FSDP) training checkpoint
LATEST = "latest"  # checkpoints/latest names a run's newest complete checkpoint
STEP_DIR = re.compile(r"step-(\d{7,})")


def file_digest(path: Path) -> tuple[int, str]:
    """(size in bytes, SHA-256 hex digest) of a file, read in 1 MiB blocks."""
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
            size += len(block)
    return size, h.hexdigest()


def remove_dead_temporaries(root: Path, pattern: str) -> None:
    """Delete the temporary folders ``root/pattern`` whose name ends in ``-PID`` of a process no
    longer running (left by killed writers), so that repeated crashes do not fill the disk.
    Folders of live processes are left alone."""
    for tmp in root.glob(pattern):
        try:
            pid = int(tmp.name.rsplit("-", 1)[1])
        except (ValueError, IndexError):
            continue
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except PermissionError:  # alive, owned by someone else
            pass


def file_listing(folder: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """The listing of files ``names`` in ``folder``: {name: {"size": ..., "sha256": ...}}."""
    listing = {}
    for name in names:
        size, sha = file_digest(folder / name)
        listing[name] = {"size": size, "sha256": sha}
    return listing


def write_checksums(folder: Path, names: Iterable[str]) -> None:
    """Write ``folder/checksums.json``: the listing of its files ``names`` (``file_listing``),
    which ``LanguageModel.from_pretrained`` checks every listed file against."""
    listing = file_listing(folder, names)
    (folder / CHECKSUM_FILE).write_text(json.dumps(listing, indent=2) + "\n")


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


def checkpoint_files(layout: str | None = None) -> tuple[str, ...]:
    """The files every complete training checkpoint holds: of the single-file layout (None), or
    of the ``SHARDED`` one (``torch.distributed.checkpoint``'s index and one ``.distcp`` file
    per rank instead of the weights; ``optimizer.pt`` holds the rest of the training state)."""
    if layout == SHARDED:
        return (CONFIG_FILE, SHARDS_INDEX, OPTIMIZER_FILE, STATE_FILE, MANIFEST_FILE)
    return (CONFIG_FILE, WEIGHTS_FILE, CHECKSUM_FILE, OPTIMIZER_FILE, STATE_FILE, MANIFEST_FILE)


def is_sharded(ckpt: str | Path) -> bool:
    """Whether checkpoint folder ``ckpt`` has the sharded (FSDP) layout."""
    return (Path(ckpt) / SHARDS_INDEX).is_file()


def checkpoint_problem(ckpt: str | Path) -> str | None:
    """What is wrong with training checkpoint folder ``ckpt`` (missing, truncated or corrupted
    file, named with its path), checked against ``manifest.json``; None when it is complete."""
    ckpt = Path(ckpt)
    manifest = ckpt / MANIFEST_FILE
    if not manifest.is_file():
        return f"{ckpt} is incomplete: it has no {MANIFEST_FILE}"
    try:
        saved = json.loads(manifest.read_text())
        files, layout = saved["files"], saved.get("layout")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as err:
        return f"{manifest} is corrupt ({type(err).__name__}: {err})"
    return listing_problem(ckpt, manifest, files, set(checkpoint_files(layout)) - {MANIFEST_FILE})


def _verified(ckpt: Path) -> Path:
    """``ckpt`` after checking a training checkpoint against its manifest (ValueError naming the
    bad file). A model-only folder (``save_pretrained``, no trainer state) has no manifest."""
    if (ckpt / MANIFEST_FILE).exists() or (ckpt / STATE_FILE).exists():
        problem = checkpoint_problem(ckpt)
        if problem is not None:
            raise ValueError(f"checkpoint {problem}")
    return ckpt


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or a run folder whose ``checkpoints/latest`` names one, verified
    against its manifest. Raises ValueError naming the problem (and the bad file)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"checkpoint {path} does not exist")
    if (path / CONFIG_FILE).is_file() or (path / MANIFEST_FILE).is_file():
        return _verified(path)
    pointer = path / "checkpoints" / LATEST
    if pointer.is_file():
        name = pointer.read_text(errors="replace").strip()
        target = path / "checkpoints" / name
        if STEP_DIR.fullmatch(name) and target.is_dir():
            return _verified(target)
        raise ValueError(f"{pointer} names {name!r}, which is not a checkpoint folder")
    raise ValueError(f"{path} is neither a fastweights checkpoint (no {CONFIG_FILE}) nor a "
                     f"training run folder (no checkpoints/{LATEST})")
