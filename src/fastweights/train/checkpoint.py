"""Training checkpoints, written atomically.

A run folder holds ``checkpoints/step-NNNNNNN/`` folders (``config.json``, ``model.safetensors``,
``optimizer.pt``, ``trainer_state.json``) and ``checkpoints/latest``, a one-line text file naming
the newest complete one. A checkpoint is written into a temporary folder next to its final
place, every file and the folder are fsync'ed, and only then is the folder renamed and
``latest`` replaced (``os.replace`` of a fsync'ed temporary file). A crash at any moment leaves
``latest`` naming a complete checkpoint (or no ``latest`` before the first save).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from ..models import LanguageModel
from ..models.lm import CONFIG_FILE, WEIGHTS_FILE

OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "trainer_state.json"
LATEST = "latest"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir: str | Path, step: int, model: LanguageModel,
                    optimizer_state: dict[str, Any], trainer_state: dict[str, Any]) -> Path:
    """Write checkpoint ``step`` under ``run_dir/checkpoints`` and point ``latest`` at it.
    ``trainer_state`` must be JSON-serialisable (RNG states are stored in ``optimizer.pt``)."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:07d}"
    final = root / name
    if not final.is_dir():  # the same step saved again (after a resume) holds the same content
        tmp = root / f".tmp-{name}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        model.save_pretrained(tmp)
        torch.save(optimizer_state, tmp / OPTIMIZER_FILE)
        (tmp / STATE_FILE).write_text(json.dumps(trainer_state, indent=2) + "\n")
        for f in tmp.iterdir():
            _fsync(f)
        _fsync(tmp)
        os.rename(tmp, final)
        _fsync(root)
    pointer = root / f".{LATEST}.tmp"
    with open(pointer, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, root / LATEST)
    _fsync(root)
    return final


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or a run folder whose ``checkpoints/latest`` names one.
    Raises ValueError when neither is found."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"checkpoint {path} does not exist")
    if (path / CONFIG_FILE).is_file():
        return path
    pointer = path / "checkpoints" / LATEST
    if pointer.is_file():
        target = path / "checkpoints" / pointer.read_text().strip()
        if (target / CONFIG_FILE).is_file():
            return target
        raise ValueError(f"{pointer} names {target.name}, which is not a complete checkpoint")
    raise ValueError(f"{path} is neither a fastweights checkpoint (no {CONFIG_FILE}) nor a "
                     f"training run folder (no checkpoints/{LATEST})")


def load_checkpoint(path: str | Path) -> tuple[LanguageModel, dict[str, Any], dict[str, Any]]:
    """``(model, optimizer_state, trainer_state)`` of a checkpoint written by ``save_checkpoint``."""
    ckpt = resolve_checkpoint(path)
    model = LanguageModel.from_pretrained(ckpt)
    for name in (OPTIMIZER_FILE, STATE_FILE):
        if not (ckpt / name).is_file():
            raise ValueError(f"{ckpt} holds model weights but no {name}: it cannot be resumed")
    try:
        opt_state = torch.load(ckpt / OPTIMIZER_FILE, map_location="cpu", weights_only=False)
        state = json.loads((ckpt / STATE_FILE).read_text())
    except (OSError, RuntimeError, ValueError, EOFError) as err:
        raise ValueError(f"cannot read training state in {ckpt}: {err}") from None
    return model, opt_state, state


def checkpoint_files() -> tuple[str, ...]:
    """The files every complete training checkpoint holds."""
    return (CONFIG_FILE, WEIGHTS_FILE, OPTIMIZER_FILE, STATE_FILE)
