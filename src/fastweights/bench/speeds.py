"""The ops' tables of measured speeds (``ops/<op>/speeds.py``, which the automatic backend choice
ranks fla against this project's kernels by: ops/backend.py ``ranked``) updated from records of
``fastweights bench gpu``:

    fastweights bench speeds RECORD [RECORD ...]

Each RECORD is a folder the bench wrote (results.csv, meta.json). From its ``ops`` rows at the
first ops shape (B8 T2048, 16 heads of 128, bfloat16 on a GPU) it takes the median time of each
kernel backend (fla, triton) per pass, forward ("fwd") and forward+backward ("fwdbwd"), and
writes them under the record's device kind (``sm_90`` for "NVIDIA H200 (sm_90)"), replacing
that kind's entry of every op it measured; other kinds stay as they were. Later records win.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import runpy
from pathlib import Path
from typing import Any

PASSES = {"fwd": "forward", "fwdbwd": "train"}
BACKENDS = ("fla", "triton")
OPS_DIR = Path(__file__).resolve().parents[1] / "ops"

HEADER = '''"""Measured times of ``{op}`` per backend on each kind of GPU, milliseconds (median): what the
automatic choice ranks fla against this project's kernels by (ops/backend.py ``ranked``;
docs/gpu.md, "Which backend runs what"). Keys: the device kind (``backend.device_kind``), then
"forward" (no gradients) and "train" (forward and backward) by backend; "shape" and "source" say
what was measured where. Written by ``fastweights bench speeds`` from a record of
``fastweights bench gpu`` (its ops rows); a backend without a figure keeps its place in the
fixed order.
"""
'''


def device_kind(device: str) -> str:
    """The kind in a record's device name: "NVIDIA H200 (sm_90)" -> "sm_90"."""
    found = re.search(r"\((sm_\d+)\)", device)
    if found is None:
        raise ValueError(f"a GPU record's device names its sm_XY kind, got {device!r}")
    return found.group(1)


def from_record(folder: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """{op: {kind: entry}} of one record: the kernel backends' median ms per pass at its first
    ops shape."""
    meta = json.loads((folder / "meta.json").read_text())
    kind = device_kind(meta["device"])
    (B, T), (H, D) = meta["sizes"]["ops"][0], meta["sizes"]["ops_heads"]
    shape = f"B{B} T{T} H{H} D{D}"
    # versions: in the record's machine block (bench/record.py); top-level in older records
    soft = meta["machine"] if isinstance(meta.get("machine"), dict) else meta
    source = (f"{folder.as_posix()}: {meta['device']}, torch {soft['torch']}, Triton "
              f"{soft['triton']}, fla {meta['fla']}, {meta['date']}")
    out: dict[str, dict[str, dict[str, Any]]] = {}
    with open(folder / "results.csv", newline="") as f:
        for r in csv.DictReader(f):
            if (r["section"] != "ops" or r["status"] != "ok" or r["shape"] != shape
                    or r["backend"] not in BACKENDS or r["pass"] not in PASSES):
                continue
            entry = out.setdefault(r["name"], {}).setdefault(
                kind, {"shape": f"{shape} {r['dtype']}", "source": source})
            entry.setdefault(PASSES[r["pass"]], {})[r["backend"]] = float(r["median_ms"])
    return out


def render(op: str, speeds: dict[str, dict[str, Any]]) -> str:
    """The text of ops/<op>/speeds.py holding ``speeds``."""
    lines = [HEADER.format(op=op), "SPEEDS = {"]
    for kind in sorted(speeds):
        lines.append(f"    {kind!r}: {{")
        for key in ("shape", "source", "forward", "train"):
            if key in speeds[kind]:
                lines.append(f"        {key!r}: {speeds[kind][key]!r},")
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines) + "\n"


def update(records: list[Path], ops_dir: Path = OPS_DIR) -> list[Path]:
    """Write every op's table measured in ``records`` (in order: later ones win) into
    ``ops_dir``/<op>/speeds.py, keeping the kinds they did not measure. Returns the files."""
    merged: dict[str, dict[str, dict[str, Any]]] = {}
    for folder in records:
        for op, kinds in from_record(folder).items():
            merged.setdefault(op, {}).update(kinds)
    written = []
    for op, kinds in sorted(merged.items()):
        path = ops_dir / op / "speeds.py"
        if not path.parent.is_dir():
            raise ValueError(f"no op folder {path.parent} for the record's op {op!r}")
        old = runpy.run_path(str(path))["SPEEDS"] if path.exists() else {}
        path.write_text(render(op, {**old, **kinds}))
        written.append(path)
    return written


NAME = "speeds"
DESCRIPTION = ("update the ops' tables of measured kernel speeds (ops/<op>/speeds.py, which the "
               "automatic backend choice ranks fla and triton by) from records of fastweights "
               "bench gpu: each record's ops rows at B8 T2048, under its GPU kind")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("records", type=Path, nargs="+",
                   help="folders written by fastweights bench gpu (results.csv, meta.json); "
                        "later ones win")


def run(args: argparse.Namespace) -> int:
    from .._commands import UserError

    for folder in args.records:
        if not (folder / "results.csv").is_file() or not (folder / "meta.json").is_file():
            raise UserError(f"{folder} is not a record of fastweights bench gpu (no "
                            "results.csv and meta.json)")
    for path in update(args.records, OPS_DIR):
        print(f"wrote {path}")
    return 0
