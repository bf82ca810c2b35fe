"""Start-up cost: ``fastweights --help`` and every ``fastweights COMMAND --help`` answer without
importing torch (each subcommand's module imports its work's modules inside the functions that
need them; cli/main.py ``COMMANDS``), and importing the library imports no more of torch than
``import torch`` does (no ``torch._dynamo``). Checked in fresh interpreters, as a user starts
them; what is asserted is which modules get imported, never a time."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fastweights.cli.main import COMMANDS


def _imports_after(code: str) -> set[str]:
    """The modules a fresh interpreter has imported after running ``code``."""
    marker = "--- modules ---"
    run = subprocess.run([sys.executable, "-c", code + f"\nimport sys\nprint({marker!r}, *sys.modules)"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return set(run.stdout.rpartition(marker)[2].split())


@pytest.mark.parametrize("argv", [[], *([c] for c in COMMANDS)],
                         ids=["fastweights", *COMMANDS])
def test_help_imports_no_torch(argv):
    code = ("from fastweights.cli import main\n"
            "try:\n"
            f"    main({[*argv, '--help']!r})\n"
            "except SystemExit as done:\n"
            "    assert done.code == 0\n")
    modules = _imports_after(code)
    assert "fastweights.cli.main" in modules
    assert "torch" not in modules
    assert all(f"fastweights.cli.{c}" in modules for c in argv)


def test_importing_the_library_does_not_import_the_compiler():
    modules = _imports_after("import fastweights.layers, fastweights.models, fastweights.ops")
    assert "torch" in modules and "torch._dynamo" not in modules


def test_the_experiments_listed_without_importing_them_are_the_registered_ones():
    from fastweights.reproduce import EXPERIMENTS, NAMES

    assert tuple(EXPERIMENTS) == NAMES
