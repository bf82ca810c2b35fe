"""Memory capacity and updating on synthetic retrieval: the runs behind ``fastweights recall``
and ``fastweights reproduce fwp-recall``.

For ``capacity`` / ``update`` (docs/maths.md 1.8 settings 1 and 2) each mixer name picks a memory
variant of the single-layer ``RetrievalModel`` (linear, dpfp, favor, delta, softmax, with
options such as ``dpfp:nu=2``). For ``mqar`` each name is a registered mixer of a small
two-layer language model (``d_model = d_key``, one head, so the memory's key size is d_key as in
the retrieval model). Training follows docs/maths.md 1.8: Adam lr 1e-3, batch 32, evaluation every
100 steps on 20 fresh sequences queried with every key, stop at eval loss <= 1e-3, after 11
evaluations without a new best, or at ``steps``. The reported loss is the last evaluation's.
"""

from __future__ import annotations

import csv
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..models import LanguageModel, LMConfig
from ..models.retrieval import RetrievalModel, retrieval_loss
from ..tasks import mqar_batch, retrieval_batch, retrieval_eval_batch
from ..tasks.mqar import IGNORE

TASKS = ("capacity", "update", "mqar")
# The comparison each task is about: capacity (sum rule vs a larger DPFP feature space), update
# (sum rule vs delta rule), and MQAR across the three kinds of LM mixer.
DEFAULT_MIXERS = {"capacity": "linear,dpfp", "update": "linear,delta", "mqar": "softmax,linear,delta"}
EVAL_EVERY, PATIENCE, TARGET_LOSS, BATCH_SIZE, LR, EVAL_SEQUENCES = 100, 11, 1e-3, 32, 1e-3, 20


@dataclass
class RecallResult:
    task: str
    mixer: str
    size: int
    eval_loss: float
    accuracy: float
    steps: int
    seconds: float
    state_size: int


def mixer_label(name: str, options: dict[str, Any]) -> str:
    return ":".join([name] + [f"{k}={v}" for k, v in options.items()])


def _fit(model: torch.nn.Module, train_loss: Callable[[], torch.Tensor],
         evaluate: Callable[[], tuple[float, float]], max_steps: int,
         report: Callable[[int, float], None]) -> tuple[float, float, int]:
    """docs/maths.md 1.8's loop; returns (last eval loss, last eval accuracy, steps taken)."""
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    best, since_best, loss, acc, step = float("inf"), 0, float("nan"), float("nan"), 0
    while step < max_steps:
        step += 1
        model.train()
        opt.zero_grad(set_to_none=True)
        train_loss().backward()
        opt.step()
        if step % EVAL_EVERY == 0 or step == max_steps:
            model.eval()
            with torch.no_grad():
                loss, acc = evaluate()
            report(step, loss)
            if loss <= TARGET_LOSS or math.isnan(loss):  # solved, or diverged
                break
            if loss < best:
                best, since_best = loss, 0
            else:
                since_best += 1
                if since_best >= PATIENCE:
                    break
    return loss, acc, step


def run_retrieval(setting: str, size: int, name: str, options: dict[str, Any], *, d_key: int,
                  steps: int, seed: int, report: Callable[[int, float], None] = lambda step, loss: None,
                  ) -> RecallResult:
    """Train and evaluate one RetrievalModel on setting ``capacity`` or ``update``."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = RetrievalModel(size, name, d_key=d_key, **options)

    def train_loss() -> torch.Tensor:
        b = retrieval_batch(setting, size, BATCH_SIZE, gen)
        return retrieval_loss(model(b.keys, b.values, b.queries), b.targets, b.mask)

    def evaluate() -> tuple[float, float]:
        b = retrieval_eval_batch(setting, size, gen, EVAL_SEQUENCES)
        y = model(b.keys, b.values, b.queries)
        acc = ((y.argmax(-1) == b.targets) & b.mask).sum() / b.mask.sum()
        return retrieval_loss(y, b.targets, b.mask).item(), acc.item()

    start = time.perf_counter()
    loss, acc, taken = _fit(model, train_loss, evaluate, steps, report)
    L = size if setting == "capacity" else 2 * size
    return RecallResult(setting, mixer_label(name, options), size, loss, acc, taken,
                        time.perf_counter() - start, model.state_size(L))


def run_mqar(size: int, name: str, options: dict[str, Any], *, d_key: int, steps: int, seed: int,
             report: Callable[[int, float], None] = lambda step, loss: None) -> RecallResult:
    """Train and evaluate a two-layer LM with mixer ``name`` on MQAR with ``size`` pairs, every
    key queried once (cross-entropy on the answers)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    vocab = 2 * max(size, 8)
    cfg = LMConfig(vocab_size=vocab, d_model=d_key, n_layers=2, n_heads=1, mixer=name,
                   mixer_options=options, ffn="mlp", ffn_hidden=2 * d_key)
    model = LanguageModel(cfg)

    def batch_loss(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = mqar_batch(size, size, vocab, n, gen)
        logits, _ = model(x)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE), \
            (logits.argmax(-1) == y)[y != IGNORE].float().mean()

    def evaluate() -> tuple[float, float]:
        loss, acc = batch_loss(EVAL_SEQUENCES)
        return loss.item(), acc.item()

    start = time.perf_counter()
    loss, acc, taken = _fit(model, lambda: batch_loss(BATCH_SIZE)[0], evaluate, steps, report)
    state = sum(b.mixer.state_size(4 * size) for b in model.blocks)
    return RecallResult("mqar", mixer_label(name, options), size, loss, acc, taken,
                        time.perf_counter() - start, state)


def write_csv(results: list[RecallResult], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(RecallResult.__dataclass_fields__))
        w.writeheader()
        for r in results:
            w.writerow({**asdict(r), "eval_loss": f"{r.eval_loss:.4g}",
                        "accuracy": f"{r.accuracy:.4f}", "seconds": f"{r.seconds:.1f}"})


def format_table(results: list[RecallResult]) -> str:
    head = f"{'task':<9} {'mixer':<26} {'size':>5} {'eval loss':>10} {'acc':>6} {'steps':>6} {'sec':>6} {'state':>8}"
    rows = [f"{r.task:<9} {r.mixer:<26} {r.size:>5} {r.eval_loss:>10.3g} {r.accuracy:>6.3f} "
            f"{r.steps:>6} {r.seconds:>6.1f} {r.state_size:>8}" for r in results]
    return "\n".join([head, *rows])


def plot(results: list[RecallResult], path: Path, d_key: int) -> bool:
    """Eval loss vs size, one line per mixer, one panel per task, log-y. False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    tasks = list(dict.fromkeys(r.task for r in results))
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        rows = [r for r in results if r.task == task]
        for mixer in dict.fromkeys(r.mixer for r in rows):
            pts = sorted((r.size, max(r.eval_loss, 1e-6)) for r in rows if r.mixer == mixer)
            ax.plot(*zip(*pts), marker="o", label=mixer)
        ax.set_yscale("log")
        ax.set_xlabel("number of keys S" if task != "mqar" else "key-value pairs")
        ax.set_ylabel("final eval loss")
        ax.set_title(f"{task} (d_key = {d_key})")
        ax.axhline(TARGET_LOSS, color="grey", lw=0.5, ls="--")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
