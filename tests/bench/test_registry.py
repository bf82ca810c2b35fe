"""``fastweights.bench.BENCHMARKS``: one benchmark is one module plus its line in the registry;
``fastweights bench NAME`` is its only door."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import fastweights.bench as bench
from fastweights.cli import main

BENCH = Path(bench.__file__).parent


@pytest.mark.parametrize("name", list(bench.BENCHMARKS))
def test_every_registered_benchmark_is_one_module_with_the_four_names(name):
    module = bench.load(name)
    assert Path(module.__file__).parent == BENCH
    assert name == module.NAME
    assert isinstance(module.DESCRIPTION, str) and module.DESCRIPTION
    assert callable(module.add_arguments) and callable(module.run)


def test_every_benchmark_module_is_registered():
    """A module of bench/ with a command-line entry (``add_arguments``) is in the registry:
    none is reachable only by its file."""
    entries = {p.stem.replace("_", "-") for p in BENCH.glob("*.py")
               if any(isinstance(n, ast.FunctionDef) and n.name == "add_arguments"
                      for n in ast.parse(p.read_text()).body)}
    assert entries == set(bench.BENCHMARKS)


def test_unknown_benchmark_is_a_one_line_error(capsys):
    assert main(["bench", "no-such-bench"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no-such-bench" in err
    with pytest.raises(ValueError, match="unknown benchmark"):
        bench.load("no-such-bench")


def test_a_benchmarks_help_is_filled_from_its_module(capsys):
    with pytest.raises(SystemExit) as done:
        main(["bench", "gpu", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "--dry-run" in out and "--budget-s" in out
