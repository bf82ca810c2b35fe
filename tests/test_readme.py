"""The README's library examples run exactly as written (the examples of docs/training.md and
docs/integrations.md are run by tests/cli/test_cli.py, tests/hf/test_hf.py and
tests/fla/test_deltanet.py, which prepare their checkpoints), and the README stays a short
tour: at most 350 lines, each docs/ page it links there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SECTIONS = ["## Using the ops", "## Using the layers", "## Packed variable-length sequences"]


def section_blocks(title: str, page: str = "README.md") -> list[str]:
    """The python examples of section ``title`` of ``page`` (the README, or a docs/ page)."""
    text = (ROOT / page).read_text()
    body = text[text.index(title) + len(title):]
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


def test_readme_is_a_short_tour_linking_the_docs():
    assert len(README.splitlines()) <= 350
    linked = set(re.findall(r"\]\((docs/[\w./-]+\.md)\)", README))
    assert linked, "the README links no docs/ page"
    assert all((ROOT / page).is_file() for page in linked), linked
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")} - {"docs/README.md"}
    assert pages <= linked, f"docs/ pages the README does not link: {sorted(pages - linked)}"
