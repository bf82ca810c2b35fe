"""Writing benchmark results: a CSV (every number), a markdown summary and log-log PNG plots."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

from .peers import PEER_COLUMNS, PeerRow
from .runner import Row

__all__ = ["OUTPUT_FILES", "softmax_ratio", "write_csv", "write_markdown", "write_peer_csv",
           "write_plots"]

OUTPUT_FILES = ("results.csv", "results.md", "meta.json", "time_vs_T.png", "memory_vs_T.png",
                "peers.csv")

CSV_COLUMNS = (
    "target", "kind", "pass", "T", "status", "time_s", "tokens_per_s", "peak_mib", "flops",
    "gflops_per_s", "matmul_gflops_per_s", "fraction_of_matmul", "speedup_vs_softmax",
    "repeats", "compile_max_abs_diff", "batch", "d_model", "n_heads", "dtype", "device",
)

_BASELINE = {"mixer": "softmax", "op": "softmax_attention"}


def softmax_ratio(rows: list[Row]) -> dict[int, float]:
    """For each row (by index): softmax time / this time at the same T and pass (the mixers are
    compared with the softmax mixer, the ops with ``softmax_attention``); > 1 means faster."""
    base = {(r.kind, r.pass_name, r.T): r.time_s for r in rows
            if r.target == _BASELINE.get(r.kind) and r.status == "ok"}
    out = {}
    for i, r in enumerate(rows):
        b = base.get((r.kind, r.pass_name, r.T))
        if b is not None and r.status == "ok":
            out[i] = b / r.time_s
    return out


def _fmt(x: float, spec: str) -> str:
    return "" if not math.isfinite(x) else format(x, spec)


def write_csv(path: Path, rows: list[Row], meta: dict[str, Any]) -> None:
    ratios = softmax_ratio(rows)
    peak = meta["matmul_gflops_per_s"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        for i, r in enumerate(rows):
            w.writerow([
                r.target, r.kind, r.pass_name, r.T, r.status, _fmt(r.time_s, ".6g"),
                _fmt(r.tokens_per_s, ".6g"), _fmt(r.peak_bytes / 2**20, ".4g"),
                _fmt(r.flops, ".6g"), _fmt(r.gflops_per_s, ".4g"), f"{peak:.4g}",
                _fmt(r.gflops_per_s / peak, ".4g"), _fmt(ratios.get(i, math.nan), ".4g"),
                r.repeats, _fmt(r.max_abs_diff, ".3g"), meta["batch"], meta["d_model"],
                meta["n_heads"], meta["dtype"], meta["device"],
            ])


def _pivot(rows: list[Row], pass_name: str, value) -> list[str]:
    """A markdown table: one line per target, one column per T; cells from ``value(row)``."""
    sel = [r for r in rows if r.pass_name == pass_name]
    lengths = sorted({r.T for r in sel})
    targets = list(dict.fromkeys(r.target for r in sel))
    cell = {(r.target, r.T): r for r in sel}
    lines = ["| target | " + " | ".join(f"T={T}" for T in lengths) + " |",
             "|---|" + "---:|" * len(lengths)]
    for t in targets:
        cells = []
        for T in lengths:
            r = cell.get((t, T))
            if r is None:
                cells.append("")
            elif r.status != "ok":
                cells.append(r.status.split(":")[0])
            else:
                cells.append(value(r))
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return lines


def write_peer_csv(path: Path, rows: list[PeerRow]) -> None:
    """peers.csv: one line per (comparison, T) of ``bench --peers``."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(PEER_COLUMNS)
        for r in rows:
            w.writerow([r.op, r.peer, r.T, r.status, f"{r.ours_s:.6g}", f"{r.peer_s:.6g}",
                        f"{r.ratio:.4g}", r.repeats])


def write_markdown(path: Path, rows: list[Row], meta: dict[str, Any], method: str,
                   peers: list[str] | None = None) -> None:
    """results.md; ``peers``: the ``--peers`` section's lines, placed after the tables."""
    peak = meta["matmul_gflops_per_s"]
    ratios = softmax_ratio(rows)
    ratio_of = {id(r): ratios.get(i, math.nan) for i, r in enumerate(rows)}
    lines = [
        "# fastweights bench", "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}; machine: {meta['machine']}; torch {meta['torch']}, "
        f"{meta['threads']} threads; device {meta['device']}, dtype {meta['dtype']}",
        f"- batch {meta['batch']}, d_model {meta['d_model']}, {meta['n_heads']} heads; "
        f"repeats {meta['repeats']} (median), time budget {meta['time_budget']} s per config",
        f"- CPU: {meta.get('cpu_model') or 'unknown'}; vector/matrix instruction sets: "
        f"{', '.join(meta.get('cpu_isa') or []) or 'none reported'}",
        f"- measured matrix-multiply rate: **{peak:.1f} GFLOP/s** "
        f"(square {meta['dtype']} matmul, best size n={meta['matmul_n']})",
        "",
    ]
    units = {"decode": "per generated token", "fwd": "per forward pass",
             "fwdbwd": "per forward+backward", "fwd-compiled": "per compiled forward pass"}
    for pass_name in dict.fromkeys(r.pass_name for r in rows):
        lines += [f"## {pass_name}", "", f"Time (ms, {units[pass_name]}), median:", ""]
        lines += _pivot(rows, pass_name, lambda r: f"{r.time_s * 1e3:.3g}")
        lines += ["", "Tokens/s (x speed-up over the softmax baseline):", ""]
        lines += _pivot(rows, pass_name, lambda r: f"{r.tokens_per_s:.3g}" + (
            f" (x{ratio_of[id(r)]:.2g})" if math.isfinite(ratio_of[id(r)]) else ""))
        lines += ["", "Peak memory (MiB above the resident baseline):", ""]
        lines += _pivot(rows, pass_name, lambda r: _fmt(r.peak_bytes / 2**20, ".4g"))
        lines += ["", f"Achieved GFLOP/s of counted matmul FLOPs (% of {peak:.1f}):", ""]
        lines += _pivot(rows, pass_name, lambda r: (
            f"{r.gflops_per_s:.3g} ({100 * r.gflops_per_s / peak:.0f}%)" if r.flops > 0 else "0"))
        if pass_name == "fwd-compiled":
            lines += ["", "max |compiled - eager|:", ""]
            lines += _pivot(rows, pass_name, lambda r: f"{r.max_abs_diff:.2g}")
        lines.append("")
    lines += peers or []
    notes = sorted({(r.target, r.pass_name, r.T, r.status) for r in rows if r.status != "ok"},
                   key=lambda x: (x[0], x[1], x[2]))
    if notes or meta.get("left_out_ops"):
        lines += ["## Not measured", ""]
        lines += [f"- {op}: {why}" for op, why in meta.get("left_out_ops", {}).items()]
        lines += [f"- {t} {p} T={T}: {s}" for t, p, T, s in notes]
        lines.append("")
    lines += ["## Method", "", method.strip(), ""]
    path.write_text("\n".join(lines))


def write_plots(folder: Path, rows: list[Row]) -> list[Path]:
    """time_vs_T.png and memory_vs_T.png (log-log, one line per target, one panel per pass).
    Returns the files written; none when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    passes = list(dict.fromkeys(r.pass_name for r in rows))
    if not passes:  # e.g. --mixers none --peers: nothing to plot
        return written
    for fname, value, label in (
        ("time_vs_T.png", lambda r: r.time_s, "seconds (decode: per token)"),
        ("memory_vs_T.png", lambda r: r.peak_bytes / 2**20, "peak MiB above baseline"),
    ):
        fig, axes = plt.subplots(1, len(passes), figsize=(5.5 * len(passes), 4.5), squeeze=False)
        for ax, pass_name in zip(axes[0], passes):
            sel = [r for r in rows if r.pass_name == pass_name and r.status == "ok"]
            for target in dict.fromkeys(r.target for r in sel):
                pts = [(r.T, value(r)) for r in sel if r.target == target]
                pts = [(t, v) for t, v in pts if math.isfinite(v) and v > 0]
                if pts:
                    kind = next(r.kind for r in sel if r.target == target)
                    ax.plot(*zip(*pts), marker="o", ms=3, ls="-" if kind == "mixer" else "--",
                            label=target)
            ax.set(xscale="log", yscale="log", title=pass_name, xlabel="T", ylabel=label)
            ax.grid(True, which="both", alpha=0.3)
        handles, labels = axes[0][0].get_legend_handles_labels()
        for ax in axes[0][1:]:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                if lab not in labels:
                    handles.append(h)
                    labels.append(lab)
        fig.legend(handles, labels, loc="center right", fontsize=7)
        fig.subplots_adjust(left=0.06, right=0.82, bottom=0.12, top=0.9, wspace=0.3)
        fig.savefig(folder / fname, dpi=90)
        plt.close(fig)
        written.append(folder / fname)
    return written
