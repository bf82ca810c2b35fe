"""Language-model training on a byte corpus: AdamW, linear warm-up then cosine decay, gradient
clipping, optional bfloat16 autocast, periodic validation, early stopping, atomic checkpoints,
exact resuming, CSV metrics (TensorBoard too if installed) and DistributedDataParallel.

Determinism and resuming: every step draws the *global* batch from one ``torch.Generator``
seeded by ``seed`` (the data position); under DDP every rank draws the same global batch and
trains on its own contiguous slice, so the averaged gradient equals one process's. A checkpoint
stores model, optimizer, scheduler, step, the data generator and the torch / python / numpy RNG
states, so a resumed run reproduces the uninterrupted run's losses.

Resuming takes every setting from ``run.json``; only the ``RESUMABLE`` training settings may
change (``steps`` extends a run). The learning-rate schedule is a function of the step and the
*current* total ``steps`` (``lr_factor``), so an extended run continues on the schedule of its
new total: its first new step uses that schedule's value at that step, not the old schedule's
final rate. SIGINT and SIGTERM during training save a checkpoint of the last finished step and
raise ``TrainingInterrupted`` (a second signal interrupts at once).

Context parallelism (``context_parallel`` N > 1, under torchrun): the world is N x the
data-parallel size D. Ranks d*N .. d*N + N - 1 form context-parallel group d: they train on the
same rows of the global batch (data-parallel replica d's slice), each on a contiguous shard of
seq_len / N tokens of every row, and every mixer runs on its shard through
``fastweights.parallel.context_parallel_forward`` on that group (installed with
``LanguageModel.set_mixer_runner``; embeddings, norms, feed-forwards and the head are per
token). Each rank's loss is the mean over its B/D x T/N tokens, all equal in number, and the
gradients are averaged over the whole world after the backward pass, as DDP would (the parameters are replicated on every rank, so
the context-parallel ranks' shares must be summed as well as the replicas averaged): the
result is the gradient of the global batch's mean loss, one process's. Validation runs sharded
the same way. Checkpoints and resuming are unchanged (rank 0 writes); N is a launch setting
like the world size, not recorded in run.json, so a run may resume with another N.

``train`` is the entry point; ``Trainer`` holds one session's phases as methods (``setup``,
``train_step``, ``validate``, ``save``, ``teardown``), so a change to one phase (gradient
accumulation in ``train_step``, another logger in ``_Metrics``) stays local.

Dimension legend: N batch, T sequence length, V vocabulary.
"""

from __future__ import annotations

import csv
import dataclasses
import gc
import io
import json
import math
import os
import random
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from .._checks import is_int
from ..layers.base import Mixer
from ..models import LanguageModel, LMConfig
from ..models.lm import LMState, map_state, state_tensors
from ..parallel import context_parallel_forward
from ..tasks.text import (
    Corpus,
    eval_windows,
    packed_windows,
    random_windows,
    stream_shard_len,
    stream_windows,
)
from .checkpoint import (
    load_checkpoint,
    prune_checkpoints,
    resume_point,
    save_checkpoint,
    write_atomic,
)

RUN_FILE = "run.json"
METRICS_FILE = "metrics.csv"
OUTPUTS = (RUN_FILE, METRICS_FILE, "checkpoints", "tensorboard")  # what a run writes in run_dir
# TrainConfig fields a resumed run may change (applied and recorded in run.json): when to stop,
# validate and save, checkpoint retention and the anomaly guard. None of them changes what a
# step computes, so a resumed run still reproduces the uninterrupted run's steps.
RESUMABLE = ("steps", "eval_every", "save_every", "keep_last", "patience", "anomaly_guard")
# grad_norm: the total gradient norm before clipping (train rows); mixer_grad_norm: the same
# over the token mixers' parameters only (every block's mixer); last so that the rows of files
# written before they existed still read (restval "").
METRIC_FIELDS = ("step", "split", "loss", "perplexity", "lr", "tokens_per_s", "seconds", "grad_norm",
                 "mixer_grad_norm")


@dataclass
class TrainConfig:
    """Optimisation settings. ``batch_size`` is the global batch (split across DDP ranks);
    ``save_every`` 0 saves only at the end; ``keep_last`` K keeps only the K newest complete
    checkpoints (None: every one; ``checkpoint.prune_checkpoints``); ``patience`` 0 disables
    early stopping (else stop after that many validations without a new best). ``anomaly_guard`` stops training with
    ``TrainingAnomaly`` as soon as the loss or the gradient norm is NaN or inf, before that step
    changes the weights, so the last checkpoint stays the last good one. ``recompute`` turns on
    the model's gradient checkpointing (less activation memory, same losses).

    ``carry_state`` trains without truncating the context at window boundaries (truncated
    backpropagation through time, the fast weight paper's carried fast weights): the training
    split is cut into ``batch_size`` contiguous shards, row r reads shard r as one stream in
    consecutive windows of ``seq_len`` (``tasks.text.stream_windows``; all rows at the same
    offset, a random start drawn from ``seed``), and each step starts from the previous step's
    final state, detached (gradients stop at the window boundary). When the next window no
    longer fits in the shards every row restarts at offset 0 from a fresh state. Validation then
    reads its windows as one stream with the state carried too (``evaluate(carry_state=True)``).
    Mixers whose state grows with the context (softmax attention's cache, AFT-full) or that
    cannot continue past a position table are refused, as is ``pack``."""

    steps: int = 300
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_windows: int = 64
    save_every: int = 0
    keep_last: int | None = None
    patience: int = 0
    bf16: bool = False
    seed: int = 0
    anomaly_guard: bool = False
    pack: bool = False  # one packed row per step, state reset at document boundaries
    recompute: bool = False  # gradient checkpointing per block
    carry_state: bool = False  # truncated BPTT: each row reads one stream, state carried (detached)

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "eval_every", "eval_windows"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name in ("warmup", "save_every", "patience"):
            v = getattr(self, name)
            if not is_int(v) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        k = self.keep_last
        if k is not None and (not is_int(k) or k < 1):
            raise ValueError(f"keep_last must be a positive int (or None to keep every checkpoint), "
                             f"got {k!r}")
        for name in ("lr", "grad_clip"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if not 0 <= self.min_lr_ratio <= 1 or not self.weight_decay >= 0:
            raise ValueError("min_lr_ratio must be in [0, 1] and weight_decay >= 0")
        for name in ("anomaly_guard", "pack", "recompute", "bf16", "carry_state"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.pack and self.carry_state:
            raise ValueError("pack and carry_state exclude each other: packed rows restart the "
                             "state at every document and window, carry_state continues it")


class TrainingAnomaly(RuntimeError):
    """The anomaly guard stopped training: the loss or the gradient norm became NaN or inf."""


class TrainingInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM (``signum``) stopped training at ``step`` after the checkpoint
    ``checkpoint`` of that step was saved (None on a DDP rank other than 0, which saves nothing)."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None) -> None:
        name = signal.Signals(signum).name
        where = f"checkpoint {checkpoint} saved" if checkpoint is not None else "checkpoint saved by rank 0"
        super().__init__(f"{name} at step {step}: {where}")
        self.signum, self.step, self.checkpoint = signum, step, checkpoint


class _Signals:
    """While active, SIGINT and SIGTERM only record their number in ``signum`` (the training loop
    then saves and stops at the next step boundary, so no step is half done); a second signal
    raises KeyboardInterrupt at once. The previous handlers come back on exit. Outside the main
    thread, where Python cannot set handlers, nothing is installed."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def _record(self, signum: int, frame: object) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)

    def agreed(self, world: int, device: torch.device) -> int | None:
        """The signal number if any rank was signalled (one decision for all ranks, so that
        they save and stop at the same step), else None."""
        if world == 1:
            return self.signum
        t = torch.tensor([self.signum or 0], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item()) or None


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of ``lr`` at optimiser step ``step`` (0-based): linear warm-up over ``warmup``
    steps, then cosine decay to ``min_lr_ratio`` at ``steps``. A function of (step, total steps)
    alone: a run extended to more steps follows the schedule of its new total from its next
    step on (the rate goes back up from the old schedule's final value)."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _try_forward(model: LanguageModel, seq_len: int, device: torch.device,
                 carry_state: bool = False) -> None:
    """One forward of a [1, seq_len] batch in eval mode, without gradients and with the random
    streams untouched, so that combinations only a forward can check (a position table shorter
    than seq_len, a context-parallel shard off a block border (``seq_len`` is then the shard's
    length), ...) raise their ValueError before the run folder is written. With
    ``carry_state`` the model must be able to continue: every mixer's state has a fixed size
    (not a cache growing with the context) and a second window from the carried state runs."""
    if carry_state:
        growing = sorted({type(b.mixer).__name__ for b in model.blocks
                          if b.mixer.state_size(2 * seq_len) != b.mixer.state_size(seq_len)})
        if growing:
            raise ValueError(f"carry_state needs mixers with a fixed-size state; the state of "
                             f"{', '.join(growing)} grows with the context (a cache), so carried "
                             "training would attend over the whole stream")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(
                devices=[device] if device.type == "cuda" else []):
            x = torch.zeros(1, seq_len, dtype=torch.long, device=device)
            _, state = model(x)
            if carry_state:
                try:
                    model(x, state)
                except ValueError as err:
                    raise ValueError(f"carry_state: the model cannot continue its state past "
                                     f"a window of seq_len {seq_len}: {err}") from None
    finally:
        model.train(was_training)


def set_inner_lr_ramp(model: LanguageModel, step: int, warmup: int) -> None:
    """The inner-learning-rate warm-up of TTT-MLP (SPEC 2.6) at optimiser step ``step``
    (0-based): the layers follow progress min(1, step / warmup) (1 without a warm-up)."""
    model.set_inner_lr_warmup(1.0 if warmup <= 0 else min(1.0, step / warmup))


@torch.no_grad()
def evaluate(model: LanguageModel, data: torch.Tensor, seq_len: int, max_windows: int,
             carry_state: bool = False, batch_size: int = 16, *,
             shard: tuple[int, int, Any] | None = None) -> float:
    """Mean next-byte cross-entropy (nats) on the first ``max_windows * seq_len`` bytes of
    ``data``. Independent windows by default; with ``carry_state`` the same bytes are one stream
    read segment by segment with the recurrent state carried (no truncation of the context).

    ``shard`` = (rank, size, group): context parallelism; ``model`` runs its mixers on shards
    (``set_mixer_runner``) and this process feeds columns [rank T/size, (rank + 1) T/size) of
    every window; the sums are all-reduced over ``group``, so every rank returns the loss of
    the whole windows."""
    if shard is not None and carry_state:
        raise ValueError("evaluate: carry_state is not supported with shard (context parallelism)")
    was = model.training
    model.eval()
    device = next(model.parameters()).device
    x, y = eval_windows(data, seq_len, max_windows)  # [n, T]
    if shard is not None:
        rank, size, _ = shard
        cols = slice(rank * seq_len // size, (rank + 1) * seq_len // size)
        x, y = x[:, cols], y[:, cols]  # [n, T / size]
    total, count = 0.0, 0
    if carry_state:
        state = None
        for i in range(x.shape[0]):
            logits, state = model(x[i:i + 1].to(device), state)
            total += F.cross_entropy(logits[0].float(), y[i].to(device), reduction="sum").item()
            count += y[i].numel()
    else:
        for i in range(0, x.shape[0], batch_size):
            logits, _ = model(x[i:i + batch_size].to(device))
            tgt = y[i:i + batch_size].to(device)
            total += F.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten(), reduction="sum").item()
            count += tgt.numel()
    model.train(was)
    if shard is not None:
        sums = torch.tensor([total, float(count)], dtype=torch.float64, device=device)
        dist.all_reduce(sums, group=shard[2])
        total, count = sums.tolist()
    return total / count


class _Metrics:
    """metrics.csv (always) and TensorBoard (when installed); rank 0 only."""

    def __init__(self, run_dir: Path, resume_step: int | None) -> None:
        self.path = run_dir / METRICS_FILE
        rows: list[dict[str, str]] = []
        if resume_step is not None and self.path.exists():
            rows = _metrics_rows(self.path, resume_step)
        # Rewritten atomically: a crash right now must not lose the rows of earlier sessions.
        text = io.StringIO(newline="")
        header = csv.DictWriter(text, fieldnames=METRIC_FIELDS)
        header.writeheader()
        header.writerows(rows)
        write_atomic(self.path, text.getvalue().encode())
        self.file = open(self.path, "a", newline="")  # noqa: SIM115 (open for the whole run)
        self.writer = csv.DictWriter(self.file, fieldnames=METRIC_FIELDS)
        try:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        except ImportError:
            self.tb = None

    def log(self, step: int, split: str, loss: float, **extra: float) -> None:
        row = {"step": step, "split": split, "loss": f"{loss:.6f}",
               "perplexity": f"{math.exp(min(loss, 50)):.4f}", **{k: f"{v:.6g}" for k, v in extra.items()}}
        self.writer.writerow(row)
        self.file.flush()
        if self.tb is not None:
            self.tb.add_scalar(f"{split}/loss", loss, step)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


def _metrics_rows(path: Path, resume_step: int) -> list[dict[str, str]]:
    """The rows of ``metrics.csv`` up to ``resume_step``: rows logged after the checkpoint are
    logged again by the resumed run, and a row cut short by a crash (no line end, missing
    fields) is dropped, so the file ends up with every step exactly once."""
    lines = [line for line in path.read_text(errors="replace").splitlines(keepends=True)
             if line.endswith("\n")]
    rows = csv.DictReader(lines, fieldnames=METRIC_FIELDS, restval="")
    return [r for r in rows if None not in r and None not in r.values()
            and r["step"].isdigit() and int(r["step"]) <= resume_step]


@dataclass(frozen=True)
class RunRecord:
    """What a run folder's ``run.json`` records: the model and training configs and the name of
    the data (``Corpus.name``: ``stdlib`` or the path it was loaded from)."""

    model: LMConfig
    train: TrainConfig
    data: str


def read_run(run_dir: str | Path) -> RunRecord:
    """The record of the run in ``run_dir``; ValueError naming ``run.json`` when it is missing,
    truncated or not a run file."""
    path = Path(run_dir) / RUN_FILE
    try:
        saved = json.loads(path.read_text())
        data = saved["data"]
        if not isinstance(data, str):
            raise TypeError(f"data must be a string, got {data!r}")
        return RunRecord(LMConfig.from_dict(saved["model"]), TrainConfig(**saved["train"]), data)
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist: {path.parent} holds no training run to resume") from None
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is corrupt or not a fastweights run file "
                         f"({type(err).__name__}: {err})") from None


def same_data(a: str, b: str) -> bool:
    """Whether two data names (``stdlib`` or paths, relative ones from the working folder) name
    the same corpus."""
    if a == b:
        return True
    return "stdlib" not in (a, b) and Path(a).resolve() == Path(b).resolve()


def _resumed_config(record: RunRecord, model_config: LMConfig | None,
                    train_config: TrainConfig | None, corpus: Corpus) -> TrainConfig:
    """The training config of a resumed run: the record's, with ``train_config``'s RESUMABLE
    fields when given. A ``model_config``, a ``train_config`` field outside RESUMABLE or a
    corpus that disagrees with the record is a ValueError naming every difference (resuming
    with other settings would not continue the same run)."""
    differ = []
    if model_config is not None:
        given = model_config.to_dict()
        differ += [f"model.{k} ({given[k]!r}, the run has {v!r})"
                   for k, v in record.model.to_dict().items() if given[k] != v]
    cfg = record.train
    if train_config is not None:
        differ += [f"train.{k} ({getattr(train_config, k)!r}, the run has {v!r})"
                   for k, v in dataclasses.asdict(cfg).items()
                   if k not in RESUMABLE and getattr(train_config, k) != v]
        cfg = dataclasses.replace(cfg, **{k: getattr(train_config, k) for k in RESUMABLE})
    if not same_data(corpus.name, record.data):
        differ.append(f"data ({corpus.name!r}, the run has {record.data!r})")
    if differ:
        raise ValueError(f"resume: {', '.join(differ)} differ from the run's {RUN_FILE}; only "
                         f"{', '.join(RESUMABLE)} may change when a run is resumed")
    return cfg


def _check_run_file(path: Path, ckpt: Path, model_config: LMConfig, cfg: TrainConfig,
                    model: LanguageModel, state: dict[str, Any]) -> None:
    """``run.json`` must describe the checkpoint it resumes (whose files are checksummed): a
    disagreement means run.json was edited or corrupted, and resuming would not reproduce the
    run. The RESUMABLE fields may differ (a run can be extended, ...)."""
    differ = [f"model.{k}" for k, v in model.config.to_dict().items() if model_config.to_dict().get(k) != v]
    saved = state.get("train", {})
    differ += [f"train.{k}" for k, v in dataclasses.asdict(cfg).items()
               if k not in RESUMABLE and k in saved and saved[k] != v]
    if differ:
        raise ValueError(f"{path} disagrees with checkpoint {ckpt} on {', '.join(differ)}: "
                         "run.json was edited or corrupted")


def _mixer_grad_norm(model: torch.nn.Module) -> float | None:
    """The 2-norm of the gradients of the token mixers' parameters (``layers.base.Mixer``
    modules), None for a model without mixer gradients. TransNormer's claim (b) is about the
    attention's gradients, not the whole model's."""
    grads = [p.grad.detach().float().norm() for m in model.modules() if isinstance(m, Mixer)
             for p in m.parameters() if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(grads))) if grads else None


def _all_finite(loss: torch.Tensor, grad_norm: torch.Tensor, world: int) -> bool:
    """Whether loss and gradient norm are finite on every rank (one decision for all ranks)."""
    ok = torch.isfinite(torch.stack([loss.detach().float(), grad_norm.float()])).all().float()
    if world > 1:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def _average_gradients(model: torch.nn.Module, world: int) -> None:
    """Every parameter's gradient summed over all ranks and divided by ``world``, as DDP does
    (a parameter without a gradient on a rank contributes zero there), in one all-reduce."""
    params = [p for p in model.parameters() if p.requires_grad]
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in params])
    dist.all_reduce(flat)
    flat /= world
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad = g.view_as(p)


def _rng_states(data_gen: torch.Generator) -> dict[str, Any]:
    return {"data": data_gen.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "python": random.getstate(), "numpy": np.random.get_state()}


def _set_rng_states(states: dict[str, Any], data_gen: torch.Generator) -> None:
    data_gen.set_state(states["data"])
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])


def _dist_info() -> tuple[int, int, torch.device, bool]:
    """(rank, world size, device, whether this call created the process group) from torchrun's
    environment; initialises the process group (nccl on GPU, gloo on CPU) when WORLD_SIZE > 1
    and none exists yet."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    created = world > 1 and not dist.is_initialized()
    if created:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world, device, created


def _check_corpus(corpus: Corpus, cfg: TrainConfig) -> None:
    """Both splits must hold at least one window of ``seq_len + 1`` bytes (checked before the run
    folder is written, rather than at the first step or validation)."""
    for split, data in (("training", corpus.train), ("validation", corpus.val)):
        if data.numel() < cfg.seq_len + 1:
            raise ValueError(f"the {split} split of data {corpus.name} has {data.numel()} bytes, "
                             f"fewer than seq_len + 1 = {cfg.seq_len + 1}")


def _set_aside(run_dir: Path) -> Path | None:
    """Move the outputs of an earlier run (``OUTPUTS``) into a hidden folder of ``run_dir``, by
    renames (nothing copied or deleted yet); the folder, or None when there were none. Other
    files in ``run_dir`` stay where they are."""
    present = [n for n in OUTPUTS if (run_dir / n).exists() or (run_dir / n).is_symlink()]
    if not present:
        return None
    aside = run_dir / f".replaced-{os.getpid()}"
    aside.mkdir()
    try:
        for name in present:
            os.rename(run_dir / name, aside / name)
    except BaseException:
        _put_back(aside, run_dir)
        raise
    return aside


def _put_back(aside: Path, run_dir: Path) -> None:
    """Undo ``_set_aside``: what the new run wrote in its place is removed."""
    for old in aside.iterdir():
        new = run_dir / old.name
        if new.is_dir() and not new.is_symlink():
            shutil.rmtree(new)
        elif new.exists() or new.is_symlink():
            new.unlink()
        os.rename(old, new)
    aside.rmdir()


class Trainer:
    """One training session in ``run_dir`` (``train`` is the public entry point and documents
    the behaviour): ``setup`` (configs, checks, model, run folder, optimizer; nothing is written
    before every check has passed), ``run`` (the loop of ``train_step``, ``validate`` and
    ``save``), and ``teardown``, always, even after a setup that failed part-way. Every rank
    computes; rank 0 alone writes."""

    def __init__(self, run_dir: str | Path, model_config: LMConfig | None,
                 train_config: TrainConfig | None, corpus: Corpus, *, resume: bool = False,
                 overwrite: bool = False, progress: bool = True, context_parallel: int = 1) -> None:
        if resume and overwrite:
            raise ValueError("resume and overwrite exclude each other")
        cp = context_parallel
        if not is_int(cp) or cp < 1:
            raise ValueError(f"context_parallel must be a positive int, got {cp!r}")
        # context-parallel group size, this rank's place in it and its group (None: no CP)
        self.cp, self.cp_rank, self.cp_group = cp, 0, None
        self.dp, self.dp_rank = 1, 0  # data-parallel replicas and this rank's replica
        self._groups: list[Any] = []  # the subgroups this session created
        self.run_dir, self.corpus = Path(run_dir), corpus
        self.resume, self.overwrite, self.progress = resume, overwrite, progress
        self.model_config, self.train_config = model_config, train_config
        self.rank, self.world, self.device, self._owns_group = 0, 1, torch.device("cpu"), False
        self.metrics: _Metrics | None = None
        self.bar: Any = None
        self.ddp: torch.nn.Module | None = None
        self.model: LanguageModel | None = None
        self.step, self.best, self.since_best = 0, float("inf"), 0
        self.losses: list[tuple[int, float]] = []  # (step, train loss) of this session
        self.tokens, self.elapsed = 0, 0.0  # trained this session, seconds since its first step
        # carry_state: the stream offset of the next window (None before the first step) and
        # this rank's detached state after the last step (None: a fresh state).
        self.stream_pos: int | None = None
        self.carry: LMState | None = None

    @property
    def main(self) -> bool:
        return self.rank == 0

    def setup(self) -> None:
        """Everything before the first step, in the order that makes a resumed run exact: the
        process group, the configs, the checks, the seeds, the model (its first forward tried),
        the run folder, the optimizer and the saved random states."""
        self.rank, self.world, self.device, self._owns_group = _dist_info()
        resumed = self._configure()
        self._check()
        self._split_world()
        torch.manual_seed(self.cfg.seed)
        random.seed(self.cfg.seed)
        np.random.seed(self.cfg.seed)
        self.data_gen = torch.Generator().manual_seed(self.cfg.seed)
        self.model = resumed[0] if resumed else LanguageModel(self.model_config)
        self.model.to(self.device)
        if self.cp_group is not None:
            group = self.cp_group
            self.model.set_mixer_runner(
                lambda mixer, x, state, cu: context_parallel_forward(mixer, x, group=group,
                                                                     state=state, cu_seqlens=cu))
        # before anything is written
        _try_forward(self.model, self.cfg.seq_len // self.cp, self.device, self.cfg.carry_state)
        if resumed:
            self._restore_progress(resumed[2])
        if self.main:  # everything is checked: the new run starts writing here
            self._open_run()
        self.local = self.cfg.batch_size // self.dp  # rows of the global batch per replica
        self._build_optimizer(resumed[1] if resumed else None)
        # Context parallelism averages the gradients itself after the backward pass
        # (_average_gradients): DDP's reducer would run its all-reduces during the backward,
        # interleaved with the context-parallel collectives, and wait forever for the gradients
        # of parameters that only some ranks use (TTT's initial state, read by the first shard).
        self.ddp = (torch.nn.parallel.DistributedDataParallel(self.model)
                    if self.world > 1 and self.cp == 1 else self.model)
        self.autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.bf16)

    def _configure(self) -> tuple[LanguageModel, dict[str, Any], dict[str, Any]] | None:
        """Sets ``cfg`` and ``model_config``: the given ones, or the run's with ``resume`` (then
        the checkpoint to resume is loaded and returned, None when none was saved yet)."""
        if not self.resume:
            if self.model_config is None or self.train_config is None:
                raise ValueError("model_config and train_config are required unless resume=True")
            self.cfg = self.train_config
            earlier = [n for n in OUTPUTS if (self.run_dir / n).exists()] if self.main else []
            if earlier and not self.overwrite:
                raise ValueError(f"{self.run_dir} holds an earlier run ({', '.join(earlier)}); pass "
                                 "overwrite=True to replace it, or resume=True to continue it")
            return None
        record = read_run(self.run_dir)
        self.cfg = _resumed_config(record, self.model_config, self.train_config, self.corpus)
        self.model_config = record.model
        ckpt, problems = resume_point(self.run_dir)
        if self.main:
            for problem in problems:
                print(f"warning: {problem}", file=sys.stderr)
            if ckpt is None:
                print(f"{self.run_dir} holds no checkpoint yet: training restarts from step 0",
                      file=sys.stderr)
            elif problems:
                print(f"resuming from the newest complete checkpoint, {ckpt}", file=sys.stderr)
        if ckpt is None:
            return None
        resumed = load_checkpoint(ckpt)
        _check_run_file(self.run_dir / RUN_FILE, ckpt, self.model_config, self.cfg, resumed[0],
                        resumed[2])
        return resumed

    def _check(self) -> None:
        """The settings must fit the world size, the model and the data."""
        cfg, limit, cp = self.cfg, self.model_config.max_seq_len, self.cp
        if cp > 1:
            if cfg.carry_state:
                raise ValueError(f"carry_state is not supported with context_parallel {cp}: the "
                                 "carried states are gathered and checkpointed per batch row, "
                                 "not per sequence shard")
            if cfg.pack:
                raise ValueError(f"pack is not supported with context_parallel {cp}: context "
                                 "parallelism carries one sequence's state across processes, not "
                                 "per-document states")
            if cfg.seq_len % cp:
                raise ValueError(f"seq_len {cfg.seq_len} must be divisible by context_parallel {cp} "
                                 "(every process holds an equal shard of each sequence)")
            if self.world % cp:
                raise ValueError(f"the world size {self.world} must be a multiple of "
                                 f"context_parallel {cp} (world = context_parallel x data-parallel "
                                 "replicas)")
        dp = self.world // cp
        if cfg.batch_size % dp:
            what = "world size" if cp == 1 else "number of data-parallel replicas (world / context_parallel)"
            raise ValueError(f"batch_size {cfg.batch_size} must be divisible by the {what} {dp}")
        if limit is not None and cfg.seq_len > limit:
            raise ValueError(f"seq_len {cfg.seq_len} exceeds the model's max_seq_len {limit}")
        _check_corpus(self.corpus, cfg)
        if cfg.carry_state:
            shard = stream_shard_len(self.corpus.train, cfg.batch_size)
            if shard < cfg.seq_len + 1:
                raise ValueError(
                    f"carry_state cuts the training split of data {self.corpus.name} "
                    f"({self.corpus.train.numel()} bytes) into batch_size {cfg.batch_size} "
                    f"streams of {shard} bytes, fewer than seq_len + 1 = {cfg.seq_len + 1}")

    def _split_world(self) -> None:
        """The data-parallel and context-parallel coordinates of this rank; with context
        parallelism, the process group of its N consecutive ranks (every rank creates every
        group, in the same order, as ``new_group`` requires)."""
        self.dp, self.dp_rank, self.cp_rank = self.world // self.cp, self.rank // self.cp, self.rank % self.cp
        if self.cp == 1:
            return
        for d in range(self.dp):
            group = dist.new_group(list(range(d * self.cp, (d + 1) * self.cp)))
            self._groups.append(group)
            if d == self.dp_rank:
                self.cp_group = group

    def _restore_progress(self, state: dict[str, Any]) -> None:
        """Step and early-stopping counters of the resumed checkpoint."""
        self.step, self.best, self.since_best = (state["step"], state["best_val_loss"],
                                                 state["since_best"])
        if self.cfg.steps < self.step:
            raise ValueError(f"steps {self.cfg.steps} is fewer than the {self.step} steps the run "
                             "has trained already (a run can be extended, not shortened)")

    def _open_run(self) -> None:
        """Write run.json and open metrics.csv (rank 0). With ``overwrite`` the earlier run's
        outputs are set aside first, deleted once both are written, put back if that fails."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        aside = _set_aside(self.run_dir) if self.overwrite else None
        record = {"model": self.model_config.to_dict(), "train": dataclasses.asdict(self.cfg),
                  "data": self.corpus.name}
        try:
            write_atomic(self.run_dir / RUN_FILE, (json.dumps(record, indent=2) + "\n").encode())
            self.metrics = _Metrics(self.run_dir, self.step if self.resume else None)
        except BaseException:
            if aside is not None:
                _put_back(aside, self.run_dir)
            raise
        if aside is not None:
            shutil.rmtree(aside)

    def _build_optimizer(self, saved: dict[str, Any] | None) -> None:
        """AdamW (no weight decay on vectors) and the schedule; with ``saved`` (a checkpoint's
        optimizer state) their state and the random states are restored."""
        cfg, model = self.cfg, self.model
        model.train()
        model.set_gradient_checkpointing(cfg.recompute)
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}],
                                     lr=cfg.lr, betas=(0.9, 0.95))
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(s, cfg))
        if saved is None:
            return
        self.opt.load_state_dict(saved["optimizer"])
        self.sched.load_state_dict(saved["scheduler"])
        # The optimizer state holds the rate the *saved* schedule set for this step; the
        # schedule is a function of (step, cfg.steps), and cfg.steps may have grown (an extended
        # run), so the rate is recomputed: the same value when steps is unchanged.
        for group, base in zip(self.opt.param_groups, self.sched.base_lrs):
            group["lr"] = base * lr_factor(self.step, cfg)
        _set_rng_states(saved["rng"], self.data_gen)
        if self.cfg.carry_state:
            self._restore_carry(saved.get("carry"))

    def _restore_carry(self, carry: dict[str, Any] | None) -> None:
        """The stream offset and this rank's rows of the saved global carried state."""
        if carry is None:
            raise ValueError("the checkpoint holds no carried state, but the run trains with "
                             "carry_state")
        self.stream_pos = carry["position"]
        state, rows = carry["state"], self.cfg.batch_size
        leaves = [] if state is None else state_tensors(state)
        if any(t.dim() == 0 or t.shape[0] != rows for t in leaves):
            raise ValueError(f"the checkpoint's carried state does not hold batch_size {rows} "
                             "rows")
        first = self.rank * self.local
        self.carry = map_state(lambda t: t[first:first + self.local].to(self.device), state)

    def run(self, stop_after: int | None = None) -> list[tuple[int, float]]:
        """Train until ``cfg.steps`` (or early stopping, or ``stop_after`` without the final
        save); a signal saves and raises ``TrainingInterrupted``. The session's losses."""
        from tqdm import tqdm

        cfg = self.cfg
        self.bar = tqdm(total=cfg.steps, initial=self.step, desc="train", unit="step",
                        disable=not (self.main and self.progress))
        self._start = time.perf_counter()
        with _Signals() as signals:
            while self.step < cfg.steps and not signals.agreed(self.world, self.device):
                self.train_step()
                due = self.step % cfg.eval_every == 0 or self.step == cfg.steps
                stopped_early = self.validate() if due else False
                if stop_after is not None and stop_after <= self.step < cfg.steps:
                    break
                if stopped_early or self.step == cfg.steps or (
                        cfg.save_every and self.step % cfg.save_every == 0):
                    self.save()
                if stopped_early:
                    if self.main:
                        self.bar.write(f"early stop at step {self.step}: {self.since_best} "
                                       "validations without a new best")
                    break
            signum = signals.agreed(self.world, self.device)
            if signum is not None:  # a signal during the loop, or during its last step's save
                raise TrainingInterrupted(signum, self.step, self.save())
        return self.losses

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """This rank's rows of the next global batch (its data-parallel replica's; every rank
        draws the whole global batch, so the random stream is the same everywhere) and, under
        context parallelism, its shard of their columns: (x, y, cu_seqlens or None), on device."""
        cfg, corpus = self.cfg, self.corpus
        rows = (self.dp_rank * self.local, (self.dp_rank + 1) * self.local)
        if cfg.pack:
            x, y, cu = packed_windows(corpus.train, corpus.train_starts, cfg.batch_size,
                                      cfg.seq_len, self.data_gen, rows=rows)
            return x.to(self.device), y.to(self.device), cu.to(self.device)
        if cfg.carry_state:
            x, y = self._next_stream_windows()
        else:
            x, y = random_windows(corpus.train, cfg.batch_size, cfg.seq_len, self.data_gen)
        width = cfg.seq_len // self.cp
        part = (slice(*rows), slice(self.cp_rank * width, (self.cp_rank + 1) * width))
        return x[part].to(self.device), y[part].to(self.device), None

    def _next_stream_windows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """carry_state: the global batch's next consecutive windows (``stream_windows``); the
        first offset is drawn from the data generator, and where the next window does not fit
        every row restarts at offset 0 with a fresh state."""
        cfg = self.cfg
        last = stream_shard_len(self.corpus.train, cfg.batch_size) - cfg.seq_len - 1
        if self.stream_pos is None:
            self.stream_pos = int(torch.randint(0, last + 1, (1,), generator=self.data_gen))
        elif self.stream_pos > last:
            self.stream_pos, self.carry = 0, None
        x, y = stream_windows(self.corpus.train, cfg.batch_size, cfg.seq_len, self.stream_pos)
        self.stream_pos += cfg.seq_len
        return x, y

    def train_step(self) -> float:
        """One optimiser step on the next global batch; its loss (the global batch's under DDP
        and context parallelism, identical to one process's), logged."""
        cfg = self.cfg
        set_inner_lr_ramp(self.model, self.step, cfg.warmup)
        x, y, cu = self._next_batch()
        with self.autocast:
            logits, state = self.ddp(x, self.carry, cu_seqlens=cu)
        if cfg.carry_state:  # the next step continues from here; gradients stop at the boundary
            self.carry = map_state(torch.Tensor.detach, state)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.cp > 1:
            _average_gradients(self.model, self.world)
        mixer_norm = _mixer_grad_norm(self.model) if self.main else None  # before clipping
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        if cfg.anomaly_guard and not _all_finite(loss, grad_norm, self.world):
            raise self._anomaly(loss.item(), grad_norm.item())
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.sched.step()
        self.step += 1
        self.tokens += cfg.batch_size * cfg.seq_len
        loss_value = loss.item()
        if self.world > 1:
            t = torch.tensor([loss_value], device=self.device)
            dist.all_reduce(t)
            loss_value = t.item() / self.world
        self.losses.append((self.step, loss_value))
        self.elapsed = time.perf_counter() - self._start
        if self.main:
            rate = self.tokens / self.elapsed
            self.metrics.log(self.step, "train", loss_value, lr=lr, tokens_per_s=rate,
                             seconds=self.elapsed, grad_norm=grad_norm.item(),
                             **({} if mixer_norm is None else {"mixer_grad_norm": mixer_norm}))
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{rate:.0f}")
        return loss_value

    def _anomaly(self, loss: float, grad_norm: float) -> TrainingAnomaly:
        """The anomaly guard's error for the step about to be taken, naming the checkpoint kept."""
        pointer = self.run_dir / "checkpoints" / "latest"
        kept = (f"the last good checkpoint, {pointer.read_text().strip()}, is kept in "
                f"{pointer.parent}" if pointer.is_file() else "no checkpoint had been saved yet")
        return TrainingAnomaly(
            f"anomaly guard: at step {self.step + 1} the training loss is {loss:.6g} and the "
            f"gradient norm {grad_norm:.6g}; training stopped before this step changed the "
            f"weights, {kept}")

    def validate(self) -> bool:
        """Validation loss (logged by rank 0) and the early-stopping count: whether patience
        has run out."""
        shard = (self.cp_rank, self.cp, self.cp_group) if self.cp_group is not None else None
        val = evaluate(self.model, self.corpus.val, self.cfg.seq_len, self.cfg.eval_windows,
                       shard=shard, carry_state=self.cfg.carry_state)
        if self.main:
            self.metrics.log(self.step, "val", val, seconds=self.elapsed)
            self.bar.write(f"step {self.step}: val loss {val:.4f}, perplexity {math.exp(val):.3f}")
        if val < self.best:
            self.best, self.since_best = val, 0
            return False
        self.since_best += 1
        return self.cfg.patience > 0 and self.since_best >= self.cfg.patience

    def save(self) -> Path | None:
        """Checkpoint of the current step (rank 0; the others wait for it), then ``keep_last``
        retention; the checkpoint's folder on rank 0, else None."""
        path = None
        carry = self._gathered_carry() if self.cfg.carry_state else None
        if self.main:
            extra = {} if carry is None else {"carry": carry}
            path = save_checkpoint(
                self.run_dir, self.step, self.model,
                {"optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(),
                 "rng": _rng_states(self.data_gen), **extra},
                {"step": self.step, "best_val_loss": self.best, "since_best": self.since_best,
                 "train": dataclasses.asdict(self.cfg)})
            if self.cfg.keep_last is not None:
                prune_checkpoints(self.run_dir, self.cfg.keep_last)
        if self.world > 1:
            dist.barrier()
        return path

    def _gathered_carry(self) -> dict[str, Any]:
        """carry_state: the stream offset and the carried state of the whole global batch, on
        the CPU (every rank's rows, gathered in rank order; every rank takes part), so that a
        resumed run, on any number of ranks, continues each row's stream exactly."""
        state = map_state(lambda t: t.detach().cpu(), self.carry)
        if self.world > 1:
            parts: list[Any] = [None] * self.world
            dist.all_gather_object(parts, state)
            if state is not None:
                leaves = [state_tensors(p) for p in parts]
                merged = iter([torch.cat(ts) for ts in zip(*leaves)])
                state = map_state(lambda _: next(merged), state)
        return {"position": self.stream_pos, "state": state}

    def teardown(self) -> None:
        """Close the progress bar and metrics; under DDP free DDP's reducer and end the process
        group this session created (on success or error)."""
        if self.bar is not None:
            self.bar.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.world > 1:
            # DDP's reducer keeps the backend's work objects (and their tensors) alive; left to
            # interpreter shutdown, gloo may abort the process (SIGABRT) while freeing them.
            self.ddp = None
            gc.collect()
            if self.model is not None:
                self.model.set_mixer_runner(None)
            for group in self._groups:
                dist.destroy_process_group(group)
            self._groups = []
            if self._owns_group:
                dist.destroy_process_group()


def train(run_dir: str | Path, model_config: LMConfig | None, train_config: TrainConfig | None,
          corpus: Corpus, *, resume: bool = False, overwrite: bool = False,
          stop_after: int | None = None, progress: bool = True,
          context_parallel: int = 1) -> list[tuple[int, float]]:
    """Train a LanguageModel into ``run_dir``; returns this process's ``(step, train loss)``.

    ``context_parallel`` N > 1 (under torchrun, world = N x data-parallel replicas) splits every
    sequence of the batch into N contiguous shards held by N processes (module docstring);
    ``seq_len`` must be divisible by N, ``pack`` is refused, and the losses are one process's.

    With ``resume`` the model and training configs are read from ``run_dir/run.json``; the
    arguments may be None, and a ``train_config`` given changes only the ``RESUMABLE`` fields
    (any other difference, from ``model_config`` too, or a ``corpus`` other than the recorded
    data is a ValueError). Training continues from ``checkpoints/latest``, or from the newest
    older checkpoint that verifies when that one is damaged (a warning on stderr names the bad
    file), or from step 0 when the run was stopped before its first save.

    Without ``resume``, a ``run_dir`` that holds an earlier run's outputs (``OUTPUTS``) is a
    ValueError unless ``overwrite``; then they are replaced only after everything is checked
    (configs, data, the first forward), when the new run is about to write: they are moved
    aside, and deleted once the new run.json and metrics.csv are written (put back if writing
    them fails). Other files in ``run_dir`` are never touched.

    SIGINT or SIGTERM (main thread) during training saves a checkpoint of the last finished step
    and raises ``TrainingInterrupted``; resuming from it reproduces the uninterrupted run.
    ``stop_after`` ends the session after that step without the final save, as if the process
    had been killed (time-boxed sessions, tests).
    """
    trainer = Trainer(run_dir, model_config, train_config, corpus, resume=resume,
                      overwrite=overwrite, progress=progress, context_parallel=context_parallel)
    try:
        trainer.setup()
        return trainer.run(stop_after)
    finally:
        trainer.teardown()
