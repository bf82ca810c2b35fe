"""The README's reproductions table, re-rendered from the records (issue 35), and the list of
verdict changes against an earlier version of the records.

    python benchmarks/results/reproduce/verdicts.py table            # the README table (markdown)
    python benchmarks/results/reproduce/verdicts.py changes [REV]    # claim by claim, REV (main) -> now

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


def changes(rev: str) -> str:
    out = []
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
            was = "new" if prev is None else f"{verdict(prev[1][-1])} ({prev[0]})"
            out.append(f"- {rec} [{kind}] {name}: {was} -> {verdict(cells[-1])}; {cells[-2]}")
        seen = {name for _, name, _ in now} | {old_name(n) for _, n, _ in now}
        out += [f"- {rec} [{kind}] {name}: {verdict(cells[-1])} -> dropped"
                for name, (kind, cells) in before.items() if name not in seen]
    return "\n".join(out)


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "table"
    print(table() if what == "table" else changes(sys.argv[2] if len(sys.argv) > 2 else "main"))
