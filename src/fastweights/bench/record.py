"""The benchmarks' one record writer, and the one description of the machine a record names.

A record is a folder. Every benchmark writes the same layout (docs/benchmarks.md, "Records"):

- ``results.csv``: the rows, one line each, the benchmark's columns;
- ``meta.json``: ``benchmark`` (its name), ``command`` (the command line that repeats the run),
  ``date`` (UTC, ISO 8601), ``machine`` (``machine()``: CPU model and instruction sets, logical
  CPUs, torch threads, OS, Python, torch, Triton and CUDA versions, GPUs), then the
  benchmark's own settings and run-wide figures;
- ``results.md``: the tables rendered for reading;
- ``lscpu.txt``: the full ``lscpu`` output (or why there is none);
- and the files a benchmark declares besides (plots, a second table).

``Record(out, name, overwrite=...)`` claims the folder before any measuring: a folder holding
anything is refused (``UserError`` naming ``--overwrite``) unless ``overwrite``, which deletes
only the files of this layout and the declared ones, never anything else a user keeps there.
``Record.write`` may then be called as often as the run likes (a long run rewrites its record
after each part, so that a run cut short keeps what it measured); each file is written whole to
a temporary name and renamed, so a reader never sees half a file.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import functools
import importlib.metadata
import io
import json
import os
import platform
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._commands import prepare_out

__all__ = ["RECORD_FILES", "Record", "Table", "add_out_arguments", "cpu_info", "gpu_name",
           "lscpu", "machine", "machine_line", "open_record"]

RESULTS, META, MARKDOWN, LSCPU = "results.csv", "meta.json", "results.md", "lscpu.txt"
RECORD_FILES = (RESULTS, META, MARKDOWN, LSCPU)  # what every record holds
HEAD = ("benchmark", "command", "date", "machine")  # meta.json's first keys, the writer's

# Instruction-set flags (as /proc/cpuinfo spells them) that decide CPU matmul speed: vector
# width (AVX2/FMA, AVX-512 families), bfloat16/int8 dot products (AVX512_BF16, VNNI) and AMX.
_ISA_PREFIXES = ("avx", "fma", "amx", "f16c")


def cpu_info(cpuinfo: str | None = None) -> dict[str, Any]:
    """{"model": CPU model name or None, "isa": sorted vector/matrix instruction-set flags}, read
    from /proc/cpuinfo (or the given text); empty where the file is unavailable (not Linux)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return {"model": None, "isa": []}
    model, flags = None, set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return {"model": model, "isa": sorted(f for f in flags if f.startswith(_ISA_PREFIXES))}


@functools.cache
def lscpu() -> str:
    """``lscpu``'s output, or one line saying why there is none."""
    try:
        return subprocess.run(["lscpu"], capture_output=True, text=True, check=True,
                              timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as err:
        return f"lscpu not available: {type(err).__name__}: {err}\n"


def _lscpu_model(text: str) -> str | None:
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Model name" and value.strip():
            return value.strip()
    return None


def _version(distribution: str) -> str | None:
    """An installed distribution's version, without importing it; None when not installed."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpu_name(device: torch.device | int) -> str:
    """A CUDA device's name and kind: "NVIDIA H200 (sm_90)"."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})"


@functools.cache
def _fixed_machine() -> dict[str, Any]:
    cpu = cpu_info()
    gpus = ([gpu_name(i) for i in range(torch.cuda.device_count())]
            if torch.cuda.is_available() else [])
    return {"cpu_model": _lscpu_model(lscpu()) or cpu["model"] or platform.processor()
            or platform.machine(),
            "cpu_isa": cpu["isa"], "logical_cpus": os.cpu_count(),
            "os": f"{platform.system()} {platform.release()}",
            "python": platform.python_version(), "torch": torch.__version__,
            "triton": _version("triton"), "cuda": torch.version.cuda, "gpus": gpus}


def machine() -> dict[str, Any]:
    """The machine and software a record names: CPU model (lscpu's "Model name", else
    /proc/cpuinfo's), its vector/matrix instruction sets, logical CPUs, torch's thread count
    now, OS, Python, torch, Triton (None when not installed), CUDA (None in a CPU build) and
    the visible GPUs ("NVIDIA H200 (sm_90)")."""
    return {**_fixed_machine(), "threads": torch.get_num_threads()}


def machine_line(m: Mapping[str, Any]) -> str:
    """``machine()`` in one line, for a record's markdown head."""
    isa = ", ".join(m.get("cpu_isa") or []) or "none reported"
    parts = [f"CPU {m.get('cpu_model') or 'unknown'} ({m.get('logical_cpus')} logical CPUs; "
             f"vector/matrix instruction sets: {isa})", f"{m.get('os')}",
             f"torch {m.get('torch')}, {m.get('threads')} thread{'s' * (m.get('threads') != 1)}"]
    if m.get("triton"):
        parts.append(f"Triton {m['triton']}")
    if m.get("gpus"):
        parts.append(f"GPU {', '.join(m['gpus'])}, CUDA {m.get('cuda')}")
    return "; ".join(parts)


@dataclass
class Table:
    """Rows for a CSV file: mappings or dataclass instances; ``columns`` in order (default: the
    first row's keys or fields). A list or dict in a cell is written as JSON, None as empty."""

    rows: Sequence[Any]
    columns: Sequence[str] | None = None

    def text(self) -> str:
        rows = [dataclasses.asdict(r) if dataclasses.is_dataclass(r) else dict(r)
                for r in self.rows]
        columns = list(self.columns) if self.columns is not None else list(rows[0]) if rows else []
        if not columns:
            raise ValueError("a table without rows needs its columns")
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: json.dumps(v) if isinstance(v, (list, tuple, dict)) else v
                             for k, v in r.items()})
        return buf.getvalue()


def _write(path: Path, data: str | bytes) -> None:
    """``data`` into ``path`` whole: written to a temporary name beside it, then renamed."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if isinstance(data, bytes):
        tmp.write_bytes(data)
    else:
        tmp.write_text(data)
    os.replace(tmp, path)


class Record:
    """The record folder ``out`` of one run of benchmark ``name`` (module docstring).
    ``files``: the names the benchmark writes besides ``RECORD_FILES``. Claims the folder now:
    ``UserError`` if it holds anything and not ``overwrite``; with ``overwrite`` an earlier
    record's files (those of the layout and ``files``) are deleted, nothing else."""

    def __init__(self, out: str | Path, name: str, *, overwrite: bool = False,
                 files: Sequence[str] = ()) -> None:
        bad = [f for f in files if f in RECORD_FILES or Path(f).name != f or f.startswith(".")]
        if bad:
            raise ValueError(f"files {bad}: a record's extra files are plain names other than "
                             f"{', '.join(RECORD_FILES)}")
        self.out, self.name, self.files = Path(out), name, tuple(files)
        prepare_out(self.out, overwrite, RECORD_FILES + self.files)

    def meta(self, command: str, **own: Any) -> dict[str, Any]:
        """meta.json's content: ``benchmark``, ``command``, ``date`` (now, UTC) and ``machine``,
        then the benchmark's own entries ``own`` (none may take one of those names)."""
        clash = sorted(set(own) & set(HEAD))
        if clash:
            raise ValueError(f"{clash}: meta entries the record writer sets itself")
        now = datetime.datetime.now(datetime.timezone.utc)
        return {"benchmark": self.name, "command": command,
                "date": now.isoformat(timespec="seconds"), "machine": machine(), **own}

    def write(self, rows: Sequence[Any] | Table, meta: Mapping[str, Any], *,
              markdown: str | Sequence[str] | None = None,
              files: Mapping[str, str | bytes | Table] | None = None) -> list[Path]:
        """Write the record: ``rows`` (a ``Table``, or rows whose first one names the columns)
        to results.csv, ``meta`` (from ``self.meta``) to meta.json, ``markdown`` (text or lines)
        to results.md, lscpu.txt, and ``files`` (declared names: text, bytes, or a ``Table`` as
        CSV). Returns the paths written."""
        if [k for k in HEAD if k not in meta] or meta["benchmark"] != self.name:
            raise ValueError(f"meta must come from Record.meta of {self.name!r} (with "
                             f"{', '.join(HEAD)})")
        files = dict(files or {})
        undeclared = sorted(set(files) - set(self.files))
        if undeclared:
            raise ValueError(f"files {undeclared} were not declared when the record was opened")
        table = rows if isinstance(rows, Table) else Table(rows)
        if not isinstance(markdown, str) and markdown is not None:
            markdown = "\n".join(markdown)
        content: dict[str, str | bytes] = {RESULTS: table.text()}
        for fname, data in files.items():
            content[fname] = data.text() if isinstance(data, Table) else data
        if markdown is not None:
            content[MARKDOWN] = markdown if markdown.endswith("\n") else markdown + "\n"
        content[LSCPU] = lscpu()
        content[META] = json.dumps(meta, indent=2) + "\n"  # last: a complete record has it
        self.out.mkdir(parents=True, exist_ok=True)
        written = []
        for fname, data in content.items():
            _write(self.out / fname, data)
            written.append(self.out / fname)
        return written


def add_out_arguments(p: argparse.ArgumentParser, *, required: bool = False,
                      default: Path | None = None) -> None:
    """A benchmark's ``--out`` (its record's folder; without it, unless ``required`` or given a
    ``default``, the benchmark only prints) and ``--overwrite``."""
    what = "folder for the record: results.csv, results.md, meta.json, lscpu.txt"
    if not required and default is None:
        what += " (default: print only)"
    p.add_argument("--out", type=Path, required=required, default=default, help=what)
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier record in --out (its files only)")


def open_record(args: argparse.Namespace, name: str, files: Sequence[str] = ()) -> Record | None:
    """The record of benchmark ``name`` in ``args.out``, claimed (``Record``, with
    ``args.overwrite``); None without ``--out``. Call it once the options are validated and
    before measuring."""
    return None if args.out is None else Record(args.out, name, overwrite=args.overwrite,
                                                files=files)
