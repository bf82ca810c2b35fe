"""Training checkpoints: written atomically, verified on load.

A run folder holds ``checkpoints/step-NNNNNNN/`` folders (``config.json``, ``model.safetensors``,
``optimizer.pt``, ``trainer_state.json`` and, written last, ``manifest.json`` with the size and
SHA-256 of every other file) and ``checkpoints/latest``, a one-line text file naming the newest
complete one. A checkpoint is written into a temporary folder next to its final place, every
file and the folder are fsync'ed, and only then is the folder renamed and ``latest`` replaced
(``os.replace`` of a fsync'ed temporary file). A crash at any moment (SIGKILL included) leaves
``latest`` naming a complete checkpoint (or no ``latest`` before the first save); a failed write
(disk full) removes its temporary folder, leaves the previous checkpoint as it was and raises
``CheckpointWriteError``. Loading re-reads every file against the manifest, so a truncated or
corrupted file is reported by name instead of being half-loaded. Every checkpoint is kept unless
the run asks for retention (``prune_checkpoints``, ``--keep-last K``: the K newest complete
ones), which lets a resumed run fall back to an older one when the newest is damaged
(``resume_point``).

Sharded checkpoints (FSDP runs, ``save_sharded_checkpoint``): the same folder, ``latest``,
temporary folder, rename, manifest, verification and retention, but every rank writes its own
shard of the model and of AdamW's moments with ``torch.distributed.checkpoint`` (one
``__R_0.distcp`` file per rank and the ``.metadata`` index) in place of ``model.safetensors``;
rank 0 writes ``config.json``, ``optimizer.pt`` (schedule, random states, carried state),
``trainer_state.json`` and, once every shard is written, the manifest (``"layout":
"sharded"``) that lists and hashes them all, so a damaged or missing shard is reported by name.
The shards are re-cut on load (``load_sharded``), for any world size or mesh, with FSDP or not;
``load_model`` (``eval``, ``generate``, ``export``) and ``consolidate_checkpoint`` read a
sharded checkpoint as one model. The run folder must be on a file system every rank sees.

The trainer saves through ``save_training_checkpoint`` (whole or sharded) and resumes through
``load_optimizer_state`` (whole, sharded, or a whole checkpoint's optimizer state keyed by
parameter name for a run resumed under FSDP: ``optimizer_by_name``) and ``carried_rows`` (a
rank's rows of the carried state).

Test hook: the environment variable ``FASTWEIGHTS_TEST_SLOW_SAVE=<seconds>`` sleeps that long
before every file of a save and before the ``latest`` update, so that a test can SIGKILL a
training process while it is saving, deterministically. It changes nothing else.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
import types
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from .. import state_tree
from .._checks import is_int
from .._files import (  # the folder format, shared with every reader of checkpoints
    CONFIG_FILE,
    LATEST,
    MANIFEST_FILE,
    OPTIMIZER_FILE,
    SHARDED,
    STATE_FILE,
    STEP_DIR,
    WEIGHTS_FILE,
    checkpoint_files,
    checkpoint_problem,
    file_listing,
    is_sharded,
    remove_dead_temporaries,
    resolve_checkpoint,
    write_checksums,
)
from ..models import LanguageModel, LMConfig
from ..ops import TTTState
from ..tasks.tokens import copy_tokenizer, load_tokenizer

SLOW_SAVE_ENV = "FASTWEIGHTS_TEST_SLOW_SAVE"


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (disk full, permissions); ``errno`` is the cause's.
    The previous checkpoint and ``latest`` are left as they were."""


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pause() -> None:
    """The FASTWEIGHTS_TEST_SLOW_SAVE test hook (see the module docstring)."""
    delay = os.environ.get(SLOW_SAVE_ENV)
    if delay:
        time.sleep(float(delay))


def _write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_atomic(path: str | Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` all at once: a reader (or a crash) sees the old content or the
    new, never a truncated file. Used for ``latest``, ``run.json`` and rewritten metrics."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        _write_bytes(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync(path.parent)


def _nonfinite_tensor(model: torch.nn.Module) -> str | None:
    """Name of the first floating parameter or buffer holding NaN or inf, else None (of this
    rank's shards for an FSDP model)."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if isinstance(t, DTensor):
            t = t.to_local()
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


def _remove_stale_temporaries(root: Path) -> None:
    """Delete ``.tmp-step-*-PID`` folders left by killed processes (PID no longer running), so
    that repeated crashes do not fill the disk. Folders of live processes are left alone."""
    remove_dead_temporaries(root, ".tmp-step-*")


def save_checkpoint(run_dir: str | Path, step: int, model: LanguageModel,
                    optimizer_state: dict[str, Any], trainer_state: dict[str, Any]) -> Path:
    """Write checkpoint ``step`` under ``run_dir/checkpoints`` and point ``latest`` at it.

    ``trainer_state`` must be JSON-serialisable (RNG states are stored in ``optimizer.pt``).
    Weights holding NaN or inf are refused (ValueError) and nothing is written, so ``latest``
    keeps naming the last good checkpoint. A write failure (disk full, ...) removes the partial
    temporary folder and raises ``CheckpointWriteError`` naming the checkpoint; the previous
    checkpoint and ``latest`` are untouched. A step folder that already exists and verifies is
    reused as is (a resumed run saving the same step again holds the same content); one that
    does not verify is replaced.
    """
    root = Path(run_dir) / "checkpoints"
    name = f"step-{step:07d}"
    bad = _nonfinite_tensor(model)
    if bad is not None:
        raise ValueError(f"refusing to save checkpoint {name}: the model's {bad} holds NaN or inf "
                         f"(the previous checkpoint in {root} is kept)")
    final = root / name
    tmp = root / f".tmp-{name}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(root)
        if final.is_dir() and checkpoint_problem(final) is not None:
            shutil.rmtree(final)
        if not final.is_dir():
            if tmp.exists():
                shutil.rmtree(tmp)
            _pause()
            model.save_pretrained(tmp)
            _pause()
            torch.save(optimizer_state, tmp / OPTIMIZER_FILE)
            _pause()
            _write_bytes(tmp / STATE_FILE, (json.dumps(trainer_state, indent=2) + "\n").encode())
            for f in tmp.iterdir():
                _fsync(f)
            files = file_listing(tmp, (f for f in checkpoint_files() if f != MANIFEST_FILE))
            _pause()
            _write_bytes(tmp / MANIFEST_FILE,
                         (json.dumps({"format": 1, "files": files}, indent=2) + "\n").encode())
            _fsync(tmp)
            os.rename(tmp, final)
            _fsync(root)
        _pause()
        write_atomic(root / LATEST, (name + "\n").encode())
    except (OSError, RuntimeError, SafetensorError) as err:  # torch.save reports I/O as RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)
        raise _write_error(name, root, err) from err
    return final


def _write_error(name: str, root: Path, err: BaseException) -> CheckpointWriteError:
    """The CheckpointWriteError of checkpoint ``name`` failing with ``err``."""
    cause = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
    previous = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    kept = f"latest still names {previous}" if previous else "no checkpoint was saved before"
    failure = CheckpointWriteError(f"cannot write checkpoint {name} in {root}: {cause}; {kept}")
    failure.errno = getattr(err, "errno", None)
    return failure


def save_sharded_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module,
                            optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any],
                            trainer_state: dict[str, Any]) -> Path | None:
    """Write the sharded checkpoint ``step`` of an FSDP ``model`` and its ``optimizer`` (every
    rank of the process group calls; each writes its shards) and point ``latest`` at it;
    the folder on rank 0, None elsewhere. ``optimizer_state`` (schedule, random states: what
    is not sharded) and ``trainer_state`` are rank 0's, as in ``save_checkpoint``, whose
    guarantees hold: NaN or inf on any rank is a ValueError and nothing is written; a failed
    write on any rank raises ``CheckpointWriteError`` on every rank and leaves ``latest`` and
    the previous checkpoint as they were; a verified folder of the same step is reused."""
    root = Path(run_dir) / "checkpoints"
    name, main = f"step-{step:07d}", dist.get_rank() == 0
    bad = _nonfinite_tensor(model)
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bad)
    bad = next((b for b in flags if b is not None), None)
    if bad is not None:
        raise ValueError(f"refusing to save checkpoint {name}: the model's {bad} holds NaN or inf "
                         f"(the previous checkpoint in {root} is kept)")
    final = root / name
    plan: list[Any] = [None]  # rank 0's (reuse the verified folder?, temporary folder, error)
    if main:
        try:
            root.mkdir(parents=True, exist_ok=True)
            _remove_stale_temporaries(root)
            if final.is_dir() and checkpoint_problem(final) is not None:
                shutil.rmtree(final)
            tmp = root / f".tmp-{name}-{os.getpid()}"
            if tmp.exists():
                shutil.rmtree(tmp)
            plan = [(final.is_dir(), str(tmp), None)]
        except OSError as err:
            plan = [(False, "", str(_write_error(name, root, err)))]
    dist.broadcast_object_list(plan, src=0)
    reuse, tmp, error = plan[0]
    tmp = Path(tmp)
    if error is None and not reuse:
        _pause()
        state = {"model": get_model_state_dict(model),
                 "optim": get_optimizer_state_dict(model, optimizer)}
        try:
            dcp.save(state, checkpoint_id=tmp)  # every rank its shards; rank 0 the index last
        except Exception as err:  # DCP gathers every rank's failure and raises it on all
            error = str(_write_error(name, root, err))
    if main and error is None:
        try:
            if not reuse:
                _pause()
                model.config.save(tmp / CONFIG_FILE)
                torch.save(optimizer_state, tmp / OPTIMIZER_FILE)
                _write_bytes(tmp / STATE_FILE, (json.dumps(trainer_state, indent=2) + "\n").encode())
                for f in tmp.iterdir():
                    _fsync(f)
                files = file_listing(tmp, sorted(f.name for f in tmp.iterdir()))
                _pause()
                _write_bytes(tmp / MANIFEST_FILE, (json.dumps(
                    {"format": 1, "layout": SHARDED, "files": files}, indent=2) + "\n").encode())
                _fsync(tmp)
                os.rename(tmp, final)
                _fsync(root)
            _pause()
            write_atomic(root / LATEST, (name + "\n").encode())
        except (OSError, RuntimeError) as err:
            error = str(_write_error(name, root, err))
    if main and error is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    outcome = [error]
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise CheckpointWriteError(outcome[0])
    return final if main else None


def _read_shards(state: dict[str, Any], ckpt: Path, *, no_dist: bool) -> None:
    """``dcp.load`` of ``state`` from ``ckpt``; ``no_dist``: in this process alone, without the
    warning DCP gives for it (a choice here, not a missing process group)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable "
                                "or uninitialized")
        dcp.load(state, checkpoint_id=ckpt, no_dist=no_dist)


def load_sharded(ckpt: str | Path, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load sharded checkpoint ``ckpt`` (verified by the caller) into ``model`` and
    ``optimizer``, re-cut for this process: an FSDP model of any world size and mesh reads its
    own shards, a plain model (one process, DDP) the whole tensors. Under a process group every
    rank calls."""
    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    try:
        _read_shards(state, Path(ckpt), no_dist=not dist.is_initialized())
    except Exception as err:  # DCP wraps every reader's failure in CheckpointException
        raise ValueError(f"cannot read sharded checkpoint {ckpt}: {str(err).strip()[:500]}") from None
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])


def save_training_checkpoint(run_dir: str | Path, step: int, model: torch.nn.Module,
                             optimizer: torch.optim.Optimizer, rest: dict[str, Any],
                             trainer_state: dict[str, Any], *, sharded: bool) -> Path | None:
    """A training run's checkpoint ``step``: its model and ``optimizer``, ``rest`` (schedule,
    random states, carried state: what is not sharded) and ``trainer_state``; with ``sharded``
    (an FSDP run: every rank calls, ``save_sharded_checkpoint``) or whole (rank 0 alone calls,
    ``save_checkpoint``). Records whether the optimizer had stepped (``load_optimizer_state``
    reads it back). The folder on rank 0, else None."""
    # FSDP's state-dict helpers fill an empty AdamW (a save before the first step) with zero
    # moments at step 1, which a resumed run must drop again.
    rest = {**rest, "optimizer_started": bool(optimizer.state)}
    if sharded:
        return save_sharded_checkpoint(run_dir, step, model, optimizer, rest, trainer_state)
    return save_checkpoint(run_dir, step, model, {"optimizer": optimizer.state_dict(), **rest},
                           trainer_state)


def optimizer_by_name(saved: dict[str, Any], model: torch.nn.Module,
                      whole: torch.optim.Optimizer) -> None:
    """Prepare a whole (single-file) checkpoint's optimizer state to be resumed under FSDP:
    ``saved["optimizer"]`` (keyed by parameter position) is read through ``whole``, a fresh
    optimizer over the whole ``model`` built as the run builds its own, and stored as
    ``saved["optimizer_by_name"]`` (keyed by parameter name), which an FSDP optimizer can load
    (``load_optimizer_state``). Call it before ``model`` is sharded."""
    whole.load_state_dict(saved["optimizer"])
    saved["optimizer_by_name"] = get_optimizer_state_dict(
        model, whole, options=StateDictOptions(full_state_dict=True))


def load_optimizer_state(saved: dict[str, Any], model: torch.nn.Module,
                         optimizer: torch.optim.Optimizer) -> None:
    """Restore ``optimizer`` from a checkpoint's optimizer state (``load_checkpoint``'s second
    item): of a sharded checkpoint, the weights and the moments re-cut for this world
    (``load_sharded``); of a whole checkpoint resumed under FSDP, the state by name
    (``optimizer_by_name``); else the whole state as saved. An optimizer saved before its first
    step is left empty."""
    if "sharded" in saved:
        load_sharded(saved["sharded"], model, optimizer)
    elif "optimizer_by_name" in saved:
        set_optimizer_state_dict(model, optimizer, saved["optimizer_by_name"],
                                 options=StateDictOptions(full_state_dict=True))
    else:
        optimizer.load_state_dict(saved["optimizer"])
    if not saved.get("optimizer_started", True):  # saved before the first step
        optimizer.state.clear()


def carried_rows(carry: dict[str, Any] | None, batch_size: int, first: int, rows: int,
                 device: torch.device) -> tuple[int, Any]:
    """A checkpoint's carried state (``carry``: the stream position and the state of the whole
    global batch of ``batch_size`` rows, as a ``carry_state`` run saves it) for the rank that
    holds rows ``first`` .. ``first + rows - 1``: (the stream position, those rows on
    ``device``). ValueError when the checkpoint holds none, or not ``batch_size`` rows."""
    if carry is None:
        raise ValueError("the checkpoint holds no carried state, but the run trains with "
                         "carry_state")
    state = carry["state"]
    if any(t.dim() == 0 or t.shape[0] != batch_size for t in state_tree.tensors(state)):
        raise ValueError(f"the checkpoint's carried state does not hold batch_size {batch_size} "
                         "rows")
    return carry["position"], state_tree.map_tensors(
        lambda t: t[first:first + rows].to(device), state)


def consolidate_checkpoint(src: str | Path, dst: str | Path,
                           tokenizer: str | Path | None = None) -> Path:
    """Write the model of checkpoint ``src`` (a sharded or single-file checkpoint folder, or a
    run folder) as a single-file checkpoint folder ``dst`` (``save_pretrained``: config.json,
    model.safetensors, checksums.json), which ``native_to_hf`` and every reader of
    checkpoints take; returns ``dst``. The folder must not exist yet. ``tokenizer`` (the one the
    model's ids come from) is copied into it (``copy_tokenizer``) and listed in checksums.json;
    ValueError when its vocabulary is larger than the model's. The weights keep the dtype they
    were saved in (a float64 run's stay float64, whatever this process's default dtype)."""
    dst = Path(dst)
    if dst.exists():
        raise ValueError(f"{dst} already exists: consolidate into a new folder")
    ckpt = resolve_checkpoint(src)
    # built in the dtype it was trained in, not this process's default: the weights unrounded
    dtype, default = _stored_dtype(ckpt), torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = _load_resolved(ckpt)
    finally:
        torch.set_default_dtype(default)
    if tokenizer is not None:
        size = load_tokenizer(tokenizer).vocab_size
        if size > model.config.vocab_size:
            raise ValueError(f"tokenizer {tokenizer} has {size} ids, more than the vocabulary of "
                             f"the model of {src} ({model.config.vocab_size})")
    tmp = dst.with_name(f".tmp-{dst.name}-{os.getpid()}")
    try:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            write_checksums(tmp, (CONFIG_FILE, WEIGHTS_FILE, *copy_tokenizer(tokenizer, tmp)))
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def resume_point(run_dir: str | Path) -> tuple[Path | None, list[str]]:
    """The checkpoint a resumed run continues from, and the problems met finding it.

    That is the folder ``checkpoints/latest`` names when it verifies; otherwise (each problem
    reported) the newest older ``step-*`` folder that verifies: the fallback is chosen because
    every checkpoint is kept and an older one reproduces the same run, only from further back.
    Without a usable ``latest`` every step folder is a candidate. ``(None, [])`` when the run
    has no checkpoint yet; ValueError listing the problems when checkpoints exist but none is
    complete.
    """
    root = Path(run_dir) / "checkpoints"
    problems: list[str] = []
    steps = sorted((int(m.group(1)), p) for p in root.glob("step-*")
                   if (m := STEP_DIR.fullmatch(p.name)) and p.is_dir())
    limit = None
    pointer = root / LATEST
    if pointer.is_file():
        name = pointer.read_text(errors="replace").strip()
        m = STEP_DIR.fullmatch(name)
        if m and (root / name).is_dir():
            limit = int(m.group(1))
        else:
            problems.append(f"{pointer} names {name!r}, which is not a checkpoint folder")
    for step, ckpt in reversed(steps):
        if limit is not None and step > limit:
            continue  # saved but never published by latest; latest's contract wins
        problem = checkpoint_problem(ckpt)
        if problem is None:
            return ckpt, problems
        problems.append(problem)
    if problems:
        raise ValueError(f"no complete checkpoint to resume from in {root}: " + "; ".join(problems))
    return None, problems


def prune_checkpoints(run_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete the checkpoints of ``run_dir`` older than its ``keep_last`` newest complete ones;
    returns the deleted folders, oldest first.

    Complete means verified against the manifest (``checkpoint_problem``), so that a damaged
    newer checkpoint does not count and the newest intact one always stays. Only folders up to
    the one ``latest`` names are candidates: that one and any newer folder (saved but never
    published) are never deleted, nor is anything without a valid ``latest``. A damaged folder
    newer than the last kept complete one is left for ``resume_point`` to report. A folder is
    first renamed to a temporary name (then removed), so a crash mid-deletion leaves no
    half-deleted ``step-*`` folder, only a temporary one that the next save removes.
    """
    if not is_int(keep_last) or keep_last < 1:
        raise ValueError(f"keep_last must be a positive int, got {keep_last!r}")
    root = Path(run_dir) / "checkpoints"
    pointer = root / LATEST
    name = pointer.read_text(errors="replace").strip() if pointer.is_file() else ""
    m = STEP_DIR.fullmatch(name)
    if m is None or not (root / name).is_dir():
        return []
    limit = int(m.group(1))
    candidates = sorted(((int(n.group(1)), p) for p in root.glob("step-*")
                         if (n := STEP_DIR.fullmatch(p.name)) and p.is_dir() and int(n.group(1)) <= limit),
                        reverse=True)
    intact = 0
    for i, (_, ckpt) in enumerate(candidates):
        intact += checkpoint_problem(ckpt) is None
        if intact == keep_last:
            doomed = [p for _, p in reversed(candidates[i + 1:])]
            break
    else:
        return []
    for ckpt in doomed:
        tmp = root / f".tmp-{ckpt.name}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        os.rename(ckpt, tmp)
        shutil.rmtree(tmp)
    return doomed


def load_checkpoint(path: str | Path) -> tuple[LanguageModel, dict[str, Any], dict[str, Any]]:
    """``(model, optimizer_state, trainer_state)`` of a checkpoint written by ``save_checkpoint``
    (a checkpoint folder or a run folder), verified against its manifest first. Of a sharded
    checkpoint, the model is freshly initialised and ``optimizer_state["sharded"]`` names the
    folder: ``load_sharded`` fills model and optimizer once the resumed run has built them."""
    ckpt = resolve_checkpoint(path)
    for name in (OPTIMIZER_FILE, STATE_FILE):
        if not (ckpt / name).is_file():
            raise ValueError(f"{ckpt} holds model weights but no {name}: it cannot be resumed")
    sharded = is_sharded(ckpt)
    model = (LanguageModel(LMConfig.load(ckpt / CONFIG_FILE)) if sharded
             else LanguageModel.from_pretrained(ckpt, verify=False))  # the manifest covered them
    try:
        opt_state = torch.load(ckpt / OPTIMIZER_FILE, map_location="cpu", weights_only=False,
                               pickle_module=_saved_states)
        state = json.loads((ckpt / STATE_FILE).read_text())
    except (OSError, RuntimeError, ValueError, EOFError) as err:
        raise ValueError(f"cannot read training state in {ckpt}: {err}") from None
    if sharded:
        opt_state["sharded"] = str(ckpt)
    return model, opt_state, state


def load_model(path: str | Path) -> LanguageModel:
    """The model of a checkpoint or run folder (``resolve_checkpoint``), each file hashed once:
    by the manifest of a training checkpoint, else by the folder's ``checksums.json``. A sharded
    checkpoint is consolidated in this process (whole tensors, eval mode). The model is built
    in torch's default dtype, as ``LanguageModel.from_pretrained`` builds it."""
    return _load_resolved(resolve_checkpoint(path))


def _stored_dtype(ckpt: Path) -> torch.dtype:
    """The dtype the model of verified checkpoint folder ``ckpt`` was built in: its token
    embedding's (a layer may keep a buffer in another, as TransNormer's float32 Householder)."""
    try:
        if is_sharded(ckpt):
            meta = dcp.FileSystemReader(str(ckpt)).read_metadata()
            return meta.state_dict_metadata["model.embed.weight"].properties.dtype
        with safe_open(str(ckpt / WEIGHTS_FILE), framework="pt") as f:
            return f.get_slice("embed.weight")[:1].dtype
    except (SafetensorError, OSError, KeyError, RuntimeError, ValueError) as err:
        raise ValueError(f"cannot read the weights' dtype in {ckpt}: {err}") from None


def _load_resolved(ckpt: Path) -> LanguageModel:
    """``load_model`` of a checkpoint folder ``resolve_checkpoint`` has verified."""
    if is_sharded(ckpt):
        model = LanguageModel(LMConfig.load(ckpt / CONFIG_FILE))
        state = {"model": model.state_dict()}
        try:
            _read_shards(state, ckpt, no_dist=True)
        except Exception as err:  # DCP wraps every reader's failure in CheckpointException
            raise ValueError(f"cannot read sharded checkpoint {ckpt}: {str(err).strip()[:500]}") from None
        model.load_state_dict(state["model"])
        return model.eval()
    return LanguageModel.from_pretrained(ckpt, verify=not (ckpt / MANIFEST_FILE).is_file())


class _RowsStateBefore(tuple):
    """A TTT layer's carried state as checkpoints written before the TTT state had one form
    pickled it (a NamedTuple of the removed module ops/ttt/decode.py, fields start, prior,
    rows, pos, prior_steps), read as the ``TTTState`` it equals. ``prior`` (gradient sums of an
    op state the layer was given from outside) has no rows form; a layer's own states never
    held it."""

    def __new__(cls, start: Any, prior: Any, rows: Any, pos: Any, prior_steps: Any = 0) -> Any:
        if prior is not None:
            raise ValueError("the checkpoint's carried TTT state holds the gradient sums of an "
                             "op state (an old form without rows); it cannot be continued")
        return TTTState(tuple(start), tuple(rows), pos)


class _Unpickler(pickle.Unpickler):
    """pickle's Unpickler, reading the classes of modules that are gone as what replaced them
    (``_RowsStateBefore``)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "fastweights.ops.ttt.decode":
            return _RowsStateBefore
        return super().find_class(module, name)


_saved_states = types.ModuleType("fastweights_saved_states")  # torch.load's pickle_module
_saved_states.Unpickler = _Unpickler  # type: ignore[attr-defined]
_saved_states.load = lambda f, **kw: _Unpickler(f, **kw).load()  # type: ignore[attr-defined]
