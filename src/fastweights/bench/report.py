"""The suite's record (written by bench/record.py): its CSV rows (every number), the markdown
summary and log-log PNG plots."""

from __future__ import annotations

import io
import math
from typing import Any

from .peers import PEER_COLUMNS, PeerRow
from .record import Table, machine_line
from .runner import Row

__all__ = ["EXTRA_FILES", "csv_rows", "markdown", "matmul_rate", "peer_rows_table", "plots",
           "softmax_ratio", "width_table"]

# The suite's files besides every record's (bench/record.py RECORD_FILES).
EXTRA_FILES = ("time_vs_T.png", "memory_vs_T.png", "peers.csv")

CSV_COLUMNS = (
    "target", "kind", "pass", "T", "threads", "status", "time_s", "time_min_s", "time_max_s",
    "tokens_per_s", "peak_mib", "flops", "gflops_per_s", "matmul_gflops_per_s",
    "fraction_of_matmul", "speedup_vs_softmax", "speedup_vs_first_threads", "speedup_min",
    "speedup_max", "repeats", "compile_max_abs_diff", "batch", "d_model", "n_heads", "dtype",
    "device",
)

_BASELINE = {"mixer": "softmax", "op": "softmax_attention"}


def matmul_rate(meta: dict[str, Any], threads: int) -> float:
    """The square-matmul GFLOP/s measured at ``threads`` (the run's single rate for records
    written before rates were kept per thread count)."""
    by_count = meta.get("matmul_by_threads") or {}
    entry = by_count.get(str(threads))
    return entry["gflops_per_s"] if entry else meta["matmul_gflops_per_s"]


def softmax_ratio(rows: list[Row]) -> dict[int, float]:
    """For each row (by index): softmax time / this time at the same T, pass and thread count
    (the mixers are compared with the softmax mixer, the ops with ``softmax_attention``); > 1
    means faster."""
    base = {(r.kind, r.pass_name, r.T, r.threads): r.time_s for r in rows
            if r.target == _BASELINE.get(r.kind) and r.status == "ok"}
    out = {}
    for i, r in enumerate(rows):
        b = base.get((r.kind, r.pass_name, r.T, r.threads))
        if b is not None and r.status == "ok":
            out[i] = b / r.time_s
    return out


def _fmt(x: float, spec: str) -> str:
    return "" if not math.isfinite(x) else format(x, spec)


def csv_rows(rows: list[Row], meta: dict[str, Any]) -> Table:
    """results.csv: one line per (target, pass, T, thread count), ``CSV_COLUMNS``."""
    ratios = softmax_ratio(rows)
    lines = []
    for i, r in enumerate(rows):
        peak = matmul_rate(meta, r.threads)
        lines.append(dict(zip(CSV_COLUMNS, [
            r.target, r.kind, r.pass_name, r.T, r.threads, r.status, _fmt(r.time_s, ".6g"),
            _fmt(r.time_min_s, ".6g"), _fmt(r.time_max_s, ".6g"),
            _fmt(r.tokens_per_s, ".6g"), _fmt(r.peak_bytes / 2**20, ".4g"),
            _fmt(r.flops, ".6g"), _fmt(r.gflops_per_s, ".4g"), f"{peak:.4g}",
            _fmt(r.gflops_per_s / peak, ".4g"), _fmt(ratios.get(i, math.nan), ".4g"),
            _fmt(r.speedup, ".4g"), _fmt(r.speedup_min, ".4g"), _fmt(r.speedup_max, ".4g"),
            r.repeats, _fmt(r.max_abs_diff, ".3g"), meta["batch"], meta["d_model"],
            meta["n_heads"], meta["dtype"], meta["device"],
        ])))
    return Table(lines, CSV_COLUMNS)


def _pivot(rows: list[Row], pass_name: str, value) -> list[str]:
    """A markdown table: one line per target (and thread count, where the run has several), one
    column per T; cells from ``value(row)``."""
    sel = [r for r in rows if r.pass_name == pass_name]
    lengths = sorted({r.T for r in sel})
    several = len({r.threads for r in sel}) > 1
    targets = list(dict.fromkeys((r.target, r.threads) for r in sel))
    cell = {(r.target, r.threads, r.T): r for r in sel}
    lines = ["| target | " + ("threads | " if several else "")
             + " | ".join(f"T={T}" for T in lengths) + " |",
             "|---|" + ("---:|" if several else "") + "---:|" * len(lengths)]
    for t, n in targets:
        cells = [str(n)] if several else []
        for T in lengths:
            r = cell.get((t, n, T))
            if r is None:
                cells.append("")
            elif r.status != "ok":
                cells.append(r.status.split(":")[0])
            else:
                cells.append(value(r))
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    return lines


def _scaling(rows: list[Row], pass_name: str) -> list[str]:
    """The thread-scaling table of one pass: per (target, T, thread count) the median time, the
    rounds' min-max, and the speed-up over the first count (median and min-max of the per-round
    ratios)."""
    lines = ["| target | T | threads | median (ms) | min-max (ms) | speed-up | speed-up min-max |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.pass_name != pass_name or r.status != "ok":
            continue
        lines.append(f"| {r.target} | {r.T} | {r.threads} | {r.time_s * 1e3:.4g} | "
                     f"{r.time_min_s * 1e3:.4g}-{r.time_max_s * 1e3:.4g} | {r.speedup:.2f}x | "
                     f"{r.speedup_min:.2f}-{r.speedup_max:.2f} |")
    return lines


def width_table(widths: dict[str, dict[str, dict[str, Any]]], setting: Any) -> list[str]:
    """The results.md section on the sequential scans' parallel width: per target and T, its
    sequential steps and the independent work items in each (``targets.scan_width``)."""
    if not widths:
        return []
    lines = ["## Parallel width of the sequential scans", "",
             f"At batch {setting.batch}, {setting.n_heads} heads, head dim {setting.head_dim}: "
             "each sequential step of a scan runs `items` independent work items; a machine "
             "with more cores than that idles during the scan unless the BLAS call of one item "
             "splits it further (the parts outside the scan are batched over all chunks or "
             "mini-batches). Targets not listed have no sequential scan.", "",
             "| target | T | sequential steps | items per step | one item |",
             "|---|---:|---:|---:|---|"]
    for name, by_T in widths.items():
        for T, w in by_T.items():
            lines.append(f"| {name} | {T} | {w['steps']} | {w['items']} | {w['item']} |")
    return [*lines, ""]


def peer_rows_table(rows: list[PeerRow]) -> Table:
    """peers.csv: one line per (comparison, T) of ``bench --peers``."""
    return Table([dict(zip(PEER_COLUMNS, [r.op, r.peer, r.T, r.threads, r.status,
                                          f"{r.ours_s:.6g}", f"{r.peer_s:.6g}",
                                          f"{r.ratio:.4g}", r.repeats])) for r in rows],
                 PEER_COLUMNS)


def markdown(rows: list[Row], meta: dict[str, Any], method: str,
             peers: list[str] | None = None) -> list[str]:
    """results.md's lines; ``peers``: the ``--peers`` section's lines, after the tables."""
    counts = meta["threads"] if isinstance(meta["threads"], list) else [meta["threads"]]
    ratios = softmax_ratio(rows)
    ratio_of = {id(r): ratios.get(i, math.nan) for i, r in enumerate(rows)}
    rates = ", ".join(f"**{matmul_rate(meta, n):.1f} GFLOP/s** at {n} thread{'s' * (n > 1)}"
                      for n in counts)
    threads = (f"{counts[0]} threads" if len(counts) == 1 else
               f"threads {', '.join(map(str, counts))} interleaved round by round")
    lines = [
        "# fastweights bench", "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}; {threads}; device {meta['device']}, dtype {meta['dtype']}",
        f"- machine: {machine_line(meta['machine'])}",
        f"- batch {meta['batch']}, d_model {meta['d_model']}, {meta['n_heads']} heads; "
        f"repeats {meta['repeats']} (median), time budget {meta['time_budget']} s per config",
        f"- measured matrix-multiply rate: {rates} "
        f"(square {meta['matmul_dtype'].removeprefix('torch.')} matmul, best size "
        f"n={meta['matmul_n']})",
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
        lines += ["", "Achieved GFLOP/s of counted matmul FLOPs (% of the matmul rate at the "
                  "same thread count):", ""]
        lines += _pivot(rows, pass_name, lambda r: (
            f"{r.gflops_per_s:.3g} ({100 * r.gflops_per_s / matmul_rate(meta, r.threads):.0f}%)"
            if r.flops > 0 else "0"))
        if len(counts) > 1:
            lines += ["", f"Thread scaling: speed-up = time at {counts[0]} thread(s) / time at "
                      "this count, the median of the per-round ratios (rounds interleave the "
                      "counts):", ""]
            lines += _scaling(rows, pass_name)
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
    return lines


def plots(rows: list[Row]) -> dict[str, bytes]:
    """{"time_vs_T.png": PNG, "memory_vs_T.png": PNG} (log-log, one line per target, one panel
    per pass); empty when matplotlib is not installed or nothing was measured."""
    try:
        import matplotlib
    except ImportError:
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: dict[str, bytes] = {}
    passes = list(dict.fromkeys(r.pass_name for r in rows))
    if not passes:  # e.g. --mixers none --peers: nothing to plot
        return written
    for fname, value, label in (
        ("time_vs_T.png", lambda r: r.time_s, "seconds (decode: per token)"),
        ("memory_vs_T.png", lambda r: r.peak_bytes / 2**20, "peak MiB above baseline"),
    ):
        fig, axes = plt.subplots(1, len(passes), figsize=(5.5 * len(passes), 4.5), squeeze=False)
        several = len({r.threads for r in rows}) > 1
        for ax, pass_name in zip(axes[0], passes):
            sel = [r for r in rows if r.pass_name == pass_name and r.status == "ok"]
            for target, n in dict.fromkeys((r.target, r.threads) for r in sel):
                pts = [(r.T, value(r)) for r in sel if (r.target, r.threads) == (target, n)]
                pts = [(t, v) for t, v in pts if math.isfinite(v) and v > 0]
                if pts:
                    kind = next(r.kind for r in sel if r.target == target)
                    ax.plot(*zip(*pts), marker="o", ms=3, ls="-" if kind == "mixer" else "--",
                            label=f"{target} ({n} threads)" if several else target)
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
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=90)
        plt.close(fig)
        written[fname] = png.getvalue()
    return written
