"""The README's reproductions table, re-rendered from the records (issue 35), and the list of
verdict changes against an earlier version of the records.

    python benchmarks/results/reproduce/verdicts.py table            # the docs table (markdown)
    python benchmarks/results/reproduce/verdicts.py changes [REV]    # every relabelled row, REV (main) -> now
    python benchmarks/results/reproduce/verdicts.py all [REV]        # every row, relabelled or not

Reads each record's results.md (``## Claims`` and the controls table); the earlier verdicts come
from ``git show REV:<record>/results.md``. Claims renamed since then are matched through
``RENAMED``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RECORDS = ("fwp-recall", "fwp-lm", "ttt-ablation", "long-context", "infini-passkey",
           "infini-passkey-digits", "infini-passkey-bytes", "transnormer", "aft")
# new claim name (prefix) -> the earlier name (prefix)
# new claim name -> the earlier name, whole (issue 44: (c) judged against the truncation control)
RENAMED_EXACT = {
    "(c) delta: no truncation < truncated (the same segments, the state reset at every window)":
        "(c) delta: no truncation < truncated",
    "(c) sum rule: no truncation collapses (> 10 % worse than truncated on the same segments)":
        "(c) sum rule: no truncation collapses (> 10 % worse than truncated)",
}
RENAMED = {
    "(b) NormAttention's gradient stays bounded": "(b) NormAttention's gradient norm max",
    "delta memory and linear memory alike": "delta memory no worse than linear",
    "the needle is out of the local window": "memory is what retrieves",
    "(a) diag/norm < all-diag": "(a) reference: diag/norm vs all-diag",
    "update: delta < sum rule (S = 8)": "update: delta < sum rule (S = 8)",
}


def rows(md: str, section: str) -> list[list[str]]:
    """The table rows (cells) under the heading ``section`` of a results.md."""
    if section not in md:
        return []
    text = md[md.index(section):]
    text = text[text.index("|"):]
    out = []
    for line in text.splitlines():
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if cells[0] == "claim" or set(cells[0]) <= {"-", "|"}:
            continue
        out.append(cells)
    return out


def verdict(cell: str) -> str:
    m = re.match(r"\*\*(.+?)\*\*", cell)
    return m.group(1) if m else cell


def claims(md: str) -> list[tuple[str, str, list[str]]]:
    """(kind, name, cells) of every claim and control row."""
    return ([("claim", r[0], r) for r in rows(md, "## Claims")] +
            [("control", r[0], r) for r in rows(md, "## Controls")])


def old_name(name: str) -> str:
    if name in RENAMED_EXACT:
        return RENAMED_EXACT[name]
    for new, old in RENAMED.items():
        if name.startswith(new):
            return old + name[len(new):] if not name.startswith(old) else name
    return name


def table() -> str:
    lines = ["| experiment: claim | source | ours: A vs B; d = B - A per seed | verdict |",
             "|---|---|---|---|"]
    for rec in RECORDS:
        md = (HERE / rec / "results.md").read_text()
        for kind, name, cells in claims(md):
            if kind != "claim":
                continue
            source, ours, diff, v = cells[2], cells[3], cells[4], cells[5]
            ours = re.sub(r" \(n = .*?\)$", "", ours)
            lines.append(f"| {rec}: {name} | {source} | {ours}; {diff} | {v} |")
    return "\n".join(lines)


SMALLER_OLD = "smaller than claimed"  # the label before issue 44
INTERVAL = re.compile(r"interval \[([-+0-9.e]+), ([-+0-9.e]+)\]")


def wrong_side(cells: list[str]) -> bool:
    """A "smaller than claimed" row whose interval lies entirely on the wrong side of 0 (for a
    "degrades" claim, ">" in the ours cell, the claimed side is d < 0)."""
    m = INTERVAL.search(cells[-2])
    if not m or "smaller than claimed" not in verdict(cells[-1]):
        return False
    lo, hi = float(m.group(1)), float(m.group(2))
    degrades = " > B = " in cells[3]
    return lo > 0 if degrades else hi < 0


def changes(rev: str, every: bool = False) -> str:
    """Claim by claim, the verdict at ``rev`` -> now, with the current numbers: only the rows
    whose label changed (and new or dropped ones) unless ``every``; then a check that no
    "smaller than claimed" row has its interval entirely on the wrong side."""
    out, bad = [], []
    for rec in RECORDS:
        now = claims((HERE / rec / "results.md").read_text())
        try:
            before_md = subprocess.run(["git", "show", f"{rev}:benchmarks/results/reproduce/{rec}/results.md"],
                                       capture_output=True, text=True, check=True, cwd=HERE).stdout
        except subprocess.CalledProcessError:
            before_md = ""
        before = {name: (kind, cells) for kind, name, cells in claims(before_md)}
        for kind, name, cells in now:
            prev = before.get(name) or before.get(old_name(name))
            was = "new" if prev is None else verdict(prev[1][-1])
            if every or was != verdict(cells[-1]):
                out.append(f"- {rec} [{kind}] {name}: {was} -> {verdict(cells[-1])}; {cells[-2]}")
            if wrong_side(cells):
                bad.append(f"{rec}: {name}")
        seen = {name for _, name, _ in now} | {old_name(n) for _, n, _ in now}
        out += [f"- {rec} [{kind}] {name}: {verdict(cells[-1])} -> dropped"
                for name, (kind, cells) in before.items() if name not in seen]
    out.append(f"\n{len([o for o in out if o.startswith('- ')])} rows listed. 'smaller than claimed' rows "
               "with the interval entirely on the wrong side: " + ("; ".join(bad) or "none"))
    return "\n".join(out)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "table"
    rev = sys.argv[2] if len(sys.argv) > 2 else "main"
    print(table() if what == "table" else changes(rev, every=what == "all"))
