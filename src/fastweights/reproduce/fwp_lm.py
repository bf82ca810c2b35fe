"""``fwp-lm``: the fast weight paper's language-model claims (Schlag, Irie, Schmidhuber 2021,
WikiText-103 tables; SPEC.md 1.8 "LM headline"), here on the bytes of ``stdlib``.

Runs (all at the parameter count of the sum-rule ELU+1 model, same token budget):
- per feature map (ELU+1 ``linear``, DPFP nu=1, FAVOR+ with m = head_dim / 2 random features,
  so that its 2m-dimensional feature space is overloaded), the sum rule (attention-normalised,
  the linear transformer) and the delta rule (sum-normalised, DeltaNet);
- (a) the sum rule with sum normalisation alone vs sum normalisation plus attention normalisation;
- (b) absolute positions: the delta and the sum-rule ELU+1 models again with sinusoidal absolute
  position encodings added to the embeddings (``LMConfig.position``); the claim is that the
  delta model does not need them (no worse without), where the sum-rule model does;
- (c) no truncation: the delta and the sum-rule ELU+1 models again, trained with the state
  carried across consecutive windows of each row's stream (``train --carry-state``, truncated
  backpropagation through time) and evaluated on the validation windows read as one stream with
  the state carried (``eval --carry-state``), against the same models trained and evaluated on
  independent windows (every model reports both evaluations);
- softmax attention (RoPE) as the reference row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..models import LMConfig
from ..train.trainer import evaluate
from . import lm
from .common import Claim, Experiment, Plan, RunSpec, bar_plot
from .registry import register

DEFAULT = {"d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 128, "batch_size": 8,
           "steps": 500, "lr": 2e-3, "eval_windows": 64}
QUICK = {"d_model": 16, "n_layers": 1, "n_heads": 2, "seq_len": 16, "batch_size": 2,
         "steps": 3, "lr": 2e-3, "eval_windows": 3}

FEATURE_MAPS = ("linear", "dpfp", "favor")
REFERENCE = "linear (sum)"
CARRIED = ("linear (sum), carried", "linear (delta), carried")  # trained with carry_state


def _models(s: dict[str, Any]) -> dict[str, LMConfig]:
    head_dim = s["d_model"] // s["n_heads"]
    m = max(1, head_dim // 2)  # 2m = head_dim features: FAVOR+ overloaded like the paper's small m
    mixers: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
        "linear (sum)": ("linear", {}, {}),
        "linear (delta)": ("delta", {}, {}),
        "dpfp (sum)": ("dpfp", {"nu": 1}, {}),
        "dpfp (delta)": ("delta", {"feature_map": "dpfp", "nu": 1}, {}),
        "favor (sum)": ("favor", {"m": m}, {}),
        "favor (delta)": ("delta", {"feature_map": "favor", "m": m}, {}),
        "linear (sum), sum-norm": ("linear", {"normalize": "sum"}, {}),
        "linear (sum), sum+attention-norm": ("linear", {"normalize": "sum+attention"}, {}),
        "linear (sum), +positions": ("linear", {}, {"position": "sinusoidal"}),
        "linear (delta), +positions": ("delta", {}, {"position": "sinusoidal"}),
        "linear (sum), carried": ("linear", {}, {}),
        "linear (delta), carried": ("delta", {}, {}),
        "softmax": ("softmax", {}, {}),
    }
    configs = {label: LMConfig(vocab_size=256, d_model=s["d_model"], n_layers=s["n_layers"],
                               n_heads=s["n_heads"], mixer=name, mixer_options=opts, **extra)
               for label, (name, opts, extra) in mixers.items()}
    return lm.match_parameters(configs, REFERENCE)


def plan(quick: bool, seeds: list[int], data: str) -> Plan:
    return lm.lm_plan(quick, seeds, data, (DEFAULT, QUICK), _models, carried=lambda label: label in CARRIED)


def execute(spec: RunSpec, p: Plan, workdir: Path) -> dict[str, Any]:
    s = p.settings
    config = LMConfig.from_dict(spec.options["config"])
    corpus = lm.corpus(s["data"])
    tcfg = lm.train_config(s, spec.seed, carry_state=spec.options.get("carry_state", False))
    model = lm.train_run(workdir, config, tcfg, corpus)
    if model is None:
        return lm.diverged(config, s, ["loss", "ppl", "loss_carried"])
    loss = evaluate(model, corpus.val, s["seq_len"], s["eval_windows"])
    carried = evaluate(model, corpus.val, s["seq_len"], s["eval_windows"], carry_state=True)
    metrics = {"loss": loss, "ppl": lm.perplexity(loss), "loss_carried": carried}
    return {"parameters": model.num_parameters(), "steps": s["steps"], "tokens": lm.tokens(s),
            "metrics": metrics}


def claims(p: Plan) -> list[Claim]:
    out = [Claim(f"delta < sum rule, {fm}",
                 "the delta rule lowers perplexity relative to the sum rule for each feature map "
                 "(Linear, DPFP, FAVOR+; WikiText-103)",
                 (f"{fm} (delta)", "loss"), (f"{fm} (sum)", "loss")) for fm in FEATURE_MAPS]
    out += [
        Claim("(a) sum-norm alone < sum-norm + attention-norm",
              "with sum normalisation, adding attention normalisation hurts (it may even diverge)",
              ("linear (sum), sum-norm", "loss"), ("linear (sum), sum+attention-norm", "loss")),
        Claim("(b) delta: no positions <= absolute positions",
              "the delta model does not need absolute position encodings",
              ("linear (delta)", "loss"), ("linear (delta), +positions", "loss"), "not_worse"),
        Claim("(b) sum rule: absolute positions < no positions",
              "the sum-rule linear transformer, in contrast, uses them",
              ("linear (sum), +positions", "loss"), ("linear (sum)", "loss")),
        Claim("(c) delta: no truncation < truncated",
              "trained and evaluated without truncating the context (state carried), the delta "
              "model improves slightly over truncated training and evaluation",
              ("linear (delta), carried", "loss_carried"), ("linear (delta)", "loss")),
        Claim("(c) sum rule: truncated < no truncation",
              "without truncation the sum-rule linear transformer degrades badly or collapses",
              ("linear (sum)", "loss"), ("linear (sum), carried", "loss_carried")),
        Claim("softmax remains best", "softmax attention remains better than every linear variant",
              ("softmax", "loss"), ("linear (delta)", "loss")),
    ]
    return out


def metrics(p: Plan) -> list[str]:
    return ["loss", "ppl", "loss_carried"]


def plots(rows: list[dict[str, Any]], out: Path, p: Plan) -> list[str]:
    written = []
    if bar_plot(out / "loss.png", rows, "loss", "validation loss (nats/byte)",
                "fwp-lm: truncated windows"):
        written.append("loss.png")
    if bar_plot(out / "loss_carried.png", rows, "loss_carried", "validation loss, state carried",
                "fwp-lm: no truncation"):
        written.append("loss_carried.png")
    return written


def notes(p: Plan, rows: list[dict[str, Any]]) -> list[str]:
    s = p.settings
    return [
        lm.setup_note(s, rows, REFERENCE),
        (f"Validation on the first {s['eval_windows']} windows of {s['seq_len']} "
        "bytes of the validation split; `loss_carried` reads the same bytes as one stream with "
        "the state carried (softmax: its key/value cache grows, RoPE positions continue)."),
        ("No truncation (c): the `, carried` models train with the state carried across "
        f"consecutive windows of {s['seq_len']} bytes (`train --carry-state`: each batch row "
        "reads one contiguous shard of the training split, the state is detached at every "
        "window boundary, truncated backpropagation through time as the paper's carried fast "
        "weights) and are compared by `loss_carried` with the window-trained models' `loss`. "
        "Every other model trains on independent random windows from a fresh state."),
        ("Ablation (b): the `+positions` models add sinusoidal absolute position encodings to "
        "the byte embeddings (`LMConfig.position`); no other model has any (softmax uses RoPE)."),
        ("Perplexity per byte = exp(loss); the paper reports word-level perplexity on WikiText-103 "
        "with far larger models, so only directions are comparable; n/a marks a metric a model "
        "does not report."),
    ]


EXPERIMENT = Experiment(
    "fwp-lm", "fwp-lm: delta vs sum rule in byte language modelling",
    "The fast weight paper's language-model claims (Schlag, Irie, Schmidhuber 2021; SPEC.md 1.8): "
    "for each feature map the delta rule beats the sum rule, with ablations on normalisation and "
    "truncation.",
    plan, execute, claims, metrics, plots, notes)
register(EXPERIMENT)
