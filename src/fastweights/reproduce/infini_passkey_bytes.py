"""``infini-passkey-bytes``: Infini-attention's passkey retrieval far beyond the training length
(Munkhdalai et al. 2024, docs/maths.md 5.6), at toy scale and at byte level: the hard setting.

The first version of ``infini-passkey``, kept as a documented hard setting: at byte level no
model learned the 5-digit key within its budget (the softmax control included), so every claim
is *not measured* here; ``infini-passkey`` is the token-level rebuild.

Every model is trained on synthetic passkey sequences (``tasks.passkey``: the needle at a random
depth in repeated filler, the question, the 5 digits) of ``train_lengths`` bytes, then asked for
the key in prompts of ``lengths`` bytes with the needle at ``depths``: the prompt is prefilled in
pieces with the state carried, the 5 digits are decoded greedily, and a prompt counts when all
5 are right (exact match). Models: Infini-attention with the linear and with the delta memory,
the linear one again with its memory switched off at evaluation (every gate forced to the
segment-local path, sigmoid(beta) = 0), DeltaNet, and softmax attention (evaluated only within
its training length). All at the Infini model's parameter count and the same token budget.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..models import LanguageModel, LMConfig
from ..tasks.passkey import passkey_prompt
from . import lm
from . import passkey_common as pk
from .common import Claim, Experiment, Plan, RunSpec, matplotlib_pyplot
from .passkey_common import acc_metric, miss_metric
from .registry import register

# Training lengths 256-512 bytes put the needle up to 8 segments of 64 back. A first default of
# 512-1024 bytes, 300 steps, lr 2e-3 and key weight 1 left every model at 0 % even within its
# training length (softmax included): the 5 digits carried too little of the loss. With key
# weight 4 and lr 3e-3, softmax learns the copy at 128-256 bytes in ~100 steps (scratch runs
# recorded in the results README).
DEFAULT = {"d_model": 128, "n_layers": 2, "n_heads": 4, "segment_len": 64,
           "train_lengths": [256, 512], "batch_size": 8, "steps": 400, "lr": 3e-3,
           "key_weight": 4.0,
           "lengths": [512, 1024, 2048, 4096, 8192, 16384, 32768], "depths": [0.0, 0.5, 1.0],
           "samples": 4, "piece": 4096}
QUICK = {"d_model": 16, "n_layers": 1, "n_heads": 2, "segment_len": 32,
         "train_lengths": [160, 256], "batch_size": 2, "steps": 3, "lr": 2e-3, "key_weight": 4.0,
         "lengths": [256, 512], "depths": [0.0, 1.0], "samples": 2, "piece": 128}
REFERENCE = "infini (linear)"
MEMORY_OFF = "infini (linear), memory off"
TRAINED = {"infini (linear)": ("infini", {"update": "linear"}),
           "infini (delta)": ("infini", {"update": "delta"}),
           "deltanet": ("delta", {}), "softmax": ("softmax", {})}
DIGITS = 5


def _n_filler(length: int) -> int:
    """Filler repetitions that bring the prompt closest to ``length`` bytes."""
    gen = torch.Generator().manual_seed(0)
    base = len(passkey_prompt(0, 0.0, gen)[0])
    one = len(passkey_prompt(1, 0.0, gen)[0]) - base
    return max(0, round((length - base) / one))


def _batch(n_filler: int, depths: list[float], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts (byte ids [B, P]) and answers ([B, 5]); every prompt has the same length."""
    pairs = [passkey_prompt(n_filler, d, gen) for d in depths]
    prompts = torch.tensor([list(p.encode()) for p, _ in pairs])
    answers = torch.tensor([list(a.encode()) for _, a in pairs])
    return prompts, answers


def _models(s: dict[str, Any]) -> dict[str, LMConfig]:
    configs = {}
    for label, (name, opts) in TRAINED.items():
        opts = {**opts, "segment_len": s["segment_len"]} if name == "infini" else opts
        configs[label] = LMConfig(vocab_size=256, d_model=s["d_model"], n_layers=s["n_layers"],
                                  n_heads=s["n_heads"], mixer=name, mixer_options=opts)
    return lm.match_parameters(configs, REFERENCE)


def _tokens(s: dict[str, Any]) -> int:
    """Training bytes per run: every step draws a length uniformly in train_lengths' range, so
    the budget is reported as steps x batch x the mean length."""
    lo, hi = s["train_lengths"]
    return s["steps"] * s["batch_size"] * (lo + hi) // 2


def plan(quick: bool, seeds: list[int], data: str) -> Plan:
    s = dict(QUICK if quick else DEFAULT)
    configs = _models(s)
    runs = []
    for seed in seeds:
        for label, cfg in configs.items():
            runs.append(RunSpec(label, seed, {"config": cfg.to_dict()}))
            if label == REFERENCE:  # evaluated from the same weights: see execute
                runs.append(RunSpec(MEMORY_OFF, seed, {"config": cfg.to_dict(), "memory_off": True}))
    return Plan(s, runs)


def _train(config: LMConfig, s: dict[str, Any], seed: int) -> LanguageModel | None:
    """Train on passkey sequences: next-byte loss over the whole sequence plus ``key_weight``
    times the loss of the 5 answer digits (so the rare retrieval targets outweigh the filler).
    None on a non-finite loss or gradient (diverged)."""
    lo, hi = s["train_lengths"]

    def step_loss(model: LanguageModel, gen: torch.Generator) -> tuple[torch.Tensor, None]:
        length = int(torch.randint(lo, hi + 1, (1,), generator=gen))
        depths = torch.rand(s["batch_size"], generator=gen).tolist()
        prompts, answers = _batch(_n_filler(length), depths, gen)
        ids = torch.cat([prompts, answers], dim=1)
        logits, _ = model(ids[:, :-1])
        targets = ids[:, 1:]
        loss_all = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss_key = F.cross_entropy(logits[:, -DIGITS:].flatten(0, 1).float(), targets[:, -DIGITS:].flatten())
        return loss_all + s["key_weight"] * loss_key, None

    return pk.train(config, s, seed, step_loss)[0]


def retrieve(model: LanguageModel, prompts: torch.Tensor, piece: int) -> torch.Tensor:
    """Greedy 5-digit answers [B, 5] to ``prompts`` [B, P]: the prompt is read in pieces of
    ``piece`` tokens with the state carried (constant memory for the recurrent models), then
    one token at a time."""
    return pk.retrieve(model, prompts, piece, DIGITS)


def execute(spec: RunSpec, p: Plan, workdir: Path) -> dict[str, Any]:
    s = p.settings
    config = LMConfig.from_dict(spec.options["config"])
    lengths = s["lengths"]
    source = REFERENCE if spec.options.get("memory_off") else None
    model, _ = pk.run_model(spec, workdir, source, lambda: (_train(config, s, spec.seed), []))
    if model is None:
        return pk.diverged(config, s, _tokens(s), lengths)
    gen = torch.Generator().manual_seed(20_000 + spec.seed)
    metrics: dict[str, float] = {}
    window = max(s["train_lengths"])
    for length in lengths:
        if spec.model == "softmax" and length > window:
            continue  # softmax cannot go beyond its training length: not evaluated (n/a)
        accs = []
        for depth in s["depths"]:
            prompts, answers = _batch(_n_filler(length), [depth] * s["samples"], gen)
            got = retrieve(model, prompts, s["piece"])
            acc = float((got == answers).all(dim=1).float().mean())
            metrics[acc_metric(length, depth)] = acc
            accs.append(acc)
        metrics[miss_metric(length)] = 1.0 - sum(accs) / len(accs)
    return {"parameters": model.num_parameters(), "steps": s["steps"], "tokens": _tokens(s),
            "metrics": metrics}


FLOOR = 0.95  # miss at or above: at most 5 % exact match, nothing learned (chance is 1e-5)


def claims(p: Plan) -> list[Claim]:
    s = p.settings
    first, far = s["lengths"][0], s["lengths"][-1]
    acc = {"paired": True, "floor": FLOOR, "margin_abs": 0.05}
    paper = ("Munkhdalai et al. 2024, §4.2 (passkey): a 1B Infini-Transformer fine-tuned on "
             "5K-token passkey instances retrieves the key in contexts up to 1M tokens, with the "
             "linear and the linear + delta memory alike")
    return [
        Claim(f"length generalisation: infini at {far} no worse than at {first}", paper,
              (REFERENCE, miss_metric(far)), (REFERENCE, miss_metric(first)), "not_worse",
              source=pk.INFINI_SOURCE, **acc),
        Claim(f"delta memory and linear memory alike at {far}", "Munkhdalai et al. 2024, Table 2 / "
              "§4.2: linear + delta matches linear (passkey both near 100 % after fine-tuning): "
              "an equality", ("infini (delta)", miss_metric(far)), (REFERENCE, miss_metric(far)),
              "flat", source=pk.INFINI_SOURCE, **acc),
        *[Claim(f"the needle is out of the local window: infini < memory off at {n}", "control, "
                "true by construction: without the memory the needle more than one segment back "
                "is out of reach", (REFERENCE, miss_metric(n)), (MEMORY_OFF, miss_metric(n)),
                control=True, **acc) for n in (first, far)],
        Claim(f"within the training length: softmax learns the task ({first}): softmax < memory off",
              "control: full attention sees the needle", ("softmax", miss_metric(first)),
              (MEMORY_OFF, miss_metric(first)), control=True, **acc),
    ]


def metrics(p: Plan) -> list[str]:
    return [miss_metric(n) for n in p.settings["lengths"]]


def plots(rows: list[dict[str, Any]], out: Path, p: Plan) -> list[str]:
    plt = matplotlib_pyplot()
    if plt is None:
        return []
    s = p.settings
    lengths = s["lengths"]
    return [
        pk.heatmap(plt, rows, out, lengths, s["depths"], width=2.6, height=3.2, fontsize=7,
                   xticks=[f"{n // 1024}K" if n >= 1024 else str(n) for n in lengths],
                   xlabel="prompt length (bytes)", title="passkey exact-match accuracy (%)",
                   title_size=10, model_size=8),
        pk.accuracy_vs_length(plt, rows, out, lengths, max(s["train_lengths"]), chance=None,
                              xlabel="prompt length (bytes)", ylabel="exact match, mean over depths",
                              title="passkey retrieval vs length (dotted: longest training "
                                    "sequence)", title_size=10, legend_size=8),
    ]


def notes(p: Plan, rows: list[dict[str, Any]]) -> list[str]:
    s = p.settings
    params = ", ".join(map(str, sorted({r["parameters"] for r in rows})))
    lo, hi = s["train_lengths"]
    return [
        (f"{s['n_layers']} layers, d_model {s['d_model']}, {s['n_heads']} heads, Infini segment "
         f"N = {s['segment_len']}; feed-forward widths matched to `{REFERENCE}` within "
         f"{lm.MATCH_TOLERANCE:.0%} (counts: {params}). Training: {s['steps']} steps of "
         f"{s['batch_size']} passkey sequences of {lo}-{hi} bytes (random depth), AdamW, loss = "
         f"next-byte loss of the whole sequence + {s['key_weight']:g} x loss of the 5 answer digits, "
         f"lr {s['lr']:g}."),
        (f"Evaluation: {s['samples']} prompts per (length, depth), prefilled in pieces of "
         f"{s['piece']} bytes with the state carried, 5 digits decoded greedily, exact match. "
         "`miss@L` = 1 - accuracy averaged over the depths (lower is better). Softmax attention "
         f"is evaluated only up to its training length ({hi}; beyond it: n/a)."),
        (f"`{MEMORY_OFF}` is `{REFERENCE}`'s trained weights (saved in its run folder) with every "
         "gate logit set to -inf at evaluation."),
        "Accuracy per length (columns, bytes) and needle depth, mean over seeds:\n\n"
        + pk.depth_table(rows, s["lengths"], s["depths"]),
        ("The paper: 1B model, segment 2048, fine-tuned on 5K tokens, up to 1M tokens; ours is a "
         "direction check at toy scale."),
    ]


EXPERIMENT = Experiment(
    "infini-passkey-bytes", "infini-passkey-bytes: byte-level passkey retrieval (the hard setting)",
    "Infini-attention's passkey claim (Munkhdalai et al. 2024; docs/maths.md 5.6): with the "
    "compressive memory the model retrieves the key far beyond its training length.",
    plan, execute, claims, metrics, plots, notes)
register(EXPERIMENT)
