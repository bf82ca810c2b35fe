"""What the byte-LM reproductions share: configs matched in parameter count, one training run
through ``fastweights.train`` (continued when its folder holds an interrupted one), and the
per-position loss of long streams read with the state carried."""

from __future__ import annotations

import bisect
import contextlib
import io
import itertools
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..models import LanguageModel, LMConfig
from ..tasks.text import Corpus, spread_starts
from ..train.checkpoint import load_model
from ..train.trainer import RUN_FILE, TrainConfig, TrainingAnomaly, train
from .common import Plan, ReproduceError, RunSpec

MATCH_TOLERANCE = 0.03  # every model within 3 % of the reference's parameter count


def count_parameters(config: LMConfig) -> int:
    """Trainable parameters of ``LanguageModel(config)``, built on the meta device (no memory,
    the caller's random state untouched)."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        return LanguageModel(config).num_parameters()


def match_parameters(configs: dict[str, LMConfig], reference: str,
                     tolerance: float = MATCH_TOLERANCE) -> dict[str, LMConfig]:
    """Each config with its feed-forward width ``ffn_hidden`` set so that its parameter count is
    closest to ``configs[reference]``'s (the count is affine in ffn_hidden: two builds give the
    line). ReproduceError when some model cannot be brought within ``tolerance``."""
    target = count_parameters(configs[reference])
    matched = {}
    for label, cfg in configs.items():
        d = cfg.to_dict()
        p1 = count_parameters(LMConfig(**{**d, "ffn_hidden": 1}))
        p2 = count_parameters(LMConfig(**{**d, "ffn_hidden": 2}))
        slope = p2 - p1
        hidden = max(1, round(1 + (target - p1) / slope)) if slope > 0 else cfg.ffn_hidden
        new = LMConfig(**{**d, "ffn_hidden": hidden})
        got = count_parameters(new)
        if abs(got - target) > tolerance * target:
            raise ReproduceError(f"model {label!r} has {got} parameters, more than "
                                 f"{tolerance:.0%} away from the reference's {target}")
        matched[label] = new
    return matched


def train_run(workdir: Path, config: LMConfig, tcfg: TrainConfig,
              corpus: Corpus) -> LanguageModel | None:
    """Train ``config`` into ``workdir`` (a fastweights training run folder) and return the final
    model in eval mode, or None when training diverged (the trainer's anomaly guard stopped it at
    the first NaN/inf loss or gradient: a result of the experiment, not an error). An interrupted
    run in ``workdir`` is resumed from its latest checkpoint."""
    resume = (workdir / RUN_FILE).is_file()
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the trainer's per-eval lines
            train(workdir, None if resume else config, tcfg, corpus, resume=resume, progress=False)
    except TrainingAnomaly:
        return None
    return load_model(workdir)


def diverged(config: LMConfig, settings: dict[str, Any], metrics: list[str]) -> dict[str, Any]:
    """The result of a run that diverged: every metric NaN (counted as infinitely bad)."""
    return {"parameters": count_parameters(config), "steps": settings["steps"],
            "tokens": tokens(settings), "diverged": True, "metrics": dict.fromkeys(metrics, math.nan)}


TRAINER_EVAL_WINDOWS = 8  # the trainer's own end-of-run validation (metrics.csv), not a verdict's


def train_config(settings: dict[str, Any], seed: int, carry_state: bool = False) -> TrainConfig:
    """The TrainConfig of one run; checkpoints every quarter so an interrupted run resumes.
    ``carry_state``: truncated backpropagation through time over stream segments of
    consecutive windows (``TrainConfig.carry_state``; ``train.batches``: every row from its own
    random offset, a new one every ``STREAM_WINDOWS`` windows) instead of independent random
    windows. The verdicts' evaluation is the experiment's own (``windows_loss``); the
    trainer's validation reads only ``TRAINER_EVAL_WINDOWS`` windows."""
    steps = settings["steps"]
    return TrainConfig(steps=steps, batch_size=settings["batch_size"], seq_len=settings["seq_len"],
                       lr=settings["lr"], warmup=min(30, max(1, steps // 10)), eval_every=steps,
                       eval_windows=TRAINER_EVAL_WINDOWS, save_every=max(1, steps // 4), seed=seed,
                       anomaly_guard=True, carry_state=carry_state)


def eval_starts(corpus: Corpus, seq_len: int, n: int, context: int = 0) -> torch.Tensor:
    """Start offsets [n] of ``n`` evaluation windows of ``seq_len`` bytes spread over every file
    of the validation split (``tasks.text.spread_starts``: at least one per file that holds a
    window, the rest in proportion to the file's size), each at least ``context`` bytes into the
    split so that the ``context`` bytes before it can be read first."""
    starts = (corpus.val_starts - context).clamp_min(0)
    keep = torch.cat([starts[:1], starts[1:][starts[1:] > 0]])
    try:
        return spread_starts(keep, corpus.val.numel() - context, seq_len + 1, n) + context
    except ValueError as err:
        raise ReproduceError(f"the validation split of {corpus.name} cannot hold {n} windows of "
                             f"{seq_len} bytes: {err}") from None


@torch.no_grad()
def windows_loss(model: LanguageModel, data: torch.Tensor, starts: torch.Tensor, seq_len: int,
                 context: int = 0, batch: int = 32) -> float:
    """Mean next-byte loss over the windows [start, start + seq_len) of ``data`` (``starts``
    [n]), each scored after reading the ``context`` bytes before it with the state carried, in
    pieces of ``seq_len`` (``range_loss``); ``context`` 0: every window from a fresh state, the
    truncated reading."""
    device = next(model.parameters()).device
    span = starts.long()[:, None] - context + torch.arange(context + seq_len + 1)
    total, count = 0.0, 0
    for i in range(0, span.shape[0], batch):
        x = data[span[i:i + batch]].long().to(device)  # [b, context + T + 1]
        prefix = x[:, :context] if context else None
        total += range_loss(model, x, prefix, context, context + seq_len, seq_len) * x.shape[0]
        count += x.shape[0]
    return total / count


def eval_note(s: dict[str, Any]) -> str:
    """The results.md line on the evaluation windows of ``eval_starts`` / ``windows_loss``."""
    return (f"Validation loss: {s['eval_windows']} windows of {s['seq_len']} bytes spread over "
            "every file of the validation split (`lm.eval_starts`: at least one per file that "
            "holds a window, the rest by size), each read from a fresh state; the first records "
            "read the first 8 KB of the split (two files).")


def trained_note(s: dict[str, Any], loss: str = "validation loss") -> str:
    """The results.md line on the ``trained`` flag of ``trained_flag``."""
    if not s.get("stuck_fraction"):
        return "`trained`: no check at this size (the --quick runs are too short to learn)."
    return (f"`trained` = 1 when the run's {loss} is below {s['stuck_fraction']:.0%} of the "
            "validation split's unigram entropy (a model that predicts only byte frequencies "
            "scores the entropy); a claim on a run with 0 is not measured.")


def trained_flag(loss: float, corpus: Corpus, fraction: float | None) -> float:
    """1.0 when ``loss`` is below ``fraction`` of the validation split's byte-frequency entropy
    (a model that learned only byte frequencies scores the entropy), else 0.0 (the run did not
    train: no verdict rests on it); ``fraction`` None (the --quick sizes): 1.0."""
    return float(fraction is None or loss < fraction * unigram_entropy(corpus.val))


def tokens(settings: dict[str, Any]) -> int:
    return settings["steps"] * settings["batch_size"] * settings["seq_len"]


@torch.no_grad()
def position_losses(model: LanguageModel, x: torch.Tensor, piece: int) -> torch.Tensor:
    """Mean next-byte loss at every position [L] over the streams ``x`` [S, L + 1] (inputs
    0..L-1, targets 1..L), read in pieces of ``piece`` tokens with the recurrent state carried
    (all streams as one batch)."""
    model.eval()
    length = x.shape[1] - 1
    total = torch.zeros(length, dtype=torch.float64)
    state = None
    for start in range(0, length, piece):
        stop = min(length, start + piece)
        logits, state = model(x[:, start:stop], state)
        loss = F.cross_entropy(logits.float().transpose(1, 2), x[:, start + 1:stop + 1], reduction="none")
        total[start:stop] = loss.double().mean(0).cpu()
    return total


@torch.no_grad()
def range_loss(model: LanguageModel, x: torch.Tensor, prefix: torch.Tensor | None, lo: int, hi: int,
               piece: int) -> float:
    """Mean next-byte loss at positions ``lo .. hi - 1`` (0-based inputs; the targets are the
    bytes after them) of the streams ``x`` [S, >= hi + 1], read in pieces of ``piece`` tokens
    with the state carried, after first reading ``prefix`` [S, lo] from a fresh state (its own
    loss is not scored). ``prefix=None`` starts the range from a fresh state. With ``prefix =
    x[:, :lo]`` this is the ordinary reading of the stream (``position_losses``); with another
    stream's first ``lo`` bytes it is the control that tells "uses its own context" from "any
    warmed-up state helps"."""
    model.eval()
    state = None
    if prefix is not None:
        if prefix.shape != (x.shape[0], lo):
            raise ReproduceError(f"prefix must have shape {(x.shape[0], lo)}, got {tuple(prefix.shape)}")
        for start in range(0, lo, piece):
            _, state = model(prefix[:, start:min(lo, start + piece)], state)
    total, count = 0.0, 0
    for start in range(lo, hi, piece):
        stop = min(hi, start + piece)
        logits, state = model(x[:, start:stop], state)
        loss = F.cross_entropy(logits.float().transpose(1, 2), x[:, start + 1:stop + 1], reduction="sum")
        total += float(loss)
        count += (stop - start) * x.shape[0]
    return total / count


def stream_starts(corpus: Corpus, length: int, streams: int) -> torch.Tensor:
    """Start offsets [streams] of ``streams`` validation streams of ``length + 1`` bytes, each
    inside one file, spread over every file that holds one (``tasks.text.spread_starts``)."""
    try:
        return spread_starts(corpus.val_starts, corpus.val.numel(), length + 1, streams)
    except ValueError as err:
        raise ReproduceError(f"the validation split of {corpus.name} cannot hold {streams} "
                             f"streams of {length + 1} bytes: {err}") from None


def stream_batch(model: LanguageModel, data: torch.Tensor, starts: torch.Tensor,
                 length: int) -> torch.Tensor:
    """The streams of ``length + 1`` bytes of ``data`` from ``starts`` [S], as one tensor
    [S, length + 1] on the model's device."""
    span = starts.long()[:, None] + torch.arange(length + 1)
    return data[span].long().to(next(model.parameters()).device)


def file_of(corpus: Corpus, starts: torch.Tensor) -> list[int]:
    """The index of the validation file each offset of ``starts`` lies in."""
    bounds = corpus.val_starts.tolist()
    return [bisect.bisect_right(bounds, int(s)) - 1 for s in starts]


def log_buckets(length: int) -> list[tuple[int, int]]:
    """Position buckets [lo, hi) (1-based positions 1..length) doubling in size: [1, 2), [2, 4),
    ..., the last one ending at ``length + 1`` (a lone last position ``length`` = 2^k joins the
    bucket before it: [2^(k-1), 2^k])."""
    edges = [1]
    while edges[-1] * 2 <= length:
        edges.append(edges[-1] * 2)
    if edges[-1] == length and len(edges) > 1:
        edges[-1] = length + 1
    else:
        edges.append(length + 1)
    return list(itertools.pairwise(edges))


def bucket_name(lo: int, hi: int) -> str:
    return f"loss@{lo}-{hi - 1}"


def bucket_losses(per_position: torch.Tensor) -> dict[str, float]:
    """Mean loss per log-spaced position bucket, keyed ``loss@lo-hi`` (inclusive, 1-based)."""
    out = {}
    for lo, hi in log_buckets(per_position.numel()):
        out[bucket_name(lo, hi)] = float(per_position[lo - 1:hi - 1].mean())
    return out


def unigram_entropy(data: torch.Tensor) -> float:
    """The entropy (nats) of the byte frequencies of ``data``: the loss of a model that learned
    nothing but how often each byte occurs."""
    counts = torch.bincount(data.long().flatten(), minlength=256).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


_CORPORA: dict[str, Corpus] = {}


def corpus(spec: str) -> Corpus:
    """``tasks.load_corpus(spec)``, read once per process; ReproduceError when it cannot be."""
    from ..tasks import load_corpus

    if spec not in _CORPORA:
        try:
            _CORPORA[spec] = load_corpus(spec)
        except (ValueError, OSError) as err:
            raise ReproduceError(str(err)) from None
    return _CORPORA[spec]


def setup_note(s: dict[str, Any], rows: list[dict[str, Any]], reference: str) -> str:
    """The results.md line describing an LM experiment's models, matching and token budget."""
    params = ", ".join(map(str, sorted({r["parameters"] for r in rows})))
    return (f"Byte-level LM on `{s['data']}` ({s['n_layers']} layers, d_model {s['d_model']}, "
            f"{s['n_heads']} heads, trained on windows of {s['seq_len']} bytes); every model's "
            f"feed-forward width is set so that its parameter count matches `{reference}`'s within "
            f"{MATCH_TOLERANCE:.0%} (counts: {params}); {tokens(s)} training bytes per run "
            f"({s['steps']} steps of {s['batch_size']} x {s['seq_len']}).")


def lm_plan(quick: bool, seeds: list[int], data: str, settings: tuple[dict[str, Any], dict[str, Any]],
            models: Any, carried: Any = None) -> Plan:
    """The plan of a language-model experiment: its ``settings`` (default, quick) with the corpus
    name, and one run per (seed, model) of ``models(settings)`` (label -> LMConfig, the
    experiment's parameter-matched configs); ``carried(label)``, when given, says which runs
    train with the state carried across windows. A missing corpus fails here, before --out is
    touched."""
    default, quick_settings = settings
    s = {**(quick_settings if quick else default), "data": data}
    corpus(data)
    configs = models(s)

    def options(label: str, cfg: LMConfig) -> dict[str, Any]:
        extra = {} if carried is None else {"carry_state": carried(label)}
        return {"config": cfg.to_dict(), **extra}

    return Plan(s, [RunSpec(label, seed, options(label, cfg)) for seed in seeds
                    for label, cfg in configs.items()])
