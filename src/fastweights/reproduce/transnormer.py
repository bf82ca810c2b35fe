"""``transnormer``: TransNormer's design claims (Qin et al. 2022, docs/maths.md 3), on the bytes of
``stdlib``.

(a) layer order: DiagAttention below and NormAttention above (local then global) against the
    reverse order, all-Norm and all-Diag, at equal parameters;
(b) gradient norms: NormAttention (no denominator, SRMSNorm) against attention-normalised linear
    attention with the same 1+ELU features (the ``linear`` mixer): the gradient norm of the token
    mixers' parameters before clipping, logged at every training step (``metrics.csv``'s
    ``mixer_grad_norm``; ``grad_norm`` is the whole model's), maxima reported;
(c) attention dilution on the trained models: the share of each query's attention mass within
    its r*N nearest positions (the paper's l(i, r, N)), see ``attention_matrices``;
(d) DiagAttention block-size sweep in the local-then-global model (data only: the paper's
    block-size table gives no direction our notes record, so there is no verdict on it).
"""

from __future__ import annotations

import contextlib
import csv
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..models import LanguageModel, LMConfig
from ..train.trainer import METRICS_FILE, evaluate
from . import lm
from .common import (
    Claim,
    Experiment,
    Plan,
    RunSpec,
    bar_plot,
    matplotlib_pyplot,
    mean_spread,
    sweep_plot,
    values,
)
from .registry import register

DEFAULT = {"d_model": 64, "n_layers": 4, "n_heads": 4, "seq_len": 128, "batch_size": 8,
           "steps": 400, "lr": 2e-3, "eval_windows": 64, "block": 32, "blocks": [8, 16, 64],
           "ratios": [0.0625, 0.125, 0.25], "dilution_windows": 8, "grad_norm": "mixers"}
QUICK = {"d_model": 16, "n_layers": 2, "n_heads": 2, "seq_len": 16, "batch_size": 2,
         "steps": 3, "lr": 2e-3, "eval_windows": 3, "block": 4, "blocks": [2, 8],
         "ratios": [0.125, 0.25], "dilution_windows": 2, "grad_norm": "mixers"}
REFERENCE = "diag/norm"
ORDERS = {"diag/norm": ("diag", "norm"), "norm/diag": ("norm", "diag"),
          "all-norm": ("norm", "norm"), "all-diag": ("diag", "diag")}
DILUTION = ("softmax", "linear (attention-normalised)", "all-norm", "diag/norm")


def block_label(w: int) -> str:
    return f"diag/norm w={w}"


def far_metric(r: float) -> str:
    return f"far_share@r={r:g}"


def _layers(lower: str, upper: str, L: int, block: int) -> tuple[list[str], list[dict[str, Any]]]:
    names = [lower] * (L // 2) + [upper] * (L - L // 2)
    return names, [{"block_size": block} if n == "diag" else {} for n in names]


def _models(s: dict[str, Any]) -> dict[str, LMConfig]:
    L = s["n_layers"]
    mixers: dict[str, tuple[Any, Any]] = {
        label: _layers(lo, hi, L, s["block"]) for label, (lo, hi) in ORDERS.items()}
    mixers["linear (attention-normalised)"] = ("linear", {})
    mixers["softmax"] = ("softmax", {})
    for w in s["blocks"]:
        mixers[block_label(w)] = _layers("diag", "norm", L, w)
    configs = {label: LMConfig(vocab_size=256, d_model=s["d_model"], n_layers=L,
                               n_heads=s["n_heads"], mixer=name, mixer_options=opts)
               for label, (name, opts) in mixers.items()}
    return lm.match_parameters(configs, REFERENCE)


def plan(quick: bool, seeds: list[int], data: str) -> Plan:
    return lm.lm_plan(quick, seeds, data, (DEFAULT, QUICK), _models)


# ----------------------------------------------------------------------- attention dilution

@contextlib.contextmanager
def _capture_ops(model: LanguageModel
                 ) -> Iterator[list[tuple[Any, torch.Tensor, torch.Tensor, dict[str, Any]]]]:
    """Record (op, q, k, keyword arguments) of every mixing op the model's layers call inside
    the block, through each layer's ``op_hook`` (``Mixer.op_hook``)."""
    calls: list[tuple[Any, torch.Tensor, torch.Tensor, dict[str, Any]]] = []

    def record(op: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               kw: dict[str, Any]) -> None:
        calls.append((op, q.detach(), k.detach(), kw))

    mixers = [block.mixer for block in model.blocks]
    try:
        for mixer in mixers:
            mixer.op_hook = record
        yield calls
    finally:
        for mixer in mixers:
            mixer.op_hook = None


@torch.no_grad()
def attention_matrices(model: LanguageModel, x: torch.Tensor) -> list[torch.Tensor]:
    """One [B, H, T, T] matrix A per layer (row i: query i, column j: key j) for input ids x [B, T].

    A is what the layer's own op does to the values: the op is rerun on the layer's q and k with
    the identity as values (v_j = e_j), so row i of the output is row i of the mixing matrix,
    with no new mathematics. Softmax and DiagAttention: the softmax (or ReLU) weights;
    attention-normalised linear attention: phi(q_i).phi(k_j) / (phi(q_i).z_i + eps);
    NormAttention: the unnormalised q_i.k_j after LRPE, signed (its dilution uses |A|).
    """
    B, T = x.shape
    with _capture_ops(model) as calls:
        model(x)
    mats = []
    for op, q, k, kw in calls:
        H = q.shape[2]
        eye = torch.eye(q.shape[1], dtype=q.dtype, device=q.device)[None, :, None, :]
        kw = {key: val for key, val in kw.items() if key not in ("initial_state", "output_final_state")}
        out = op(q, k, eye.expand(B, -1, H, -1).contiguous(), **kw)
        out = out[0] if isinstance(out, tuple) else out  # [B, T', H, T'] (T' >= T: Diag's open block)
        mats.append(out[:, -T:, :, -T:].permute(0, 2, 1, 3).float())
    return mats


def far_share(A: torch.Tensor, r: float) -> float:
    """1 - l(i, r, N) averaged over the queries i of the second half of the window (N = T), the
    heads and the batch: the share of |A_ij| (j <= i) that lies further back than the r*N
    nearest positions i - r*N < j <= i. A: [B, H, T, T]."""
    T = A.shape[-1]
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    near = (j <= i) & (i - j < max(1, round(r * T)))
    mass = A.abs() * (j <= i)
    share = (mass * near).sum(-1) / mass.sum(-1).clamp_min(torch.finfo(mass.dtype).tiny)
    return float(1.0 - share[..., T // 2:].mean())


# ------------------------------------------------------------------------------- the runs


def _grad_norms(workdir: Path, column: str = "grad_norm") -> list[float]:
    with open(workdir / METRICS_FILE, newline="") as f:
        return [float(r[column]) for r in csv.DictReader(f)
                if r["split"] == "train" and r.get(column)]


def _metric_names(s: dict[str, Any]) -> list[str]:
    return ["loss", "ppl", "grad_norm_max", "grad_norm_mean", "mixer_grad_norm_max",
            "mixer_grad_norm_mean", *map(far_metric, s["ratios"])]


def execute(spec: RunSpec, p: Plan, workdir: Path) -> dict[str, Any]:
    s = p.settings
    config = LMConfig.from_dict(spec.options["config"])
    corpus = lm.corpus(s["data"])
    model = lm.train_run(workdir, config, lm.train_config(s, spec.seed), corpus)
    if model is None:
        return lm.diverged(config, s, _metric_names(s))
    loss = evaluate(model, corpus.val, s["seq_len"], s["eval_windows"])
    norms = _grad_norms(workdir)
    T, n = s["seq_len"], s["dilution_windows"]
    x = corpus.val[:n * T].long().view(n, T)
    mats = attention_matrices(model, x)
    mixer = _grad_norms(workdir, "mixer_grad_norm")  # the token mixers' gradients only
    metrics = {"loss": loss, "ppl": lm.perplexity(loss), "grad_norm_max": max(norms),
               "grad_norm_mean": sum(norms) / len(norms),
               "mixer_grad_norm_max": max(mixer), "mixer_grad_norm_mean": sum(mixer) / len(mixer)}
    metrics.update({far_metric(r): sum(far_share(A, r) for A in mats) / len(mats) for r in s["ratios"]})
    return {"parameters": model.num_parameters(), "steps": s["steps"], "tokens": lm.tokens(s),
            "metrics": metrics}


def claims(p: Plan) -> list[Claim]:
    s = p.settings
    loss = "loss"
    order = ("Qin et al. 2022, the layer-order ablations (Tables 8-9): the lower layers should "
             "attend locally (DiagAttention), the upper ones globally (NormAttention)")
    out = [Claim(f"(a) diag/norm < {other}", order, (REFERENCE, loss), (other, loss))
           for other in ("norm/diag", "all-norm")]
    out.append(Claim("(b) NormAttention's gradient norm max < linear attention's",
                     "Qin et al. 2022, §3 (unbounded gradients) and its proof: the gradients of "
                     "attention-normalised linear attention are unbounded, NormAttention's are "
                     "bounded", ("all-norm", "mixer_grad_norm_max"),
                     ("linear (attention-normalised)", "mixer_grad_norm_max"),
                     unmeasured=("" if s.get("grad_norm") == "mixers" else
                                 "this record has the whole model's gradient norm only, not the "
                                 "attention layers'")))
    r = far_metric(s["ratios"][len(s["ratios"]) // 2])
    out.append(Claim(f"(c) dilution: softmax [{r}] < linear attention",
                     "Qin et al. 2022, §3 (attention dilution) and its locality figure l(i, r, N): "
                     "linear attention spreads its weight over distant tokens, where vanilla "
                     "softmax attention concentrates on neighbours",
                     ("softmax", r), ("linear (attention-normalised)", r)))
    out += [
        Claim(f"(a) reference: diag/norm vs all-diag (no global layer) [{loss}]", "control: not a "
              "comparison our notes of the paper's tables make", (REFERENCE, loss), ("all-diag", loss),
              control=True),
        Claim(f"(c) NormAttention alone: all-norm [{r}] < linear attention", "control: the "
              "diag/norm model's low far share is partly built in (its Diag layers have no mass "
              "beyond their block); all-Norm has no Diag layer", ("all-norm", r),
              ("linear (attention-normalised)", r), control=True),
    ]
    return out


def metrics(p: Plan) -> list[str]:
    return _metric_names(p.settings)


def plots(rows: list[dict[str, Any]], out: Path, p: Plan) -> list[str]:
    s = p.settings
    written = []
    order = [r for r in rows if r["model"] in (*ORDERS, "linear (attention-normalised)", "softmax")]
    if bar_plot(out / "layer_order.png", order, "loss", "validation loss (nats/byte)",
                "transnormer: layer order (and references)"):
        written.append("layer_order.png")
    plt = matplotlib_pyplot()
    if plt is None:
        return written
    # (b) the gradient norm of every step, seed 0 of both models, from the runs' metrics.csv
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for model in ("all-norm", "linear (attention-normalised)"):
        for r in rows:
            path = out / "runs" / RunSpec(model, r["seed"]).key
            if r["model"] == model and (path / METRICS_FILE).is_file():
                norms = _grad_norms(path, "mixer_grad_norm") or _grad_norms(path)
                ax.plot(norms, lw=0.8, label=f"{model}, seed {r['seed']}")
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("mixers' gradient norm before clipping")
    ax.set_title("NormAttention vs attention-normalised linear attention", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "grad_norms.png", dpi=110)
    plt.close(fig)
    written.append("grad_norms.png")
    # (c) far share vs r
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for model in DILUTION:
        means = [mean_spread(values(rows, model, far_metric(r)))[0] for r in s["ratios"]]
        ax.plot(s["ratios"], means, marker="o", label=model)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("r (neighbourhood r*N, N = training window)")
    ax.set_ylabel("attention mass beyond r*N (1 - l)")
    ax.set_title("attention dilution on the trained models", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "dilution.png", dpi=110)
    plt.close(fig)
    written.append("dilution.png")
    # (d) block sweep
    points = {w: REFERENCE if w == s["block"] else block_label(w) for w in [s["block"], *s["blocks"]]}
    if sweep_plot(out / "block_sweep.png", rows, points, "loss", xlabel="DiagAttention block size w",
                  ylabel="validation loss (nats/byte)", title="diag/norm: block-size sweep"):
        written.append("block_sweep.png")
    return written


def notes(p: Plan, rows: list[dict[str, Any]]) -> list[str]:
    s = p.settings
    return [
        lm.setup_note(s, rows, REFERENCE),
        (f"TransNormer layers: the library's T2 defaults (NormAttention with 1+ELU and LRPE, "
         f"DiagAttention with softmax and block-local LRPE, block w = {s['block']} unless swept); "
         f"the lower half of the {s['n_layers']} layers is the first name of `lower/upper`. The "
         "LM's feed-forward is the library's block, not TransNormer's GLU."),
        ("(b) mixer_grad_norm is the gradient norm of the token mixers' parameters (every "
         "layer's attention) before clipping (clip 1.0), from every training step; grad_norm is "
         "the whole model's, which the first record used; the attention-normalised model is the "
         "`linear` mixer (phi = ELU+1, o = phi(q)S / (phi(q).z + eps), no LRPE), every layer."),
        (f"(c) The mixing matrix of each layer is read by rerunning the layer's own op on its q, k "
         f"with identity values; far_share@r = 1 - l(i, r, N) = the share of |A_ij| (j <= i) "
         f"further back than r*N positions (N = {s['seq_len']}), averaged over the queries of the "
         f"second half of the window, the heads, the layers and {s['dilution_windows']} "
         "validation windows. Linear attention: the normalised phi(q).phi(k) weights; "
         "NormAttention: |q.k| (it has no normaliser; the absolute value makes it a mass); "
         "Diag layers: their (local) softmax weights."),
        ("The paper's numbers are WikiText-103 perplexities (T1/T2 ~ softmax) and LRA; ours are "
         "directions at toy scale."),
    ]


EXPERIMENT = Experiment(
    "transnormer", "transnormer: layer order, gradient norms, attention dilution, block size",
    "TransNormer's design claims (Qin et al. 2022; docs/maths.md 3): local-then-global layer "
    "order, bounded gradients of NormAttention, attention dilution of linear attention, block "
    "size.",
    plan, execute, claims, metrics, plots, notes)
register(EXPERIMENT)
