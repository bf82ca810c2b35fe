"""What the three Infini-attention passkey experiments (``infini-passkey``, ``-digits``,
``-bytes``) share: the training loop, reading a prompt in pieces and answering it, the memory-off
control, the trained-or-reloaded model of a run, the accuracy metrics, the heatmap, the
accuracy-vs-length and learning-curve plots and the per-depth accuracy table. Each experiment
keeps its data, losses, claims and notes.

The training loop draws its data at the same point of every step as the experiments did before
they shared it, so results are bit-identical for the same seed.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..layers import InfiniAttention
from ..models import LanguageModel, LMConfig
from ..train.trainer import TrainConfig, lr_factor
from . import lm
from .common import RESULT_FILE, RUNS, Plan, RunSpec, mean_spread, values

MODEL_DIR = "model"  # the trained weights, in each run's folder
Curve = list[list[float]]  # [step, mean loss, mean batch accuracy] per point
# One training step's loss and batch accuracy (None: not tracked), from the model and the
# step's data generator (drawn from in the same order on every run of one seed).
StepLoss = Callable[[LanguageModel, torch.Generator], tuple[torch.Tensor, float | None]]


def acc_metric(length: int, depth: float) -> str:
    return f"acc@{length},d={depth:g}"


def miss_metric(length: int) -> str:
    """1 - accuracy averaged over the depths (lower is better, as the verdict rule wants)."""
    return f"miss@{length}"


def metrics_with_train_loss(p: Plan) -> list[str]:
    """The metrics table's columns: miss at every evaluated length, the final training loss and
    whether the model trained."""
    return [*(miss_metric(n) for n in p.settings["lengths"]), "final_train_loss", "trained"]


def train(config: LMConfig, s: dict[str, Any], seed: int, step_loss: StepLoss,
          curve_every: int | None = None) -> tuple[LanguageModel | None, Curve]:
    """Train ``LanguageModel(config)`` for ``s["steps"]`` AdamW steps (lr ``s["lr"]``, warm-up
    10 %, cosine, betas (0.9, 0.95), weight decay 0.1, gradients clipped at 1). Returns the model
    in eval mode (None when a loss or gradient turned non-finite: diverged) and, with
    ``curve_every``, the learning curve: a point every ``curve_every`` steps and at the last, the
    means over the steps since the previous point. The data generator is seeded by the seed
    only, so every model of one seed sees the same data."""
    torch.manual_seed(seed)
    model = LanguageModel(config)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=s["lr"], betas=(0.9, 0.95), weight_decay=0.1)
    cfg = TrainConfig(steps=s["steps"], lr=s["lr"], warmup=max(1, s["steps"] // 10))
    gen = torch.Generator().manual_seed(10_000 + seed)
    curve: Curve = []
    losses: list[float] = []
    hits: list[float] = []
    for step in range(s["steps"]):
        for group in opt.param_groups:
            group["lr"] = s["lr"] * lr_factor(step, cfg)
        loss, hit = step_loss(model, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if not (math.isfinite(loss.item()) and math.isfinite(norm.item())):
            return None, curve
        opt.step()
        if curve_every is None:
            continue
        losses.append(loss.item())
        hits.append(math.nan if hit is None else hit)
        if (step + 1) % curve_every == 0 or step + 1 == s["steps"]:
            curve.append([step + 1, sum(losses) / len(losses), sum(hits) / len(hits)])
            losses, hits = [], []
    return model.eval(), curve


@torch.no_grad()
def read(model: LanguageModel, ids: torch.Tensor, piece: int) -> tuple[torch.Tensor, Any]:
    """(logits [B, piece', V] of the last piece, state) after reading ``ids`` [B, T] in pieces
    of ``piece`` tokens with the state carried (constant memory for the recurrent models)."""
    state, logits = None, None
    for start in range(0, ids.shape[1], piece):
        logits, state = model(ids[:, start:start + piece], state)
    return logits, state


@torch.no_grad()
def retrieve(model: LanguageModel, prompts: torch.Tensor, piece: int, n_tokens: int) -> torch.Tensor:
    """Greedy answers [B, n_tokens] to ``prompts`` [B, P]: the prompt read in pieces of
    ``piece`` tokens with the state carried, then one token at a time."""
    logits, state = read(model, prompts, piece)
    out = []
    for _ in range(n_tokens):
        token = logits[:, -1].argmax(-1, keepdim=True)
        out.append(token)
        logits, state = model(token, state)
    return torch.cat(out, dim=1)


def memory_off(model: LanguageModel) -> LanguageModel:
    """A copy whose Infini layers all take the segment-local path: gate logit -inf, so
    sigmoid(beta) = 0 and A = A_dot (docs/maths.md 5.5)."""
    off = copy.deepcopy(model)
    for layer in off.modules():
        if isinstance(layer, InfiniAttention):
            layer.gate.data.fill_(-math.inf)
    return off


def run_model(spec: RunSpec, workdir: Path, source: str | None,
              train_run: Callable[[], tuple[LanguageModel | None, Curve]]
              ) -> tuple[LanguageModel | None, Curve]:
    """The model a run evaluates and its learning curve: trained by ``train_run`` and saved in
    the run's folder; or, for a memory-off run of the trained run ``source`` (same seed), that
    run's saved weights (retrained with the same seed, so the same weights, when they are not
    kept) with the memory switched off. (None, curve) when training diverged."""
    curve: Curve = []
    trained = workdir.parent / RunSpec(source, spec.seed).key / MODEL_DIR if source else None
    if trained is not None and (trained / "config.json").is_file():
        model = LanguageModel.from_pretrained(trained).eval()  # the trained run's weights
    else:
        model, curve = train_run()
    if model is None:
        return None, curve
    if source:
        return memory_off(model), curve
    model.save_pretrained(workdir / MODEL_DIR)
    return model, curve


def diverged(config: LMConfig, s: dict[str, Any], tokens: int, lengths: Sequence[int],
             curve: Curve | None = None) -> dict[str, Any]:
    """A diverged run's result: every miss metric NaN."""
    out: dict[str, Any] = {"parameters": lm.count_parameters(config), "steps": s["steps"],
                           "tokens": tokens, "diverged": True}
    if curve is not None:
        out["curve"] = curve
    out["metrics"] = dict.fromkeys(map(miss_metric, lengths), math.nan)
    return out


TRAINED_MISS = 0.1  # a model has learned the task: miss at most this inside its training lengths
# the verdicts' name for a run with trained = 0: the criterion it failed, not a claim that it
# learned nothing (a model may retrieve well at one training length and not at another)
UNTRAINED = (f"retrieves less than {1 - TRAINED_MISS:.0%} averaged over its training lengths (the "
             "trained bar)")
INFINI = "004-infini-attention.txt"
INFINI_SOURCE = (f"docs/maths.md 5.6 [unverified]: the seed note {INFINI} describes the method only, "
                 "no experiments")


def trained_flag(metrics: dict[str, float], inside: Sequence[int], workdir: Path, spec: RunSpec,
                 source: str | None) -> dict[str, float]:
    """``{"trained": 1.0 or 0.0}``: 1 when the run's miss averaged over the lengths ``inside``
    its training range is at most ``TRAINED_MISS`` (it retrieves at least 90 % where it was
    trained); a memory-off run (``source``: the run whose weights it evaluates) takes its
    source's flag, read from that run's result (none when it is missing): the weights trained,
    the memory is switched off by design."""
    if source:
        try:
            result = json.loads((workdir.parent / RunSpec(source, spec.seed).key / RESULT_FILE).read_text())
            return {"trained": float(result["metrics"]["trained"])}
        except (OSError, ValueError, KeyError, TypeError):
            return {}
    misses = [metrics[miss_metric(n)] for n in inside if miss_metric(n) in metrics]
    return {"trained": float(bool(misses) and sum(misses) / len(misses) <= TRAINED_MISS)}


def final_train_loss(curve: Curve) -> float:
    """The mean training loss over the last fifth of the curve's points."""
    tail = curve[-max(1, len(curve) // 5):]
    return sum(c[1] for c in tail) / len(tail)


def curves(out: Path) -> dict[str, list[Curve]]:
    """model -> the learning curves of its seeds, from the per-run result files (if kept)."""
    got: dict[str, list[Curve]] = {}
    for path in sorted((out / RUNS).glob("*/result.json")):
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if result.get("curve"):
            got.setdefault(result["model"], []).append(result["curve"])
    return got


def heatmap(plt: Any, rows: list[dict[str, Any]], out: Path, lengths: Sequence[int],
            depths: Sequence[float], *, width: float, height: float, fontsize: int,
            xticks: Sequence[str], xlabel: str, title: str, title_size: int,
            model_size: int) -> str:
    """``passkey_heatmap.png``: per model, accuracy (%) by length (columns) and needle depth
    (rows), mean over seeds; n/a where a model was not evaluated."""
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(width * len(models) + 1, height), squeeze=False)
    for ax, model in zip(axes[0], models):
        grid = [[mean_spread(values(rows, model, acc_metric(n, d)))[0] for n in lengths] for d in depths]
        ax.imshow([[v if math.isfinite(v) else math.nan for v in line] for line in grid],
                  vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i, line in enumerate(grid):
            for j, v in enumerate(line):
                ax.text(j, i, "n/a" if not math.isfinite(v) else f"{100 * v:.0f}", ha="center",
                        va="center", fontsize=fontsize)
        ax.set_xticks(range(len(lengths)), list(xticks), fontsize=fontsize)
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
        ax.set_title(model, fontsize=model_size)
        ax.set_xlabel(xlabel, fontsize=7)
    axes[0][0].set_ylabel("needle depth", fontsize=8)
    fig.suptitle(title, fontsize=title_size)
    fig.tight_layout()
    fig.savefig(out / "passkey_heatmap.png", dpi=110)
    plt.close(fig)
    return "passkey_heatmap.png"


def accuracy_vs_length(plt: Any, rows: list[dict[str, Any]], out: Path, lengths: Sequence[int],
                       window: int, *, chance: float | None, xlabel: str, ylabel: str,
                       title: str, title_size: int, legend_size: int) -> str:
    """``passkey_vs_length.png``: accuracy (1 - miss) against length per model, mean over seeds;
    dotted: the longest training length ``window``; dashed: ``chance`` (if given)."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for model in dict.fromkeys(r["model"] for r in rows):
        accs = [1 - mean_spread(values(rows, model, miss_metric(n)))[0] for n in lengths]
        ax.plot(lengths, accs, marker="o", label=model)
    ax.axvline(window, color="grey", lw=0.8, ls=":")
    if chance is not None:
        ax.axhline(chance, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=title_size)
    ax.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(out / "passkey_vs_length.png", dpi=110)
    plt.close(fig)
    return "passkey_vs_length.png"


def learning_curves(plt: Any, out: Path, chance_loss: float, ylabel: str, title: str) -> list[str]:
    """``learning_curves.png`` from the kept per-run results (one line per seed; dashed: the
    loss of a guess, ``chance_loss``); nothing when no run kept its curve."""
    found = curves(out)
    if not found:
        return []
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, (model, runs) in enumerate(found.items()):
        for j, curve in enumerate(runs):
            ax.plot([c[0] for c in curve], [c[1] for c in curve], color=f"C{i}", lw=1,
                    label=model if j == 0 else None)
    ax.axhline(chance_loss, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("training step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "learning_curves.png", dpi=110)
    plt.close(fig)
    return ["learning_curves.png"]


def depth_table(rows: list[dict[str, Any]], lengths: Sequence[int], depths: Sequence[float]) -> str:
    """A markdown table of accuracy (%) per model and depth (rows) by length (columns)."""
    table = ["| model | " + " | ".join(f"{n}" for n in lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    for model in dict.fromkeys(r["model"] for r in rows):
        for d in depths:
            cells = [mean_spread(values(rows, model, acc_metric(n, d)))[0] for n in lengths]
            table.append(f"| {model}, depth {d:g} | " + " | ".join(
                "n/a" if not math.isfinite(c) else f"{100 * c:.0f} %" for c in cells) + " |")
    return "\n".join(table)
