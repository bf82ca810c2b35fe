"""bench/record.py, the benchmarks' one record writer: its layout, the meta every record holds,
the refusal to write over what a folder holds, and a check that no other module under
src/fastweights/bench writes a file itself."""

from __future__ import annotations

import ast
import csv
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fastweights._commands import UserError
from fastweights.bench import record
from fastweights.bench.record import RECORD_FILES, Record, Table

BENCH = Path(record.__file__).parent

# Calls that write a file (or make a folder for one), by the called name.
WRITING = {"write_text", "write_bytes", "mkdir", "makedirs", "touch", "dump", "writer",
           "DictWriter", "savefig", "save", "to_csv", "to_json", "copy", "copy2", "copyfile",
           "copytree", "move", "rename", "replace"}
# (module, function, call) allowed to write, and why.
ALLOWED = {
    ("speeds.py", "update", "write_text"):
        "rewrites the ops' speeds.py tables (source code the backend choice imports), not a "
        "record",
    ("context_parallel.py", "finish_rank", "write_text"):
        "rank 0 hands its rows to the parent process through a temporary file of run_worlds",
    ("measure.py", "prepare_cpu_memory_accounting", "open"):
        "writes /proc/self/clear_refs, the kernel's reset of the memory high-water mark",
    ("measure.py", "__enter__", "open"):
        "writes /proc/self/clear_refs, the kernel's reset of the memory high-water mark",
    ("report.py", "plots", "savefig"):
        "renders a PNG into memory (io.BytesIO); Record.write writes the bytes",
}


def _name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


def _open_mode(call: ast.Call) -> str:
    mode = call.args[1] if len(call.args) > 1 else next(
        (k.value for k in call.keywords if k.arg == "mode"), None)
    return mode.value if isinstance(mode, ast.Constant) and isinstance(mode.value, str) else "r"


def _calls(source: str, picked: Callable[[ast.Call, str | None], bool]) -> list[tuple[str, str]]:
    """(enclosing function, called name) of every call in ``source`` that ``picked``."""
    found = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name)
                continue
            if isinstance(child, ast.Call) and picked(child, _name(child.func)):
                found.append((where, _name(child.func)))
            visit(child, where)

    visit(ast.parse(source), "<module>")
    return found


def _on(call: ast.Call, modules: set[str]) -> bool:
    """Whether ``call`` calls a function of one of ``modules`` (``json.dump``)."""
    return (isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name)
            and call.func.value.id in modules)


def file_writes(source: str) -> list[tuple[str, str]]:
    """(enclosing function, called name) of every call in ``source`` that writes a file:
    ``open`` in a writing mode, or a name in ``WRITING`` (``replace``/``copy``/``save``/
    ``dump``/``rename``/``move`` only on a module: os, shutil, json, torch, ...)."""
    modules = {"os", "shutil", "json", "torch", "np", "numpy", "csv", "pickle"}

    def picked(call: ast.Call, name: str | None) -> bool:
        if name == "open":
            return bool(set(_open_mode(call)) & set("wax+"))
        if name in {"replace", "copy", "save", "dump", "rename", "move"}:
            return _on(call, modules)
        return name in WRITING

    return _calls(source, picked)


def test_no_bench_module_writes_a_file_but_the_writer():
    """Every record goes through bench/record.py; a module of src/fastweights/bench writing a
    file itself (open(..., "w"), write_text, json.dump, a csv writer, savefig to a path, ...)
    fails here unless ``ALLOWED`` says why it may."""
    offenders, used = [], set()
    for path in sorted(BENCH.glob("*.py")):
        if path.name == "record.py":
            continue
        for where, call in file_writes(path.read_text()):
            key = (path.name, where, call)
            if key in ALLOWED:
                used.add(key)
            else:
                offenders.append(f"{path.name}: {where}() calls {call}")
    assert not offenders, "write records with bench/record.py:\n" + "\n".join(offenders)
    assert used == set(ALLOWED), f"stale exceptions: {set(ALLOWED) - used}"


@pytest.mark.parametrize(("planted", "call"), [
    ('open(out / "results.csv", "w")', "open"),
    ('open(path, mode="a")', "open"),
    ('(out / "meta.json").write_text("{}")', "write_text"),
    ("json.dump(rows, f)", "dump"),
    ('csv.writer(f).writerow(["a"])', "writer"),
    ('csv.DictWriter(f, fieldnames=["a"])', "DictWriter"),
    ('fig.savefig(out / "plot.png")', "savefig"),
    ('torch.save(rows, out / "rows.pt")', "save"),
    ("out.mkdir(parents=True)", "mkdir"),
    ('os.replace(tmp, out / "results.csv")', "replace"),
])
def test_the_check_finds_a_planted_write(planted, call):
    assert file_writes(f"def run(out, rows, f, fig, path, tmp):\n    {planted}\n") == [
        ("run", call)]


def test_the_check_lets_reads_and_strings_be():
    source = ('def run(p, s):\n    open(p).read()\n    open(p, "rb")\n    json.dumps(s)\n'
              '    s.replace("a", "b")\n    csv.DictReader(open(p))\n')
    assert file_writes(source) == []


@dataclasses.dataclass
class _Row:
    name: str
    ms: float
    note: str | None = None


def test_layout_and_meta(tmp_path):
    out = tmp_path / "rec"
    rec = Record(out, "demo", files=("extra.csv", "plot.png"))
    assert out.is_dir() and not any(out.iterdir())
    meta = rec.meta("fastweights bench demo --x 1", config={"x": 1})
    assert list(meta)[:4] == ["benchmark", "command", "date", "machine"]
    written = rec.write([_Row("a", 1.5), _Row("b", 2.0, "slow")], meta, markdown=["# demo", "x"],
                        files={"extra.csv": Table([{"k": [1, 2]}]), "plot.png": b"\x89PNG"})
    assert {p.name for p in out.iterdir()} == set(RECORD_FILES) | {"extra.csv", "plot.png"}
    assert sorted(p.name for p in written) == sorted(p.name for p in out.iterdir())
    with open(out / "results.csv") as f:
        assert list(csv.DictReader(f)) == [{"name": "a", "ms": "1.5", "note": ""},
                                           {"name": "b", "ms": "2.0", "note": "slow"}]
    assert (out / "extra.csv").read_text() == 'k\n"[1, 2]"\n'  # lists as JSON
    assert (out / "plot.png").read_bytes() == b"\x89PNG"
    assert (out / "results.md").read_text() == "# demo\nx\n"
    saved = json.loads((out / "meta.json").read_text())
    assert saved["benchmark"] == "demo" and saved["command"] == "fastweights bench demo --x 1"
    assert saved["config"] == {"x": 1} and saved["date"].endswith("+00:00")
    m = saved["machine"]
    assert set(m) == {"cpu_model", "cpu_isa", "logical_cpus", "threads", "os", "python",
                      "torch", "triton", "cuda", "gpus"}
    assert m["torch"] == torch.__version__ and m["threads"] == torch.get_num_threads()
    assert m["cpu_model"] and isinstance(m["cpu_isa"], list)
    assert (out / "lscpu.txt").read_text() == record.lscpu()
    lscpu_model = record._lscpu_model(record.lscpu())
    assert m["cpu_model"] == (lscpu_model or record.cpu_info()["model"] or m["cpu_model"])
    # written again (a long run after each part): the same files, whole
    rec.write([_Row("c", 3.0)], meta)
    assert (out / "results.csv").read_text() == "name,ms,note\nc,3.0,\n"
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary left


def test_refuses_a_folder_that_holds_anything(tmp_path):
    out = tmp_path / "rec"
    out.mkdir()
    (out / "results.csv").write_text("mine\n")
    (out / "notes.txt").write_text("keep\n")
    with pytest.raises(UserError, match="--overwrite"):
        Record(out, "demo")
    assert (out / "results.csv").read_text() == "mine\n"
    # --overwrite: an earlier record's files go, nothing else
    (out / "plot.png").write_bytes(b"old")
    rec = Record(out, "demo", overwrite=True, files=("plot.png",))
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    rec.write(Table([], ["a"]), rec.meta("c"))
    assert (out / "notes.txt").read_text() == "keep\n"
    assert (out / "results.csv").read_text() == "a\n"
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(UserError, match="not a folder"):
        Record(file, "demo")


def test_writer_refuses_what_is_not_a_record(tmp_path):
    rec = Record(tmp_path / "rec", "demo", files=("x.csv",))
    meta = rec.meta("c")
    with pytest.raises(ValueError, match="not declared"):
        rec.write([{"a": 1}], meta, files={"y.csv": "a\n"})
    with pytest.raises(ValueError, match=r"Record\.meta"):
        rec.write([{"a": 1}], {"command": "c"})
    with pytest.raises(ValueError, match=r"Record\.meta"):
        rec.write([{"a": 1}], {**meta, "benchmark": "other"})
    with pytest.raises(ValueError, match="sets itself"):
        rec.meta("c", machine="mine")
    with pytest.raises(ValueError, match="columns"):
        rec.write([], meta)
    for bad in ("results.csv", "sub/x.csv", ".hidden"):
        with pytest.raises(ValueError, match="plain names"):
            Record(tmp_path / "other", "demo", files=(bad,))
    assert not (tmp_path / "other").exists()


def test_machine_line_and_cpu_info():
    line = record.machine_line({"cpu_model": "AMD EPYC 9B14", "cpu_isa": ["avx2", "fma"],
                                "logical_cpus": 2, "os": "Linux 6.1", "torch": "2.13.0",
                                "threads": 2, "triton": "3.9.0", "cuda": "12.8",
                                "gpus": ["NVIDIA H200 (sm_90)"]})
    assert line == ("CPU AMD EPYC 9B14 (2 logical CPUs; vector/matrix instruction sets: avx2, "
                    "fma); Linux 6.1; torch 2.13.0, 2 threads; Triton 3.9.0; GPU NVIDIA H200 "
                    "(sm_90), CUDA 12.8")
    assert record._lscpu_model("Architecture: x86_64\nModel name:   AMD EPYC 9B14\n") == \
        "AMD EPYC 9B14"
    assert record._lscpu_model("lscpu not available: FileNotFoundError\n") is None


# Clock and memory reads only bench/measure.py makes (the one timer and memory meter).
MEASURING = {"perf_counter", "process_time", "thread_time", "perf_counter_ns", "time_ns",
             "max_memory_allocated", "memory_allocated", "reset_peak_memory_stats",
             "saved_tensors_hooks", "getrusage", "elapsed_time"}
# (module, function, call) allowed, and why.
NOT_MEASURING = {
    ("gpu.py", "may_start", "monotonic"): "the run's time budget, not a measurement",
    ("gpu.py", "_timed", "monotonic"): "the run's time budget, not a measurement",
    ("gpu.py", "run_benchmark", "monotonic"): "the run's elapsed time for its budget",
    ("gpu.py", "write", "monotonic"): "the run's elapsed time for its budget",
}


def clock_reads(source: str) -> list[tuple[str, str]]:
    """(enclosing function, called name) of every clock or memory-statistics read in
    ``source`` (``MEASURING``, and ``time.monotonic``/``time.time``)."""
    return _calls(source, lambda call, name: name in MEASURING or (
        _on(call, {"time"}) and name in ("monotonic", "time")))


def test_only_measure_reads_clocks_and_memory():
    """Every benchmark times with bench/measure.py's time_call / time_clocks / time_rounds and
    meters memory with its PeakMemory / saved_bytes; a module reading a clock or the memory
    statistics itself fails here unless ``NOT_MEASURING`` says why it may."""
    offenders, used = [], set()
    for path in sorted(BENCH.glob("*.py")):
        if path.name == "measure.py":
            continue
        for where, call in clock_reads(path.read_text()):
            if (path.name, where, call) in NOT_MEASURING:
                used.add((path.name, where, call))
            else:
                offenders.append(f"{path.name}: {where}() calls {call}")
    assert not offenders, "time and meter with bench/measure.py:\n" + "\n".join(offenders)
    assert used == set(NOT_MEASURING), f"stale exceptions: {set(NOT_MEASURING) - used}"
    planted = "def run(f):\n    t = time.perf_counter()\n    torch.cuda.max_memory_allocated()\n"
    assert clock_reads(planted) == [("run", "perf_counter"), ("run", "max_memory_allocated")]
