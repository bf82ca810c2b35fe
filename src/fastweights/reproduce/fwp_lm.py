"""``fwp-lm``: the fast weight paper's language-model claims (Schlag, Irie, Schmidhuber 2021,
§6.3, WikiText-103 Tables 2-5; docs/maths.md 1.8, the language-model headline), here on the
bytes of ``stdlib``.

Runs (all at the parameter count of the sum-rule ELU+1 model, same token budget):
- per feature map (ELU+1 ``linear``, DPFP nu=1, FAVOR+ with m = head_dim / 2 random features,
  so that its 2m-dimensional feature space is overloaded), the sum rule (attention-normalised,
  the linear transformer) and the delta rule (sum-normalised, DeltaNet): Tables 2 and 5;
- (a) normalisation, as the paper's Table 3, on the delta model: sum normalisation alone (the
  delta model above) against sum plus attention normalisation (``ops.delta_rule_attn_norm``);
- (b) absolute positions, Table 3: the delta model again with sinusoidal absolute positions added
  to the embeddings at the embeddings' scale (``LMConfig.position_scale`` = the setting
  ``position_scale``, 0.02, the embeddings' init std: the ratio of Vaswani et al., whose
  embeddings are scaled up instead);
- (c) no truncation, Table 4: the delta and the sum-rule ELU+1 models again, trained with the
  state carried across windows (``train --carry-state``: every batch row reads a segment of
  ``train.batches.STREAM_WINDOWS`` consecutive windows from a random offset, then jumps to a new
  one) and evaluated on the same validation windows each read after the ``context_windows``
  windows before it with the state carried (``loss_carried``), against the truncation control:
  the same models trained on the same segments in the same order (same seed) with the state
  reset at every window (``train --reset-state``) and evaluated on independent windows
  (``loss``; every model reports both). So truncation is the only difference; the models
  trained on independent random windows are the earlier, confounded comparison (a control);
- softmax attention (RoPE) as the reference row.

Evaluation: ``eval_windows`` windows spread over every validation file (``lm.eval_starts``).
Each run reports ``trained``: 0 when its own validation loss is not below ``bigram``, the loss of
a count bigram model of the training split on the same bytes (setting ``trained_bar``): such a
model has learned nothing a comparison could use; every claim on it is *not measured*. Each
run's per-window losses go to ``windows.csv`` (the verdicts add the windows' noise).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..models import LMConfig
from ..train.batches import STREAM_WINDOWS
from . import lm
from .common import Claim, Experiment, Plan, RunSpec, bar_plot
from .registry import register

# trained_bar "bigram": a run is trained when its validation loss is below a count bigram's on
# the same bytes (None: no check, the --quick runs are too short to learn anything)
DEFAULT = {"d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 128, "batch_size": 8,
           "steps": 500, "lr": 2e-3, "eval_windows": 256, "context_windows": 15,
           "trained_bar": "bigram", "position_scale": 0.02}
QUICK = {"d_model": 16, "n_layers": 1, "n_heads": 2, "seq_len": 16, "batch_size": 2,
         "steps": 3, "lr": 2e-3, "eval_windows": 3, "context_windows": 2, "trained_bar": None,
         "position_scale": 0.02}
FWP = "000-fast-weight-programmers.txt"  # the seed note on the paper (the notes the project was written from)

FEATURE_MAPS = ("linear", "dpfp", "favor")
REFERENCE = "linear (sum)"
CARRIED = ("linear (sum), carried", "linear (delta), carried")  # trained with carry_state
# the truncation control: carry_state's segments in the same order, the state reset every window
RESET = ("linear (sum), reset", "linear (delta), reset")


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
        "linear (delta), sum+attention-norm": ("delta", {"normalize": "sum+attention"}, {}),
        "linear (delta), +positions": ("delta", {}, {"position": "sinusoidal",
                                                     "position_scale": s["position_scale"]}),
        "linear (sum), carried": ("linear", {}, {}),
        "linear (delta), carried": ("delta", {}, {}),
        "linear (sum), reset": ("linear", {}, {}),
        "linear (delta), reset": ("delta", {}, {}),
        "softmax": ("softmax", {}, {}),
    }
    configs = {label: LMConfig(vocab_size=256, d_model=s["d_model"], n_layers=s["n_layers"],
                               n_heads=s["n_heads"], mixer=name, mixer_options=opts, **extra)
               for label, (name, opts, extra) in mixers.items()}
    return lm.match_parameters(configs, REFERENCE)


def plan(quick: bool, seeds: list[int], data: str) -> Plan:
    return lm.lm_plan(quick, seeds, data, (DEFAULT, QUICK), _models,
                      carried=lambda label: label in CARRIED + RESET, reset=lambda label: label in RESET)


def execute(spec: RunSpec, p: Plan, workdir: Path) -> dict[str, Any]:
    s = p.settings
    config = LMConfig.from_dict(spec.options["config"])
    corpus = lm.corpus(s["data"])
    tcfg = lm.train_config(s, spec.seed, carry_state=spec.options.get("carry_state", False),
                           reset_state=spec.options.get("reset_state", False))
    model = lm.train_run(workdir, config, tcfg, corpus)
    if model is None:
        return lm.diverged(config, s, ["loss", "ppl", "loss_carried"])
    T, context = s["seq_len"], s["context_windows"] * s["seq_len"]
    starts = lm.eval_starts(corpus, T, s["eval_windows"], context)
    fresh = lm.windows_losses(model, corpus.val, starts, T)
    with_context = lm.windows_losses(model, corpus.val, starts, T, context)
    loss, carried = float(fresh.mean()), float(with_context.mean())
    # its own evaluation: the state carried where it trained carried (not the reset control)
    own = carried if spec.model in CARRIED else loss
    metrics = {"loss": loss, "ppl": lm.perplexity(loss), "loss_carried": carried,
               **lm.trained_metrics(own, lm.bar(s, corpus, starts, T))}
    return {"parameters": model.num_parameters(), "steps": s["steps"], "tokens": lm.tokens(s),
            "metrics": metrics, "windows": {"loss": fresh.tolist(), "loss_carried": with_context.tolist()}}


def claims(p: Plan) -> list[Claim]:
    where = {"linear": "Table 2 (small and medium)", "favor": "Table 2 (Performer, small and medium)",
             "dpfp": "Table 5 (appendix D.3, small, d_dot 256)"}
    source = {"linear": f"{FWP}, §6.3 (Table 2)", "favor": f"{FWP}, §6.3 (Table 2)",
              "dpfp": f"{FWP}, appendix D.3 (Table 5)"}
    out = [Claim(f"delta < sum rule, {fm}",
                 f"§6.3, {where[fm]}: with the delta update rule the model reaches lower "
                 f"perplexity than with the sum rule, for the {fm} feature map",
                 (f"{fm} (delta)", "loss"), (f"{fm} (sum)", "loss"), source=source[fm])
           for fm in FEATURE_MAPS]
    out += [
        Claim("(a) delta: sum normalisation alone < sum + attention normalisation",
              "§6.3, Table 3 (delta model): sum normalisation alone works better than adding "
              "attention normalisation, which may even diverge",
              ("linear (delta)", "loss"), ("linear (delta), sum+attention-norm", "loss"),
              source=f"{FWP}, §6.3 ablations (Table 3)"),
        Claim("(b) delta: no positions no worse than absolute positions",
              "§6.3, Table 3 (delta model): absolute positional encodings are not needed",
              ("linear (delta)", "loss"), ("linear (delta), +positions", "loss"), "not_worse",
              source=f"{FWP}, §6.3 ablations (Table 3)"),
        Claim("(c) delta: no truncation < truncated (the same segments, the state reset at every window)",
              "§6.3, Table 4: trained and evaluated without truncating the context (state "
              "carried), the delta net improves slightly over its truncated version",
              ("linear (delta), carried", "loss_carried"), ("linear (delta), reset", "loss"),
              source=f"{FWP}, §6.3 long sequences (Table 4)"),
        Claim("(c) sum rule: no truncation collapses (> 10 % worse than truncated on the same segments)",
              "§6.3, Table 4: without truncation the linear Transformer (sum rule) collapses "
              "(where the delta net improves slightly: the contrast is this row and the one above)",
              ("linear (sum), carried", "loss_carried"), ("linear (sum), reset", "loss"), "degrades",
              margin=0.1, source=f"{FWP}, §6.3 long sequences (Table 4)"),
        Claim("softmax remains best", "the softmax Transformer keeps the lowest perplexity of all "
              "(compared with the best linear variant here)",
              ("softmax", "loss"), ("linear (delta)", "loss"),
              source="docs/maths.md 1.8, LM headline [unverified]: not in the seed note"),
    ]
    out += [Claim(f"(c) {rule}: the data order alone: truncated on segments ~ truncated on "
                  "independent windows",
                  "control: the reset model reads the carried model's segments "
                  f"({p.settings['steps'] * p.settings['batch_size'] // STREAM_WINDOWS} random places "
                  f"of {STREAM_WINDOWS} consecutive windows per run) with window training's truncation; equal to "
                  "window training within the margin, the segments' order costs nothing, else "
                  "the comparison with window training (below) measures the data order too",
                  (f"linear ({rule}), reset", "loss"), (f"linear ({rule})", "loss"), "flat",
                  paired=False, control=True)
            for rule in ("delta", "sum")]
    out += [Claim(f"(c) {rule}: no truncation < truncated on independent windows (the earlier "
                  "comparison: truncation and data order together)",
                  "control: the first records' reading of Table 4, against the models trained on "
                  "independent random windows", (f"linear ({rule}), carried", "loss_carried"),
                  (f"linear ({rule})", "loss"), paired=False, control=True)
            for rule in ("delta", "sum")]
    return out


def metrics(p: Plan) -> list[str]:
    return ["loss", "ppl", "loss_carried", "trained"]


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
    context = s.get("context_windows", 0)
    return [
        lm.setup_note(s, rows, REFERENCE),
        (f"Validation: {s['eval_windows']} windows of {s['seq_len']} bytes spread over every file "
         "of the validation split (`lm.eval_starts`: at least one per file, the rest by size); "
         f"`loss` reads each from a fresh state, `loss_carried` reads each after the "
         f"{context} x {s['seq_len']} bytes before it with the state carried (softmax: its "
         "key/value cache grows, RoPE positions continue): the same bytes scored both ways."),
        ("No truncation (c): the `, carried` models train with the state carried across windows "
         "(`train --carry-state`): every batch row reads a segment of "
         f"{STREAM_WINDOWS} consecutive windows of {s['seq_len']} bytes from its own random "
         "offset of the training split, then jumps to a new random offset with a fresh state; "
         "the state is detached at every window boundary (truncated backpropagation through "
         "time, as the paper's carried fast weights). The truncation control, `, reset`: the "
         "same model, seed and segments in the same order (`train --carry-state --reset-state`), "
         "with the state reset at every window; so (c) compares the carried model's "
         "`loss_carried` with the reset model's `loss`, paired by seed, and truncation is the "
         "only difference. The models trained on independent random windows read "
         f"{s['steps'] * s['batch_size']} random places per run where the segments give "
         f"{s['steps'] * s['batch_size'] // STREAM_WINDOWS}: their comparison with the carried "
         "models (a control here) measures the data order as well; the controls say how much. "
         "(The first records read one contiguous region of 51-64 KB per row.)"),
        ("Ablation (b): `linear (delta), +positions` adds sinusoidal absolute position encodings "
         f"to the byte embeddings scaled by {s['position_scale']:g} (`LMConfig.position_scale`; the "
         "embeddings start at std 0.02, so the sinusoid sits at their scale, as "
         "in Vaswani et al., whose embeddings are scaled up to unit size instead; the first "
         "record added it at unit amplitude, which cost every model 0.43-0.55 nats); no other "
         "model has any (softmax uses RoPE)."),
        ("Ablation (a) is on the delta model, as the paper's Table 3: `linear (delta)` (sum "
         "normalisation, the default) against `linear (delta), sum+attention-norm` "
         "(`ops.delta_rule_attn_norm`: the retrieved value and the read-out divided by the "
         "accumulated keys' normaliser). The first record ran it on the sum rule."),
        lm.trained_note(s, rows, "own validation loss (`loss_carried` for the carried models)"),
        ("(c) pairs the carried and the reset model of each seed (the same initial weights and "
         "segments); the controls against window training are unpaired (Welch): another data order."),
        ("Perplexity per byte = exp(loss); the paper reports word-level perplexity on WikiText-103 "
        "with far larger models, so only directions are comparable; n/a marks a metric a model "
        "does not report."),
    ]


EXPERIMENT = Experiment(
    "fwp-lm", "fwp-lm: delta vs sum rule in byte language modelling",
    "The fast weight paper's language-model claims (Schlag, Irie, Schmidhuber 2021; "
    "docs/maths.md 1.8): for each feature map the delta rule beats the sum rule, with ablations on "
    "normalisation and truncation.",
    plan, execute, claims, metrics, plots, notes, untrained=lm.UNTRAINED)
register(EXPERIMENT)
