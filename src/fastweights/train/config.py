"""The training settings (``TrainConfig``, validated on creation; the ones a resumed run may
change are ``fastweights._names.RESUMABLE``), the learning-rate schedule (``lr_factor``) and TTT-MLP's inner
learning-rate ramp (``set_inner_lr_ramp``), and the checks of settings against the world size,
the model and the data (``check_settings``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .._checks import is_int
from ..models import LanguageModel, LMConfig
from ..tasks.text import Corpus, stream_shard_len


@dataclass
class TrainConfig:
    """Optimisation settings. ``batch_size`` is the global batch of one forward and backward
    pass (split across DDP ranks); ``grad_accum`` K accumulates the gradients of K such
    micro-batches before each optimiser step, so a step trains on a global batch of
    ``batch_size`` x K rows, exactly as one batch of that many rows would (the mean loss over
    all of them; not with ``carry_state``). K is recorded: a resumed run keeps it;
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
    cannot continue past a position table are refused, as is ``pack``. ``reset_state`` (with
    ``carry_state`` only): the same stream segments in the same order, but every window starts
    from a fresh state; the control that separates the truncation from the data order
    (docs/reproductions.md, "The truncation control"). Its validation reads independent windows."""

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
    reset_state: bool = False  # with carry_state: the same streams, the state reset at every window
    grad_accum: int = 1  # micro-batches of batch_size rows per optimiser step

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "eval_every", "eval_windows", "grad_accum"):
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
        for name in ("anomaly_guard", "pack", "recompute", "bf16", "carry_state", "reset_state"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.pack and self.carry_state:
            raise ValueError("pack and carry_state exclude each other: packed rows restart the "
                             "state at every document and window, carry_state continues it")
        if self.reset_state and not self.carry_state:
            raise ValueError("reset_state needs carry_state: it reads carry_state's stream "
                             "segments with the state reset at every window")
        if self.carry_state and self.grad_accum > 1:
            raise ValueError(f"grad_accum {self.grad_accum} is not supported with carry_state: "
                             "each batch row carries its own stream's state from one step to "
                             "the next, which micro-batches of other rows would break")


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Multiplier of ``lr`` at optimiser step ``step`` (0-based): linear warm-up over ``warmup``
    steps, then cosine decay to ``min_lr_ratio`` at ``steps``. A function of (step, total steps)
    alone: a run extended to more steps follows the schedule of its new total from its next
    step on (the rate goes back up from the old schedule's final value)."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def set_inner_lr_ramp(model: LanguageModel, step: int, warmup: int) -> None:
    """The inner-learning-rate warm-up of TTT-MLP (docs/maths.md 2.6) at optimiser step ``step``
    (0-based): the layers follow progress min(1, step / warmup) (1 without a warm-up)."""
    model.set_inner_lr_warmup(1.0 if warmup <= 0 else min(1.0, step / warmup))


def check_settings(cfg: TrainConfig, model_config: LMConfig, corpus: Corpus, world: int,
                   cp: int) -> None:
    """The settings must fit the world size (``cp`` context-parallel ranks per sequence), the
    model and the data; ValueError naming the first that does not."""
    check_launch(cfg, model_config, world, cp)
    if corpus.vocab_size > model_config.vocab_size:
        raise ValueError(f"data {corpus.name} has ids up to {corpus.vocab_size - 1}, beyond the "
                         f"model's vocab_size {model_config.vocab_size}")
    _check_corpus(corpus, cfg)
    if cfg.carry_state:
        shard = stream_shard_len(corpus.train, cfg.batch_size)
        if shard < cfg.seq_len + 1:
            raise ValueError(
                f"carry_state cuts the training split of data {corpus.name} "
                f"({corpus.train.numel()} {_unit(corpus)}) into batch_size {cfg.batch_size} "
                f"streams of {shard} {_unit(corpus)}, fewer than seq_len + 1 = {cfg.seq_len + 1}")


def check_launch(cfg: TrainConfig, model_config: LMConfig, world: int, cp: int) -> None:
    """The part of ``check_settings`` that needs no data: the settings must fit the world size
    (``cp`` context-parallel ranks per sequence) and the model. The command line runs it before
    it reads (or tokenizes) the data; ValueError naming the first that does not fit."""
    limit = model_config.max_seq_len
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
        if world % cp:
            raise ValueError(f"the world size {world} must be a multiple of "
                             f"context_parallel {cp} (world = context_parallel x data-parallel "
                             "replicas)")
    dp = world // cp
    if cfg.batch_size % dp:
        what = "world size" if cp == 1 else "number of data-parallel replicas (world / context_parallel)"
        raise ValueError(f"batch_size {cfg.batch_size} must be divisible by the {what} {dp}")
    if limit is not None and cfg.seq_len > limit:
        raise ValueError(f"seq_len {cfg.seq_len} exceeds the model's max_seq_len {limit}")


def _unit(corpus: Corpus) -> str:
    return "bytes" if corpus.tokens is None else "tokens"


def _check_corpus(corpus: Corpus, cfg: TrainConfig) -> None:
    """Both splits must hold at least one window of ``seq_len + 1`` bytes or tokens (checked
    before the run folder is written, rather than at the first step or validation)."""
    for split, data in (("training", corpus.train), ("validation", corpus.val)):
        if data.numel() < cfg.seq_len + 1:
            raise ValueError(f"the {split} split of data {corpus.name} has {data.numel()} {_unit(corpus)}, "
                             f"fewer than seq_len + 1 = {cfg.seq_len + 1}")


def check_fsdp(fsdp: bool, mixed: str | None, world: int, cfg: TrainConfig) -> None:
    """FSDP's settings (``train(fsdp=..., fsdp_mixed=...)``) must fit the world and the run;
    ValueError naming the first that does not."""
    if mixed is not None and not fsdp:
        raise ValueError(f"fsdp_mixed {mixed} is FSDP's mixed precision: it needs fsdp")
    if fsdp and world < 2:
        raise ValueError(f"fsdp shards the model across processes: launch with torchrun and 2 or "
                         f"more processes (the world size is {world})")
    if fsdp and mixed is not None and cfg.bf16:
        raise ValueError(f"fsdp_mixed {mixed} and bf16 autocast exclude each other: FSDP's mixed "
                         "precision already computes in bfloat16 (drop bf16)")
