"""Language-model training on a byte corpus: AdamW, linear warm-up then cosine decay, gradient
clipping, optional bfloat16 autocast, periodic validation, early stopping, atomic checkpoints,
exact resuming, CSV metrics (TensorBoard too if installed) and DistributedDataParallel.

Determinism and resuming: every step draws the *global* batch from one ``torch.Generator``
seeded by ``seed`` (the data position); under DDP every rank draws the same global batch and
trains on its own contiguous slice, so the averaged gradient equals one process's. A checkpoint
stores model, optimizer, scheduler, step, the data generator and the torch / python / numpy RNG
states, so a resumed run reproduces the uninterrupted run's losses (which settings a resumed
run may change: ``records.py``). SIGINT and SIGTERM during training save a checkpoint of the
last finished step and raise ``TrainingInterrupted`` (a second signal interrupts at once).
Context parallelism (``context_parallel`` N > 1 under torchrun: every sequence split into N
shards held by N processes), DDP and FSDP (``fsdp``: parameters, gradients and optimizer state
sharded over the ranks, checkpoints sharded too): ``distributed.py``. Gradient accumulation
(``grad_accum`` K): each step draws one global batch of K x ``batch_size`` rows and runs it as K
micro-batches, gradients reduced across ranks once, after the last.

``train`` is the entry point; ``Trainer`` holds one session's phases as methods (``setup``,
``train_step``, ``validate``, ``save``, ``teardown``), so a change to one phase (gradient
accumulation in ``train_step``, another logger in ``metrics.Metrics``) stays local. The rest
lives along its seams: the settings and schedule (``config.py``), the run folder's record
(``records.py``), the metrics (``metrics.py``), the distributed set-up (``distributed.py``),
evaluation (``evaluate.py``) and checkpoints (``checkpoint.py``).

Dimension legend: N batch, T sequence length, V vocabulary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from .. import state_tree
from .._checks import is_int
from .._names import RESUMABLE
from ..models import LanguageModel, LMConfig
from ..models.lm import LMState
from ..tasks.text import Corpus
from .batches import BatchSource
from .checkpoint import (
    carried_rows,
    load_optimizer_state,
    optimizer_by_name,
    prune_checkpoints,
    save_training_checkpoint,
)
from .config import TrainConfig, check_fsdp, check_settings, lr_factor, set_inner_lr_ramp
from .distributed import (
    FSDP_MIXED,
    Signals,
    TrainingInterrupted,
    all_finite,
    average_gradients,
    context_parallel_runner,
    device_mesh,
    dist_info,
    end_process_groups,
    gather_rows,
    rng_states,
    seed_all,
    set_rng_states,
    shard_model,
    split_world,
)
from .evaluate import evaluate, loss_logits, try_forward
from .metrics import METRIC_FIELDS, METRICS_FILE, Metrics, mixer_grad_norm
from .records import OUTPUTS, RUN_FILE, RunRecord, open_run, read_run, resume_run, same_data

# The training API, wherever each piece lives.
__all__ = ["METRICS_FILE", "METRIC_FIELDS", "OUTPUTS", "RESUMABLE", "RUN_FILE", "RunRecord",
           "TrainConfig", "Trainer", "TrainingAnomaly", "TrainingInterrupted", "evaluate",
           "lr_factor", "read_run", "same_data", "set_inner_lr_ramp", "train"]


class TrainingAnomaly(RuntimeError):
    """The anomaly guard stopped training: the loss or the gradient norm became NaN or inf."""


class Trainer:
    """One training session in ``run_dir`` (``train`` is the public entry point and documents
    the behaviour): ``setup`` (configs, checks, model, run folder, optimizer; nothing is written
    before every check has passed), ``run`` (the loop of ``train_step``, ``validate`` and
    ``save``), and ``teardown``, always, even after a setup that failed part-way. Every rank
    computes; rank 0 alone writes."""

    def __init__(self, run_dir: str | Path, model_config: LMConfig | None,
                 train_config: TrainConfig | None, corpus: Corpus, *, resume: bool = False,
                 overwrite: bool = False, progress: bool = True, context_parallel: int = 1,
                 fsdp: bool = False, fsdp_mixed: str | None = None) -> None:
        if resume and overwrite:
            raise ValueError("resume and overwrite exclude each other")
        if not isinstance(fsdp, bool):
            raise TypeError(f"fsdp must be a bool, got {fsdp!r}")
        if fsdp_mixed is not None and fsdp_mixed not in FSDP_MIXED:
            raise ValueError(f"fsdp_mixed must be None or one of {sorted(FSDP_MIXED)}, got "
                             f"{fsdp_mixed!r}")
        self.fsdp, self.fsdp_mixed = fsdp, fsdp_mixed
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
        self.metrics: Metrics | None = None
        self.bar: Any = None
        self.ddp: torch.nn.Module | None = None
        self.model: LanguageModel | None = None
        self.step, self.best, self.since_best = 0, float("inf"), 0
        self.losses: list[tuple[int, float]] = []  # (step, train loss) of this session
        self.tokens, self.elapsed = 0, 0.0  # trained this session, seconds since its first step
        # carry_state: this rank's detached state after the last step (None: a fresh state);
        # the stream offset of the next window is the batch source's.
        self.carry: LMState | None = None

    @property
    def main(self) -> bool:
        return self.rank == 0

    def setup(self) -> None:
        """Everything before the first step, in the order that makes a resumed run exact: the
        process group, the configs, the checks, the seeds, the model (its first forward tried),
        the run folder, the optimizer and the saved random states."""
        self.rank, self.world, self.device, self._owns_group = dist_info()
        resumed = self._configure()
        check_settings(self.cfg, self.model_config, self.corpus, self.world, self.cp)
        check_fsdp(self.fsdp, self.fsdp_mixed, self.world, self.cfg)
        # FSDP: one 2-D mesh; its cp dimension holds the context-parallel groups
        self.mesh = device_mesh(self.world, self.cp, self.device) if self.fsdp else None
        self.dp, self.dp_rank, self.cp_rank, self._groups, self.cp_group = split_world(
            self.rank, self.world, self.cp, self.mesh)
        self.data_gen = seed_all(self.cfg.seed)
        self.model = resumed[0] if resumed else LanguageModel(self.model_config)
        self.model.to(self.device)
        if self.cp_group is not None:
            self.model.set_mixer_runner(context_parallel_runner(self.cp_group, self.fsdp))
        # before anything is written
        try_forward(self.model, self.cfg.seq_len // self.cp, self.device, self.cfg.carry_state)
        if resumed:
            self._restore_progress(resumed[2])
        if self.main:  # everything is checked: the new run starts writing here
            self.metrics = open_run(self.run_dir, self.model_config, self.cfg, self.corpus,
                                    overwrite=self.overwrite,
                                    resume_step=self.step if self.resume else None)
        self.local = self.cfg.batch_size // self.dp  # rows of a micro-batch per replica
        self.batches = BatchSource(self.cfg, self.corpus, self.data_gen, self.dp_rank, self.local,
                                   self.cp_rank, self.cp, self.device)
        if self.fsdp:  # before the optimizer, which must hold the sharded parameters
            if resumed and "optimizer" in resumed[1]:  # a whole checkpoint
                optimizer_by_name(resumed[1], self.model, self._adamw(self.model))
            shard_model(self.model, self.mesh, self.fsdp_mixed)
        self._build_optimizer(resumed[1] if resumed else None)
        # Context parallelism averages the gradients itself after the backward pass
        # (average_gradients): DDP's reducer would run its all-reduces during the backward,
        # interleaved with the context-parallel collectives, and wait forever for the gradients
        # of parameters that only some ranks use (TTT's initial state, read by the first shard).
        # FSDP reduces them itself (every parameter touched: context_parallel_runner).
        self.ddp = (torch.nn.parallel.DistributedDataParallel(self.model)
                    if self.world > 1 and self.cp == 1 and not self.fsdp else self.model)
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
        self.cfg, self.model_config, resumed = resume_run(
            self.run_dir, self.model_config, self.train_config, self.corpus, report=self.main)
        return resumed

    def _restore_progress(self, state: dict[str, Any]) -> None:
        """Step and early-stopping counters of the resumed checkpoint."""
        self.step, self.best, self.since_best = (state["step"], state["best_val_loss"],
                                                 state["since_best"])
        if self.cfg.steps < self.step:
            raise ValueError(f"steps {self.cfg.steps} is fewer than the {self.step} steps the run "
                             "has trained already (a run can be extended, not shortened)")

    def _build_optimizer(self, saved: dict[str, Any] | None) -> None:
        """AdamW (no weight decay on vectors) and the schedule; with ``saved`` (a checkpoint's
        optimizer state) their state and the random states are restored."""
        cfg, model = self.cfg, self.model
        model.train()
        model.set_gradient_checkpointing(cfg.recompute)
        self.opt = self._adamw(model)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: lr_factor(s, cfg))
        if saved is None:
            return
        load_optimizer_state(saved, model, self.opt)
        self.sched.load_state_dict(saved["scheduler"])
        # The optimizer state holds the rate the *saved* schedule set for this step; the
        # schedule is a function of (step, cfg.steps), and cfg.steps may have grown (an extended
        # run), so the rate is recomputed: the same value when steps is unchanged.
        for group, base in zip(self.opt.param_groups, self.sched.base_lrs):
            group["lr"] = base * lr_factor(self.step, cfg)
        set_rng_states(saved["rng"], self.data_gen)
        if self.cfg.carry_state:
            self._restore_carry(saved.get("carry"))

    def _adamw(self, model: torch.nn.Module) -> torch.optim.AdamW:
        """AdamW over ``model``'s parameters, without weight decay on vectors."""
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": self.cfg.weight_decay},
                                  {"params": no_decay, "weight_decay": 0.0}],
                                 lr=self.cfg.lr, betas=(0.9, 0.95))

    def _restore_carry(self, carry: dict[str, Any] | None) -> None:
        """The stream offset and this rank's rows of the saved global carried state."""
        self.batches.stream_pos, self.carry = carried_rows(
            carry, self.cfg.batch_size, self.rank * self.local, self.local, self.device)

    def run(self, stop_after: int | None = None) -> list[tuple[int, float]]:
        """Train until ``cfg.steps`` (or early stopping, or ``stop_after`` without the final
        save); a signal saves and raises ``TrainingInterrupted``. The session's losses."""
        from tqdm import tqdm

        cfg = self.cfg
        self.bar = tqdm(total=cfg.steps, initial=self.step, desc="train", unit="step",
                        disable=not (self.main and self.progress))
        self._start = time.perf_counter()
        with Signals() as signals:
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

    def train_step(self) -> float:
        """One optimiser step on the next global batch, accumulated over ``grad_accum``
        micro-batches; its loss (the mean over the global batch under DDP and context
        parallelism, identical to one process's), logged."""
        cfg = self.cfg
        set_inner_lr_ramp(self.model, self.step, cfg.warmup)
        batches, restarted = self.batches.next()
        if restarted:  # carry_state: every row's stream starts again, with a fresh state
            self.carry = None
        # Each micro-batch's mean loss is weighted by its share of this rank's predicted tokens
        # (all equal without --pack), so the accumulated gradient is that of the mean over them
        # all; with one micro-batch the weight is exactly 1.
        counts = [int((y != -100).sum()) for _, y, _ in batches]
        self.opt.zero_grad(set_to_none=True)
        # summed in float64, so that a float64 model's loss is not rounded to float32
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, ((x, y, cu), count) in enumerate(zip(batches, counts)):
            with self._gradient_sync(i == len(batches) - 1):
                with self.autocast:
                    logits, state = self.ddp(x, self.carry, cu_seqlens=cu)
                if cfg.carry_state and not cfg.reset_state:  # the next step continues from
                    # here; gradients stop here (reset_state: every window starts fresh)
                    self.carry = state_tree.map_tensors(torch.Tensor.detach, state)
                part = F.cross_entropy(loss_logits(logits.flatten(0, 1)), y.flatten(), ignore_index=-100)
                if len(batches) > 1:
                    part = part * (count / max(1, sum(counts)))
                part.backward()
            loss = loss + part.detach()
        if self.cp > 1 and not self.fsdp:
            average_gradients(self.model, self.world)
        # before clipping; FSDP's shards need every rank
        mixer_norm = (mixer_grad_norm(self.model, sharded=True) if self.fsdp
                      else mixer_grad_norm(self.model) if self.main else None)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        if cfg.anomaly_guard and not all_finite(loss, grad_norm, self.world):
            raise self._anomaly(loss.item(), grad_norm.item())
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.sched.step()
        self.step += 1
        self.tokens += cfg.batch_size * cfg.grad_accum * cfg.seq_len
        loss_value = loss.item()
        if self.world > 1:
            t = torch.tensor([loss_value], dtype=torch.float64, device=self.device)
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

    def _gradient_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """The context of one micro-batch's forward and backward: DDP all-reduces the gradients
        only in the last one (``no_sync`` before it); FSDP reduce-scatters them only then."""
        if self.fsdp:
            self.model.set_requires_gradient_sync(last)
        if isinstance(self.ddp, torch.nn.parallel.DistributedDataParallel) and not last:
            return self.ddp.no_sync()
        return contextlib.nullcontext()

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
                       shard=shard, carry_state=self.cfg.carry_state and not self.cfg.reset_state)
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
        extra = {} if carry is None else {"carry": carry}
        rest = {"scheduler": self.sched.state_dict(), "rng": rng_states(self.data_gen), **extra}
        trainer_state = {"step": self.step, "best_val_loss": self.best,
                         "since_best": self.since_best, "train": dataclasses.asdict(self.cfg)}
        if self.fsdp or self.main:  # under FSDP every rank writes its shards
            path = save_training_checkpoint(self.run_dir, self.step, self.model, self.opt, rest,
                                            trainer_state, sharded=self.fsdp)
        if self.main and self.cfg.keep_last is not None:
            prune_checkpoints(self.run_dir, self.cfg.keep_last)
        if self.world > 1:
            dist.barrier()
        return path

    def _gathered_carry(self) -> dict[str, Any]:
        """carry_state: the stream offset and the carried state of the whole global batch, on
        the CPU (every rank's rows, gathered in rank order; every rank takes part), so that a
        resumed run, on any number of ranks, continues each row's stream exactly."""
        return {"position": self.batches.stream_pos, "state": gather_rows(self.carry, self.world)}

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
            end_process_groups(self._groups, self._owns_group)
            self._groups = []


def train(run_dir: str | Path, model_config: LMConfig | None, train_config: TrainConfig | None,
          corpus: Corpus, *, resume: bool = False, overwrite: bool = False,
          stop_after: int | None = None, progress: bool = True,
          context_parallel: int = 1, fsdp: bool = False,
          fsdp_mixed: str | None = None) -> list[tuple[int, float]]:
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
    ``fsdp`` (under torchrun, 2 or more processes) shards parameters, gradients and AdamW's
    state over every rank with FSDP2 (``distributed.shard_model``: per block and at the root,
    on the ``dp_shard`` x ``cp`` mesh, composing with ``context_parallel``); the losses are one
    process's. ``fsdp_mixed`` ``"bf16"``: bfloat16 parameters in compute, float32 master weights
    and gradient reduction (not with ``bf16`` autocast). Checkpoints are then sharded
    (``checkpoint.save_sharded_checkpoint``); a sharded checkpoint resumes on any world size and
    mesh, with or without fsdp; a whole (single-file) one too.
    Neither setting is recorded in run.json: they are launch settings like the world size.

    ``stop_after`` ends the session after that step without the final save, as if the process
    had been killed (time-boxed sessions, tests).
    """
    trainer = Trainer(run_dir, model_config, train_config, corpus, resume=resume,
                      overwrite=overwrite, progress=progress, context_parallel=context_parallel,
                      fsdp=fsdp, fsdp_mixed=fsdp_mixed)
    try:
        trainer.setup()
        return trainer.run(stop_after)
    finally:
        trainer.teardown()
