"""The README's library examples run exactly as written (the harness and Hugging Face examples
are run by tests/cli/test_cli.py and tests/hf/test_hf.py, which prepare their checkpoints)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
SECTIONS = ["## Using the ops", "## Using the layers", "## Packed variable-length sequences"]


def section_blocks(title: str) -> list[str]:
    body = README[README.index(title) + len(title):]
    body = body[:body.index("\n## ")] if "\n## " in body else body
    return re.findall(r"```python\n(.*?)```", body, flags=re.DOTALL)


@pytest.mark.parametrize("title", SECTIONS)
def test_readme_section_runs(title, tmp_path, monkeypatch):
    blocks = section_blocks(title)
    assert blocks, f"README section {title!r} has no python example"
    monkeypatch.chdir(tmp_path)
    for code in blocks:
        exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})


def test_ci_runs_the_readmes_test_command_and_it_lints():
    """.ci/run ends with the README's set-up-and-test command, exactly, and that command runs
    ruff on src and tests before pytest."""
    root = Path(__file__).resolve().parents[1]
    body = README[README.index("Set up, lint and run the test suite"):]
    command = re.search(r"```bash\n(.*?)\n```", body, flags=re.DOTALL).group(1)
    ci = (root / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == command
    assert "ruff check src tests && python -m pytest" in command
