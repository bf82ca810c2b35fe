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

VOCAB = 256  # bytes

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


def train_config(settings: dict[str, Any], seed: int, carry_state: bool = False,
                 reset_state: bool = False) -> TrainConfig:
    """The TrainConfig of one run; checkpoints every quarter so an interrupted run resumes.
    ``carry_state``: truncated backpropagation through time over stream segments of
    consecutive windows (``TrainConfig.carry_state``; ``train.batches``: every row from its own
    random offset, a new one every ``STREAM_WINDOWS`` windows) instead of independent random
    windows; ``reset_state`` (with it): the same segments in the same order with the state reset
    at every window, the truncation control. The verdicts' evaluation is the experiment's own (``windows_loss``); the
    trainer's validation reads only ``TRAINER_EVAL_WINDOWS`` windows."""
    steps = settings["steps"]
    return TrainConfig(steps=steps, batch_size=settings["batch_size"], seq_len=settings["seq_len"],
                       lr=settings["lr"], warmup=min(30, max(1, steps // 10)), eval_every=steps,
                       eval_windows=TRAINER_EVAL_WINDOWS, save_every=max(1, steps // 4), seed=seed,
                       anomaly_guard=True, carry_state=carry_state, reset_state=reset_state)


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
def windows_losses(model: LanguageModel, data: torch.Tensor, starts: torch.Tensor, seq_len: int,
                   context: int = 0, batch: int = 32) -> torch.Tensor:
    """The mean next-byte loss of each window [start, start + seq_len) of ``data`` (``starts``
    [n]) -> [n] float64, each scored after reading the ``context`` bytes before it with the
    state carried, in pieces of ``seq_len`` (``range_loss``); ``context`` 0: every window from a
    fresh state, the truncated reading."""
    device = next(model.parameters()).device
    span = starts.long()[:, None] - context + torch.arange(context + seq_len + 1)
    out = []
    for i in range(0, span.shape[0], batch):
        x = data[span[i:i + batch]].long().to(device)  # [b, context + T + 1]
        prefix = x[:, :context] if context else None
        out.append(range_loss(model, x, prefix, context, context + seq_len, seq_len, per_stream=True))
    return torch.cat(out)


def windows_loss(model: LanguageModel, data: torch.Tensor, starts: torch.Tensor, seq_len: int,
                 context: int = 0, batch: int = 32) -> float:
    """The mean over the windows of ``windows_losses`` (every window has ``seq_len`` bytes)."""
    return float(windows_losses(model, data, starts, seq_len, context, batch).mean())


def eval_note(s: dict[str, Any]) -> str:
    """The results.md line on the evaluation windows of ``eval_starts`` / ``windows_loss``."""
    return (f"Validation loss: {s['eval_windows']} windows of {s['seq_len']} bytes spread over "
            "every file of the validation split (`lm.eval_starts`: at least one per file that "
            "holds a window, the rest by size), each read from a fresh state; the first records "
            "read the first 8 KB of the split (two files).")


def trained_note(s: dict[str, Any], rows: list[dict[str, Any]], loss: str = "validation loss") -> str:
    """The results.md line on the ``trained`` flag of ``trained_metrics``, with the bar's
    value(s) in ``rows``."""
    if s.get("stuck_fraction"):  # a record from before issue 44
        return (f"`trained` (this record's bar, from before the bigram's): the run's {loss} below "
                f"{s['stuck_fraction']:.0%} of the validation split's unigram entropy; a claim on "
                "a run with 0 is not measured.")
    if s.get("trained_bar") != "bigram":
        return "`trained`: no check at this size (the --quick runs are too short to learn)."
    bars = sorted({round(r["metrics"]["bigram"], 4) for r in rows if "bigram" in r["metrics"]})
    failed = [f"{r['model']} seed {r['seed']}" for r in rows if r["metrics"].get("trained") == 0]
    return (f"`trained` = 1 when the run's {loss} is below `bigram`, the loss of a count bigram "
            "model on the same bytes (`lm.bigram_loss`: the byte-pair counts of the training "
            "split, add-one smoothed): "
            f"{' / '.join(f'{b:.4f}' for b in bars) or 'n/a'} nats here. A claim on a run with 0 "
            "is not measured: a model no better than the previous byte's statistics has not "
            "learned what the claim is about. Runs with 0: "
            f"{', '.join(failed) or 'none'}.")


UNTRAINED = "not below the count bigram's loss"  # the verdicts' name for a run with trained = 0


def trained_metrics(loss: float, bigram: float | None) -> dict[str, float]:
    """``{"bigram": the bar, "trained": 1.0 when ``loss`` is below it, else 0.0}``: the run
    learned more than the previous byte's statistics (no verdict rests on a run with 0);
    ``bigram`` None (the --quick sizes, too short to learn): ``{"trained": 1.0}``."""
    if bigram is None:
        return {"trained": 1.0}
    return {"bigram": bigram, "trained": float(loss < bigram)}


_BIGRAMS: dict[int, torch.Tensor] = {}


def bigram_table(corpus: Corpus) -> torch.Tensor:
    """log p(next byte | byte) [256, 256] float64 of the count bigram model of ``corpus``'s
    training split: (count(a, b) + 1) / (count(a) + 256) (add-one smoothing; the choice of
    smoothing moves the stdlib bar by less than 0.001 nats). Computed once per corpus."""
    key = id(corpus.train)
    if key not in _BIGRAMS:
        data = corpus.train.long()
        counts = torch.bincount(data[:-1] * VOCAB + data[1:], minlength=VOCAB * VOCAB)
        counts = counts.double().view(VOCAB, VOCAB) + 1.0
        _BIGRAMS[key] = (counts / counts.sum(1, keepdim=True)).log()
    return _BIGRAMS[key]


def bar(s: dict[str, Any], corpus: Corpus, starts: torch.Tensor, seq_len: int) -> float | None:
    """The trained bar of a run scored on the validation windows ``starts`` of ``seq_len``
    bytes: the count bigram's loss on them (``bigram_loss``) when the settings ask for it
    (``trained_bar`` = "bigram"), else None (no check: the --quick sizes)."""
    return bigram_loss(corpus, corpus.val, starts, seq_len) if s.get("trained_bar") == "bigram" else None


def window_metrics(model: LanguageModel, corpus: Corpus, s: dict[str, Any],
                   starts: torch.Tensor) -> tuple[dict[str, float], dict[str, list[float]]]:
    """The metrics of a run scored on the validation windows ``starts`` of ``s["seq_len"]``
    bytes, each from a fresh state: ``loss``, ``ppl`` and the trained bar (``trained_metrics``),
    and the per-window losses (``{"loss": [n]}``, the result's ``windows``)."""
    per = windows_losses(model, corpus.val, starts, s["seq_len"])
    loss = float(per.mean())
    metrics = {"loss": loss, "ppl": perplexity(loss),
               **trained_metrics(loss, bar(s, corpus, starts, s["seq_len"]))}
    return metrics, {"loss": per.tolist()}


def bigram_loss(corpus: Corpus, data: torch.Tensor, starts: torch.Tensor, seq_len: int) -> float:
    """The count bigram's (``bigram_table``) mean next-byte loss on the targets of the windows
    [start, start + seq_len] of ``data`` (``starts`` [n]): the bytes a model's loss on the same
    windows scores, each predicted from the byte before it. The bar of ``trained_metrics``."""
    x = data[starts.long()[:, None] + torch.arange(seq_len + 1)].long()
    return float(-bigram_table(corpus)[x[:, :-1], x[:, 1:]].mean())


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
               piece: int, per_stream: bool = False) -> Any:
    """Mean next-byte loss at positions ``lo .. hi - 1`` (0-based inputs; the targets are the
    bytes after them) of the streams ``x`` [S, >= hi + 1], read in pieces of ``piece`` tokens
    with the state carried, after first reading ``prefix`` [S, lo] from a fresh state (its own
    loss is not scored). ``prefix=None`` starts the range from a fresh state. With ``prefix =
    x[:, :lo]`` this is the ordinary reading of the stream (``position_losses``); with another
    stream's first ``lo`` bytes it is the control that tells "uses its own context" from "any
    warmed-up state helps". ``per_stream``: each stream's own mean loss over the range, [S]
    float64, instead of the mean over all of them (a float)."""
    model.eval()
    state = None
    if prefix is not None:
        if prefix.shape != (x.shape[0], lo):
            raise ReproduceError(f"prefix must have shape {(x.shape[0], lo)}, got {tuple(prefix.shape)}")
        for start in range(0, lo, piece):
            _, state = model(prefix[:, start:min(lo, start + piece)], state)
    total = torch.zeros(x.shape[0], dtype=torch.float64)
    for start in range(lo, hi, piece):
        stop = min(hi, start + piece)
        logits, state = model(x[:, start:stop], state)
        loss = F.cross_entropy(logits.float().transpose(1, 2), x[:, start + 1:stop + 1], reduction="none")
        total += loss.double().sum(1).cpu()
    per = total / (hi - lo)
    return per if per_stream else float(per.mean())


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
            models: Any, carried: Any = None, reset: Any = None) -> Plan:
    """The plan of a language-model experiment: its ``settings`` (default, quick) with the corpus
    name, and one run per (seed, model) of ``models(settings)`` (label -> LMConfig, the
    experiment's parameter-matched configs); ``carried(label)``, when given, says which runs
    train on carried-state stream segments, ``reset(label)`` which of those reset the state at
    every window (the truncation control). A missing corpus fails here, before --out is
    touched."""
    default, quick_settings = settings
    s = {**(quick_settings if quick else default), "data": data}
    corpus(data)
    configs = models(s)

    def options(label: str, cfg: LMConfig) -> dict[str, Any]:
        extra = {} if carried is None else {"carry_state": carried(label)}
        if reset is not None and reset(label):
            extra["reset_state"] = True
        return {"config": cfg.to_dict(), **extra}

    return Plan(s, [RunSpec(label, seed, options(label, cfg)) for seed in seeds
                    for label, cfg in configs.items()])
