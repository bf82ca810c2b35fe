"""``long-context``: does the loss keep falling with more context? (the TTT paper's per-position
figure, Sun et al. 2024, docs/maths.md 2.9), on the bytes of ``stdlib``.

Every recurrent model is trained with its state carried across windows of ``seq_len`` bytes
(``TrainConfig.carry_state``, truncated backpropagation through time: every batch row reads a
segment of ``train.batches.STREAM_WINDOWS`` consecutive windows from a random offset, then jumps
to a new one, so it sees contexts of up to that many windows with the data diversity of window
training); softmax attention, whose cache cannot be carried, is trained on independent windows.
Each model then reads ``streams`` held-out streams of ``factor * seq_len`` bytes, each inside
one validation file and spread over every file (``lm.stream_starts``), in pieces of ``seq_len``
with its state carried (softmax: its key/value cache grows and RoPE positions continue past the
training window). The loss at each
position is averaged over the streams and over log-spaced position buckets [1, 2), [2, 4), ...
The built-in control: each position range [T, 2T), [2T, 4T), ... beyond the training window is
also scored after the first ``lo`` bytes of an unrelated stream (from another validation
file), from a fresh state, and window by window each from a fresh state (the truncated reading;
``control_losses``). A loss that falls with position may come from any warmed-up state; "uses
its own context" is the own prefix beating the unrelated one. The truncation control
(``RESET``): the delta and the sum-rule models again, trained on the same stream segments in the
same order with the state reset at every window (``train --reset-state``), so that the fast
weight paper's Table 4 compares models that differ only in the truncation.
Claims, each on the same bytes: more context lowers TTT-Linear/MLP's loss (own prefix < fresh
state; the TTT paper); TTT, DeltaNet and Infini use their own context (own < unrelated); the
sum-rule linear transformer collapses on long streams (own > fresh by 10 %); Table 4 against the
truncation control: without truncation the delta model improves and the sum-rule model collapses
(carried own < reset window by window; > by 10 %). Controls: softmax degrades past its window; a
warmed-up state against a fresh one; the first record's "loss falls with position", which
compares different bytes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ..models import LMConfig
from ..train.batches import STREAM_WINDOWS
from . import lm
from .common import Claim, Experiment, Plan, RunSpec, matplotlib_pyplot, mean_spread, values
from .registry import register

DEFAULT = {"d_model": 64, "n_layers": 2, "n_heads": 4, "seq_len": 128, "batch_size": 8,
           "steps": 400, "lr": 2e-3, "factor": 16, "streams": 128, "trained_bar": "bigram",
           "carry_state": "all but softmax", "control": "own / unrelated (another file) / fresh prefix"}
QUICK = {"d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 16, "batch_size": 2,
         "steps": 3, "lr": 2e-3, "factor": 8, "streams": 2, "trained_bar": None,
         "carry_state": "all but softmax", "control": "own / unrelated (another file) / fresh prefix"}
FWP, TTT = "000-fast-weight-programmers.txt", "001-ttt.txt"  # the seed notes on the papers
WINDOWED = ("softmax",)  # trained on independent windows; every other model with carry_state
# the truncation control: carry_state's segments in the same order, the state reset every window
RESET = {"linear, reset": "linear", "delta, reset": "delta"}
RECURRENT = ("delta", "ttt-linear", "ttt-mlp", "infini", "diag/norm")


def _models(s: dict[str, Any]) -> dict[str, LMConfig]:
    local = max(1, s["seq_len"] // 2)  # Infini's segment and Diag's block: inside one window
    mixers: dict[str, tuple[Any, Any]] = {
        "softmax": ("softmax", {}), "linear": ("linear", {}), "delta": ("delta", {}),
        "ttt-linear": ("ttt-linear", {}), "ttt-mlp": ("ttt-mlp", {}),
        "infini": ("infini", {"segment_len": local}),
        # TransNormer's schedule: DiagAttention below, NormAttention above
        "diag/norm": ([*["diag"] * (s["n_layers"] // 2), *["norm"] * (s["n_layers"] - s["n_layers"] // 2)],
                      [*[{"block_size": local}] * (s["n_layers"] // 2),
                       *[{}] * (s["n_layers"] - s["n_layers"] // 2)]),
    }
    mixers.update({label: mixers[base] for label, base in RESET.items()})
    configs = {label: LMConfig(vocab_size=256, d_model=s["d_model"], n_layers=s["n_layers"],
                               n_heads=s["n_heads"], mixer=name, mixer_options=opts)
               for label, (name, opts) in mixers.items()}
    return lm.match_parameters(configs, "softmax")


def plan(quick: bool, seeds: list[int], data: str) -> Plan:
    return lm.lm_plan(quick, seeds, data, (DEFAULT, QUICK), _models,
                      carried=lambda label: label not in WINDOWED, reset=lambda label: label in RESET)


def _window_bucket(s: dict[str, Any]) -> str:
    """The last bucket inside the training window (ending at position seq_len or before)."""
    T = s["seq_len"]
    return lm.bucket_name(*[b for b in lm.log_buckets(T * s["factor"]) if b[1] <= T + 1][-1])


def _far_bucket(s: dict[str, Any]) -> str:
    return lm.bucket_name(*lm.log_buckets(s["seq_len"] * s["factor"])[-1])


CONDITIONS = ("own", "unrelated", "fresh", "window")


def control_ranges(s: dict[str, Any]) -> list[tuple[int, int]]:
    """The position ranges [lo, hi) (0-based inputs) scored under the three prefixes: doubling
    from the training length, [T, 2T), [2T, 4T), ..., up to the stream length."""
    T, length = s["seq_len"], s["seq_len"] * s["factor"]
    out, lo = [], T
    while lo < length:
        out.append((lo, min(length, 2 * lo)))
        lo *= 2
    return out


def control_metric(condition: str, lo: int, hi: int) -> str:
    return f"{condition}@{lo}-{hi - 1}"


def unrelated_shift(files: list[int]) -> int:
    """The shift r (mod n) such that stream i reads the prefix of stream i - r: the one closest
    to n / 2 for which every stream's unrelated prefix comes from another file, else (a corpus
    with too few files) the one with the fewest same-file pairs."""
    n = len(files)
    shifts = sorted(range(1, n), key=lambda r: abs(r - n / 2)) or [0]
    return min(shifts, key=lambda r: sum(files[i] == files[(i - r) % n] for i in range(n)))


def control_losses(model: Any, x: torch.Tensor, files: list[int], s: dict[str, Any],
                   per_stream: dict[str, list[float]] | None = None) -> dict[str, float]:
    """The built-in control on the streams ``x`` [S, L + 1] (stream i in validation file
    ``files[i]``): the loss at each of ``control_ranges`` read after the stream's own first
    ``lo`` bytes (``own``), after the first ``lo`` bytes of an unrelated stream from another file
    (``unrelated_shift``; ``unrelated``), from a fresh state (``fresh``), and window by window of
    ``seq_len``, each from a fresh state (``window``: the truncated reading). ``own <
    unrelated`` says the model uses its own context; ``unrelated < fresh`` only that a warmed-up
    state helps. Also ``unrelated_same_file``: the share of streams whose unrelated prefix had to
    come from their own file (0 unless the corpus has too few files). ``per_stream``, when
    given, receives each condition's per-stream losses at the last range (metric -> [S])."""
    T = s["seq_len"]
    shift = unrelated_shift(files)
    other = x.roll(shift, dims=0)  # stream i reads the prefix of stream i - shift (mod n)
    n = len(files)
    out = {"unrelated_same_file": sum(files[i] == files[(i - shift) % n] for i in range(n)) / n}
    ranges = control_ranges(s)
    for lo, hi in ranges:
        got = {"own": lm.range_loss(model, x, x[:, :lo], lo, hi, T, per_stream=True),
               "unrelated": lm.range_loss(model, x, other[:, :lo], lo, hi, T, per_stream=True),
               "fresh": lm.range_loss(model, x, None, lo, hi, T, per_stream=True),
               "window": sum(lm.range_loss(model, x, None, a, min(hi, a + T), T, per_stream=True)
                             * (min(hi, a + T) - a) for a in range(lo, hi, T)) / (hi - lo)}
        for c in CONDITIONS:
            out[control_metric(c, lo, hi)] = float(got[c].mean())
            if per_stream is not None and (lo, hi) == ranges[-1]:
                per_stream[control_metric(c, lo, hi)] = got[c].tolist()
    return out


def execute(spec: RunSpec, p: Plan, workdir: Path) -> dict[str, Any]:
    s = p.settings
    corpus = lm.corpus(s["data"])
    config = LMConfig.from_dict(spec.options["config"])
    tcfg = lm.train_config(s, spec.seed, carry_state=spec.options.get("carry_state", False),
                           reset_state=spec.options.get("reset_state", False))
    model = lm.train_run(workdir, config, tcfg, corpus)
    T, length = s["seq_len"], s["seq_len"] * s["factor"]
    if model is None:
        names = [lm.bucket_name(lo, hi) for lo, hi in lm.log_buckets(length)]
        controls = [f"{c}@{lo}-{hi - 1}" for lo, hi in control_ranges(s) for c in CONDITIONS]
        return lm.diverged(config, s, ["loss_window", "loss_beyond", *names, *controls])
    starts = lm.stream_starts(corpus, length, s["streams"])
    x = lm.stream_batch(model, corpus.val, starts, length)
    per_pos = lm.position_losses(model, x, piece=T)
    window = float(per_pos[:T].mean())
    per_stream = {"loss_window": lm.range_loss(model, x, None, 0, T, T, per_stream=True).tolist()}
    metrics = {"loss_window": window, "loss_beyond": float(per_pos[T:].mean()),
               **lm.bucket_losses(per_pos),
               **control_losses(model, x, lm.file_of(corpus, starts), s, per_stream),
               **lm.trained_metrics(window, lm.bar(s, corpus, starts, T))}
    return {"parameters": model.num_parameters(), "steps": s["steps"], "tokens": lm.tokens(s),
            "metrics": metrics, "windows": per_stream}


TTT_FIGURE = ("Sun et al. 2024, Figure 2 (right) / §3 (Books, 32k context): TTT-Linear and "
              "TTT-MLP keep lowering the loss as they condition on more tokens, where Mamba "
              "plateaus after 16k")
TTT_SOURCE = (f"docs/maths.md 2.9 [unverified]: the seed note {TTT} (experiments, Books) records only "
              "that TTT beats Mamba at 32k and that its advantage grows with the context")
USES_CONTEXT = {
    "ttt-linear": (TTT_FIGURE + " [implied: the fall comes from the stream's own context]", TTT_SOURCE),
    "ttt-mlp": (TTT_FIGURE + " [implied: the fall comes from the stream's own context]", TTT_SOURCE),
    "delta": ("Schlag et al. 2021, §6.3, Table 4: trained and evaluated without truncating the "
              "context, the delta net improves slightly on its truncated version [implied: it "
              "uses context beyond the window]", f"[unverified]: implied, not stated; the seed note "
              f"{FWP}, §6.3 long sequences (Table 4), states only that the delta net improves "
              "slightly without truncation"),
    "infini": ("Munkhdalai et al. 2024, §4.1, Table 2 (PG19, Arxiv-math): the compressive memory "
               "carries the earlier segments' context and lowers perplexity [implied]",
               "docs/maths.md 5.6 [unverified]: the seed note 004-infini-attention.txt has no experiments"),
}


def claims(p: Plan) -> list[Claim]:
    s = p.settings
    win, far = _window_bucket(s), _far_bucket(s)
    lo, hi = control_ranges(s)[-1]
    own, unrelated, fresh, window = (control_metric(c, lo, hi) for c in CONDITIONS)
    at = f"{lo}-{hi - 1}"
    out = [Claim(f"{m}: more context lowers the loss on the same bytes: own prefix < fresh state "
                 f"at {at}", TTT_FIGURE, (m, own), (m, fresh), source=TTT_SOURCE)
           for m in ("ttt-linear", "ttt-mlp")]
    out += [Claim(f"{m} uses its own context: own prefix < unrelated prefix at {at}", paper,
                  (m, own), (m, unrelated), source=source)
            for m, (paper, source) in USES_CONTEXT.items()]
    out.append(Claim(f"linear (sum rule) collapses on long streams: own prefix > fresh state at "
                     f"{at} by more than 10 %",
                     "Schlag et al. 2021, §6.3, Table 4: without truncation the linear "
                     "Transformer (sum rule) collapses", ("linear", own), ("linear", fresh),
                     "degrades", margin=0.1, source=f"{FWP}, §6.3 long sequences (Table 4)"))
    out.append(Claim(f"delta: no truncation < truncated on the same segments: own prefix < the "
                     f"reset model's windows at {at}",
                     "Schlag et al. 2021, §6.3, Table 4: trained and evaluated without truncating "
                     "the context, the delta net improves slightly on its truncated version (here "
                     "against the truncation control: the same segments, the state reset at every "
                     "window, read window by window)", ("delta", own), ("delta, reset", window),
                     source=f"{FWP}, §6.3 long sequences (Table 4)"))
    out.append(Claim(f"linear (sum rule): no truncation collapses against truncation on the same "
                     f"segments: own prefix > the reset model's windows at {at} by more than 10 %",
                     "Schlag et al. 2021, §6.3, Table 4: without truncation the linear Transformer "
                     "(sum rule) collapses", ("linear", own), ("linear, reset", window), "degrades",
                     margin=0.1, source=f"{FWP}, §6.3 long sequences (Table 4)"))
    controls = [Claim(f"softmax degrades beyond its training window: own prefix > fresh state at {at}",
                      "control: its cache grows past the window it trained on (RoPE positions "
                      "never seen)", ("softmax", own), ("softmax", fresh), "degrades", control=True)]
    controls += [Claim(f"{m}: any warmed-up state helps: unrelated prefix < fresh state at {at}",
                       "control: what a falling loss may come from instead of the stream's own "
                       "context", (m, unrelated), (m, fresh), control=True)
                 for m in RECURRENT if m != "diag/norm"]
    controls += [Claim(f"{m}: loss falls with position ({far} < {win}; different bytes)",
                       "control, the first record's reading: it compares different bytes of the "
                       "streams, so it mixes context with how hard the text is (the fresh-state "
                       "loss falls too)", (m, far), (m, win), control=True)
                 for m in RECURRENT]
    return out + controls


def metrics(p: Plan) -> list[str]:
    s = p.settings
    lo, hi = control_ranges(s)[-1]
    return ["loss_window", "loss_beyond", _window_bucket(s), _far_bucket(s),
            *(control_metric(c, lo, hi) for c in CONDITIONS), "trained"]


def plots(rows: list[dict[str, Any]], out: Path, p: Plan) -> list[str]:
    plt = matplotlib_pyplot()
    if plt is None:
        return []
    s = p.settings
    buckets = lm.log_buckets(s["seq_len"] * s["factor"])
    centers = [math.sqrt(lo * (hi - 1)) for lo, hi in buckets]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for model in dict.fromkeys(r["model"] for r in rows):
        means = [mean_spread(values(rows, model, lm.bucket_name(lo, hi)))[0] for lo, hi in buckets]
        ax.plot(centers, means, marker="o", ms=3, label=model,
                ls="--" if model in ("softmax", "linear") else "-")
    ax.axvline(s["seq_len"], color="grey", lw=0.8, ls=":")
    ax.text(s["seq_len"], ax.get_ylim()[1], " training length", va="top", fontsize=8, color="grey")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("position in the stream (log-spaced buckets)")
    ax.set_ylabel("loss (nats/byte), mean over streams")
    ax.set_title("loss vs position, state carried", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "loss_vs_position.png", dpi=110)
    plt.close(fig)
    return ["loss_vs_position.png"]


def _control_table(s: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """Own / unrelated / fresh / window by window per model and range, mean over seeds, with own
    - unrelated per seed (a record without the window-by-window reading shows n/a for it)."""
    ranges = control_ranges(s)
    head = "| model | " + " | ".join(f"{lo}-{hi - 1}: {' / '.join(CONDITIONS)}" for lo, hi in ranges)
    lines = [head + " | own - unrelated at the last range, per seed |",
             "|---|" + "---|" * (len(ranges) + 1)]
    for model in dict.fromkeys(r["model"] for r in rows):
        cells = []
        for lo, hi in ranges:
            got = [mean_spread(values(rows, model, control_metric(c, lo, hi)))[0] for c in CONDITIONS]
            cells.append(" / ".join("n/a" if not math.isfinite(g) else f"{g:.3f}" for g in got))
        lo, hi = ranges[-1]
        per_seed = [f"s{r['seed']} {r['metrics'][control_metric('own', lo, hi)] - r['metrics'][control_metric('unrelated', lo, hi)]:+.4f}"
                    for r in rows if r["model"] == model and control_metric("own", lo, hi) in r["metrics"]]
        lines.append(f"| {model} | " + " | ".join(cells) + f" | {', '.join(per_seed) or 'n/a'} |")
    return "The control, loss (nats/byte) by range, mean over seeds:\n\n" + "\n".join(lines)


def notes(p: Plan, rows: list[dict[str, Any]]) -> list[str]:
    s = p.settings
    length = s["factor"] * s["seq_len"]
    same = [r["metrics"].get("unrelated_same_file", 0.0) for r in rows]
    return [
        lm.setup_note(s, rows, "softmax"),
        ("Training: every model but softmax trains with its state carried across windows of "
         f"{s['seq_len']} bytes (`train --carry-state`): every batch row reads a segment of "
         f"{STREAM_WINDOWS} consecutive windows ({STREAM_WINDOWS * s['seq_len']} bytes) from its "
         "own random offset of the training split, then jumps to a new random offset with a "
         "fresh state; the state is detached at every window boundary. So it has seen contexts "
         "of up to the evaluation length, with the data diversity of window training (the first "
         "records read one contiguous region of 51-64 KB per row, and their TTT models did not "
         "train). Softmax trains on independent windows (its cache cannot be carried). The "
         f"truncation control, {', '.join(f'`{r}`' for r in RESET)}: the same models, seeds and "
         "segments in the same order (`train --carry-state --reset-state`) with the state reset "
         "at every window, read window by window (`window@a-b`) for Table 4's comparison: "
         "truncation is then the only difference."),
        (f"Evaluation: {s['streams']} streams of {s['factor']} x {s['seq_len']} = {length} bytes, "
         "each inside one validation file, spread over every file that holds one "
         "(`lm.stream_starts`), read in pieces of "
         f"{s['seq_len']} with the state carried; `loss@a-b` is the mean loss at positions a..b "
         "(1-based), `loss_window` over the training length, `loss_beyond` after it."),
        ("Softmax is evaluated beyond its window too (growing cache, RoPE positions it never saw "
        "in training; dashed in the plot, as the sum-rule `linear`): a control, it cannot use "
        "that context. Infini's segment and Diag's block are half the training length."),
        ("The control (`own@a-b`, `unrelated@a-b`, `fresh@a-b`, `window@a-b`, positions a..b 0-based inputs): "
         "the same bytes a..b of every stream scored after reading the stream's own bytes 0..a-1 "
         "(= the ordinary reading), after bytes 0..a-1 of another stream from another validation "
         "file (`long_context.unrelated_shift`; share of streams whose unrelated prefix had to "
         f"come from their own file: {max(same, default=0.0):.0%}), from a fresh state, and "
         f"in windows of {s['seq_len']} each from a fresh state (the truncated reading). A "
         "model that uses its context has own < unrelated; unrelated < fresh only says that any "
         "warmed-up state helps."),
        lm.trained_note(s, rows, "`loss_window` (the streams' first window)"),
        _control_table(s, rows),
        ("The paper's figure is at 125M-1.3B parameters and up to 32k tokens; ours is a "
        "direction check at toy scale."),
    ]


EXPERIMENT = Experiment(
    "long-context", "long-context: loss vs position with the state carried",
    "Train at one context length, evaluate the per-position loss far beyond it with the state "
    "carried (TTT paper's long-context figure; docs/maths.md 2.9).",
    plan, execute, claims, metrics, plots, notes, untrained=lm.UNTRAINED)
register(EXPERIMENT)
