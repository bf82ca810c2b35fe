"""What the byte-LM reproductions share: configs matched in parameter count, one training run
through ``fastweights.train`` (continued when its folder holds an interrupted one), and the
per-position loss of long streams read with the state carried."""

from __future__ import annotations

import contextlib
import io
import itertools
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..models import LanguageModel, LMConfig
from ..tasks.text import Corpus
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


def train_config(settings: dict[str, Any], seed: int, carry_state: bool = False) -> TrainConfig:
    """The TrainConfig of one run; checkpoints every quarter so an interrupted run resumes.
    ``carry_state``: truncated backpropagation through time over consecutive windows of each
    row's stream (``TrainConfig.carry_state``) instead of independent random windows."""
    steps = settings["steps"]
    return TrainConfig(steps=steps, batch_size=settings["batch_size"], seq_len=settings["seq_len"],
                       lr=settings["lr"], warmup=min(30, max(1, steps // 10)), eval_every=steps,
                       eval_windows=settings["eval_windows"], save_every=max(1, steps // 4), seed=seed,
                       anomaly_guard=True, carry_state=carry_state)


def tokens(settings: dict[str, Any]) -> int:
    return settings["steps"] * settings["batch_size"] * settings["seq_len"]


@torch.no_grad()
def position_losses(model: LanguageModel, data: torch.Tensor, length: int, streams: int,
                    piece: int) -> torch.Tensor:
    """Mean next-byte loss at every position [length] over ``streams`` consecutive,
    non-overlapping streams of ``length + 1`` bytes taken from the start of ``data``, each read in
    pieces of ``piece`` tokens with the recurrent state carried (all streams as one batch)."""
    x = stream_batch(model, data, length, streams)
    model.eval()
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


def stream_batch(model: LanguageModel, data: torch.Tensor, length: int, streams: int) -> torch.Tensor:
    """The ``streams`` consecutive, non-overlapping streams of ``length + 1`` bytes from the start
    of ``data`` that ``position_losses`` reads, as one long tensor [streams, length + 1] on the
    model's device."""
    need = streams * (length + 1)
    if data.numel() < need:
        raise ReproduceError(f"the validation split has {data.numel()} bytes, fewer than the "
                             f"{need} the long-context evaluation reads")
    return data[:need].long().view(streams, length + 1).to(next(model.parameters()).device)


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
