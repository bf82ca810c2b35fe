"""``infini-passkey-digits``: stage B of the token-level passkey (Munkhdalai et al. 2024,
docs/maths.md 5.6): the paper's 5-digit passkey in repeated filler text, at word level.

``tasks.passkey_word_ids``: the prompt of ``passkey_prompt`` cut into words, digits and marks
(33 ids), the 5 digits of the key 5 tokens. Infini-attention with the linear and with the delta
memory (segment = ``segment_len`` tokens) is trained on prompts of ``train_fillers`` filler
repetitions (uniform; the needle at a random depth), the loss on the 5 answer digits (teacher
forced), then asked in prompts of ``lengths`` repetitions with the needle at ``depths``: read in
pieces with the state carried, the 5 digits decoded greedily, exact match. Each model again with
its memory switched off at evaluation is the control that the needle is out of the local
window. Stage A (one key-value needle) is ``infini-passkey``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..models import LanguageModel, LMConfig
from ..tasks.passkey import PASSKEY_WORDS, passkey_word_ids
from . import lm
from . import passkey_common as pk
from .common import Claim, Experiment, Plan, RunSpec, matplotlib_pyplot, mean_spread, values
from .infini_passkey import MEMORY_OFF
from .passkey_common import acc_metric, miss_metric
from .registry import register

# 2,000 steps of 12 prompts (the first record: 3,000 of 16) and 64 prompts per (length, depth)
# (the first record: 16) keep four seeds within about 30 min of 2-core CPU.
DEFAULT = {"d_model": 128, "n_layers": 2, "n_heads": 4, "segment_len": 32, "train_fillers": [2, 6],
           "batch_size": 12, "steps": 2000, "lr": 3e-3, "lengths": [2, 4, 8, 16, 32, 64],
           "depths": [0.0, 0.5, 1.0], "samples": 64, "piece": 512, "curve_every": 100}
QUICK = {"d_model": 16, "n_layers": 1, "n_heads": 2, "segment_len": 16, "train_fillers": [1, 2],
         "batch_size": 2, "steps": 3, "lr": 3e-3, "lengths": [1, 3], "depths": [0.0, 1.0],
         "samples": 2, "piece": 32, "curve_every": 1}
TRAINED = {"infini (linear)": {"update": "linear"}, "infini (delta)": {"update": "delta"}}
REFERENCE = "infini (linear)"
DIGITS = 5
FLOOR = 0.95  # miss at or above: exact match at most 5 % (chance is 1e-5)
MARGIN = 0.05


def _models(s: dict[str, Any]) -> dict[str, LMConfig]:
    configs = {label: LMConfig(vocab_size=len(PASSKEY_WORDS), d_model=s["d_model"],
                               n_layers=s["n_layers"], n_heads=s["n_heads"], mixer="infini",
                               mixer_options={**opts, "segment_len": s["segment_len"]})
               for label, opts in TRAINED.items()}
    return lm.match_parameters(configs, REFERENCE)


def _batch(n_filler: int, depths: list[float], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt ids [B, P] and answer ids [B, 5]; one filler count, so one prompt length."""
    pairs = [passkey_word_ids(n_filler, d, gen) for d in depths]
    return torch.tensor([p for p, _ in pairs]), torch.tensor([a for _, a in pairs])


def _tokens(s: dict[str, Any]) -> int:
    lo, hi = s["train_fillers"]
    per_filler = len(passkey_word_ids(1, 0.0, torch.Generator().manual_seed(0))[0]) - \
        len(passkey_word_ids(0, 0.0, torch.Generator().manual_seed(0))[0])
    base = len(passkey_word_ids(0, 0.0, torch.Generator().manual_seed(0))[0]) + DIGITS
    return s["steps"] * s["batch_size"] * (base + per_filler * (lo + hi) // 2)


def plan(quick: bool, seeds: list[int], data: str) -> Plan:
    s = dict(QUICK if quick else DEFAULT)
    runs = []
    for seed in seeds:
        for label, cfg in _models(s).items():
            runs.append(RunSpec(label, seed, {"config": cfg.to_dict()}))
            runs.append(RunSpec(MEMORY_OFF[label], seed, {"config": cfg.to_dict(), "memory_off": label}))
    return Plan(s, runs)


def train_digits(config: LMConfig, s: dict[str, Any], seed: int) -> tuple[LanguageModel | None, pk.Curve]:
    """Train on word-level passkey prompts, the loss on the 5 answer digits (teacher forced);
    returns the model in eval mode (None if diverged) and the learning curve [step, loss, exact
    match on the batch] (means over each ``curve_every`` steps). Data order: the seed only."""
    lo, hi = s["train_fillers"]

    def step_loss(model: LanguageModel, gen: torch.Generator) -> tuple[torch.Tensor, float]:
        n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        prompts, answers = _batch(n, torch.rand(s["batch_size"], generator=gen).tolist(), gen)
        ids = torch.cat([prompts, answers], dim=1)
        logits, _ = model(ids[:, :-1])
        key = logits[:, -DIGITS:].float()
        hit = float((key.argmax(-1) == answers).all(-1).float().mean())
        return F.cross_entropy(key.flatten(0, 1), answers.flatten()), hit

    return pk.train(config, s, seed, step_loss, s["curve_every"])


def execute(spec: RunSpec, p: Plan, workdir: Path) -> dict[str, Any]:
    s = p.settings
    config = LMConfig.from_dict(spec.options["config"])
    model, curve = pk.run_model(spec, workdir, spec.options.get("memory_off"),
                                lambda: train_digits(config, s, spec.seed))
    if model is None:
        return pk.diverged(config, s, _tokens(s), s["lengths"], curve)
    gen = torch.Generator().manual_seed(20_000 + spec.seed)
    metrics: dict[str, float] = {}
    for length in s["lengths"]:
        accs = []
        for depth in s["depths"]:
            prompts, answers = _batch(length, [depth] * s["samples"], gen)
            got = pk.retrieve(model, prompts, s["piece"], DIGITS)
            acc = float((got == answers).all(dim=1).float().mean())
            metrics[acc_metric(length, depth)] = acc
            accs.append(acc)
        metrics[miss_metric(length)] = 1.0 - sum(accs) / len(accs)
    if curve:
        metrics["final_train_loss"] = pk.final_train_loss(curve)
    inside = [n for n in s["lengths"] if n <= max(s["train_fillers"])]
    metrics.update(pk.trained_flag(metrics, inside, workdir, spec, spec.options.get("memory_off")))
    return {"parameters": model.num_parameters(), "steps": s["steps"], "tokens": _tokens(s),
            "curve": curve, "metrics": metrics}


def claims(p: Plan) -> list[Claim]:
    s = p.settings
    lengths, train = s["lengths"], max(s["train_fillers"])
    inside = max(n for n in lengths if n <= train)
    mid = [n for n in lengths if n >= 2 * train] or [lengths[-1]]
    acc = {"paired": True, "floor": FLOOR, "margin_abs": MARGIN}
    paper = ("Munkhdalai et al. 2024, §4.2 (passkey): a 1B Infini-Transformer fine-tuned on "
             "5K-token passkey instances retrieves the 5-digit key up to 1M tokens, with the linear "
             "and the linear + delta memory alike")
    out = []
    for model in MEMORY_OFF:
        for n in dict.fromkeys((mid[0], lengths[-1])):
            out.append(Claim(f"length generalisation: {model} at {n} repetitions no worse than at "
                             f"{inside} (inside training)", paper, (model, miss_metric(n)),
                             (model, miss_metric(inside)), "not_worse", source=pk.INFINI_SOURCE, **acc))
    out.append(Claim(f"delta memory and linear memory alike at {lengths[-1]} repetitions",
                     "Munkhdalai et al. 2024, Table 2 / §4.2: linear + delta matches linear: an "
                     "equality, on trained models",
                     ("infini (delta)", miss_metric(lengths[-1])), (REFERENCE, miss_metric(lengths[-1])),
                     "flat", source=pk.INFINI_SOURCE, **acc))
    out += [Claim(f"the needle is out of the local window: {model} < memory off at {mid[0]} "
                  "repetitions", "control, true by construction: the needle lies segments back, "
                  "beyond the segment-local attention", (model, miss_metric(mid[0])),
                  (off, miss_metric(mid[0])), control=True, **acc)
            for model, off in MEMORY_OFF.items()]
    return out


metrics = pk.metrics_with_train_loss


def plots(rows: list[dict[str, Any]], out: Path, p: Plan) -> list[str]:
    plt = matplotlib_pyplot()
    if plt is None:
        return []
    s = p.settings
    lo, hi = s["train_fillers"]
    return [
        pk.heatmap(plt, rows, out, s["lengths"], s["depths"], width=2.6, height=3.0, fontsize=6,
                   xticks=[str(n) for n in s["lengths"]], xlabel="filler repetitions",
                   title="5-digit word-level passkey: exact match (%), mean over seeds (trained "
                         f"on {lo}-{hi} repetitions)", title_size=9, model_size=7),
        *pk.learning_curves(plt, out, math.log(10), "training loss per answer digit (nats)",
                            "learning curves, one line per seed (dashed: ln 10, a guessed digit)"),
    ]


def notes(p: Plan, rows: list[dict[str, Any]]) -> list[str]:
    s = p.settings
    lo, hi = s["train_fillers"]
    table = ["| model | " + " | ".join(str(n) for n in s["lengths"]) + " |",
             "|---|" + "---|" * len(s["lengths"])]
    for model in dict.fromkeys(r["model"] for r in rows):
        cells = [1 - mean_spread(values(rows, model, miss_metric(n)))[0] for n in s["lengths"]]
        table.append(f"| {model} | " + " | ".join(
            "n/a" if not math.isfinite(c) else f"{c:.2f}" for c in cells) + " |")
    params = ", ".join(map(str, sorted({r["parameters"] for r in rows})))
    return [
        (f"{s['n_layers']} layers, d_model {s['d_model']}, {s['n_heads']} heads, Infini segment "
         f"N = {s['segment_len']} tokens ({params} parameters); {len(PASSKEY_WORDS)} word ids "
         f"(one filler repetition is 24 of them). Training: {s['steps']} steps of "
         f"{s['batch_size']} prompts of {lo}-{hi} filler repetitions, needle at a random depth, "
         f"AdamW lr {s['lr']:g} (warm-up 10 %, cosine), loss on the 5 answer digits."),
        (f"Evaluation: {s['samples']} prompts per (repetitions, depth), read in pieces of "
         f"{s['piece']} tokens with the state carried, 5 digits greedy, exact match; `miss@L` = 1 "
         "- exact match averaged over the depths. Memory off: the trained weights with every gate "
         f"logit at -inf. A side at miss >= {FLOOR} has not learned. `trained` = 1 when the "
         f"model's exact match averaged over the lengths inside its training range is at least "
         f"{1 - pk.TRAINED_MISS:.0%} (memory off: its trained model's flag); a claim on a run "
         "with 0 is not measured: the delta-linear equality needs both memories trained."),
        "Exact match by filler repetitions (mean over depths and seeds):\n\n" + "\n".join(table),
    ]


EXPERIMENT = Experiment(
    "infini-passkey-digits", "infini-passkey-digits: the 5-digit passkey at word level (stage B)",
    "Infini-attention's passkey claim (Munkhdalai et al. 2024; docs/maths.md 5.6) with the paper's "
    "5-digit key in repeated filler, tokenised by word: retrieval beyond the training length "
    "through the compressive memory.",
    plan, execute, claims, metrics, plots, notes, untrained=pk.UNTRAINED)
register(EXPERIMENT)
