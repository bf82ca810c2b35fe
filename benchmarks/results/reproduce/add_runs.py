"""Add the finished runs of a reproduction folder to a record: the runs of the named models (every
model when none is named) replace or join the record's rows of the same (model, seed) in
results.csv and windows.csv, and the manifest lists their models' settings. Then render the
record (``fastweights reproduce NAME --render --out RECORD``).

    python benchmarks/results/reproduce/add_runs.py RUNS_FOLDER RECORD_FOLDER [MODEL ...]

For runs added to a record made at an earlier commit: first check that the current code
reproduces one of the record's runs to the digit (rerun it into RUNS_FOLDER and compare), so
that the added runs are what the record's code would have given. The record's README says so.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fastweights.reproduce.common import (
    MANIFEST,
    WINDOWS,
    finished_results,
    read_csv,
    read_windows,
    write_csv,
    write_windows,
)


def add_runs(runs: Path, record: Path, models: list[str]) -> list[str]:
    """Merge; returns the (model, seed) keys added, as text."""
    new = [r for r in finished_results(runs) if not models or r["model"] in models]
    if not new:
        raise SystemExit(f"{runs} has no finished run of {models or 'any model'}")
    mine, theirs = json.loads((runs / MANIFEST).read_text()), json.loads((record / MANIFEST).read_text())
    if (mine["experiment"], mine["size"], mine["settings"]) != (theirs["experiment"], theirs["size"],
                                                                 theirs["settings"]):
        raise SystemExit(f"{runs} holds {mine['experiment']} ({mine['size']}) with other settings "
                         f"than the record ({theirs['experiment']}, {theirs['size']})")
    keys = {(r["model"], r["seed"]) for r in new}
    rows = [r for r in read_csv(record / "results.csv") if (r["model"], r["seed"]) not in keys]
    order = list(theirs["models"]) + [m for m in mine["models"] if m not in theirs["models"]]
    rows += new
    rows.sort(key=lambda r: (r["seed"], order.index(r["model"]) if r["model"] in order else len(order)))
    write_csv(record / "results.csv", rows)
    windows = {k: v for k, v in (read_windows(record / WINDOWS) or {}).items() if k[:2] not in keys}
    old = [{"model": m, "seed": s, "windows": {}} for m, s in dict.fromkeys(k[:2] for k in windows)]
    for entry in old:
        entry["windows"] = {k[2]: v for k, v in windows.items() if k[:2] == (entry["model"], entry["seed"])}
    write_windows(record / WINDOWS, old + new)
    for m in dict.fromkeys(r["model"] for r in new):
        theirs["models"][m] = mine["models"][m]
    (record / MANIFEST).write_text(json.dumps(theirs, indent=2, sort_keys=True) + "\n")
    return [f"{m} seed {s}" for m, s in sorted(keys)]


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    print("added:", ", ".join(add_runs(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])))
