"""The project cites its own documentation, and every citation lands.

Code, tests, examples, benchmark records and the README cite ``docs/maths.md N.M`` (sections
of the mathematics, e.g. ``1.4``, ``5b``, ranges ``2.2-2.4`` and lists ``2.1, 2.3``) and
``docs/design.md, "Section"`` (a heading of the design); every ``docs/NAME.md`` they mention
must exist. Nothing may cite the documents that once lived beside the repository, where users
never got them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SCANNED = ("src", "tests", "examples", "benchmarks", "docs", "README.md")
SUFFIXES = {".py", ".md", ".rst", ".txt", ".toml", ".cfg"}

SECTION = r"\d+[a-z]?(?:\.\d+)?"
# "docs/maths.md 1.3", "docs/maths.md 2.2-2.4", "docs/maths.md 3.1, 3.2 and 3.5", "3.1/3.4"
MATHS_CITE = re.compile(rf"docs/maths\.md`?(\s+{SECTION}(?:(?:\s*[-/]\s*|, | and ){SECTION})*)")
DESIGN_CITE = re.compile(r'docs/design\.md`?,\s+"([^"\n]+)"')
DOC_PATH = re.compile(r"docs/([\w-]+\.md)")
# The old names, spelled in two halves so that this file does not match itself.
STALE = re.compile(r"\b(?:" + "SP" + "EC|" + "DES" + "IGN|" + "STY" + "LE" + r")(?:\.md)?\b"
                   r"|\.\./shared/")


def headings(page: str) -> list[str]:
    """The headings of a docs page, without their leading #s."""
    return [m.group(1).strip() for m in re.finditer(r"^#{1,6}\s+(.*)$", (DOCS / page).read_text(),
                                                    flags=re.M)]


def maths_sections() -> set[str]:
    """'1', '1.4', '5b', ... : the numbers the headings of docs/maths.md start with."""
    found = set()
    for h in headings("maths.md"):
        m = re.match(rf"({SECTION})\.?\s", h)
        if m:
            found.add(m.group(1))
    return found


def cited_sections(text: str) -> list[str]:
    """Every section number a docs/maths.md citation in ``text`` names."""
    return [s for m in MATHS_CITE.finditer(text) for s in re.findall(SECTION, m.group(1))]


def scanned_files() -> list[Path]:
    """Every text file of SCANNED but this one (whose patterns and examples would match)."""
    files = []
    for name in SCANNED:
        path = ROOT / name
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += [p for p in sorted(path.rglob("*")) if p.is_file() and p.suffix in SUFFIXES
                      and "__pycache__" not in p.parts and not any(
                          part.startswith(".") for part in p.relative_to(ROOT).parts)]
    return [p for p in files if p.resolve() != Path(__file__).resolve()]


@pytest.fixture(scope="module")
def texts() -> dict[str, str]:
    if not (DOCS / "maths.md").is_file():
        pytest.skip("no docs/ folder beside the tests (an installed package, not a checkout)")
    return {str(p.relative_to(ROOT)): p.read_text(errors="replace") for p in scanned_files()}


def test_the_citation_parser_reads_ranges_lists_and_sub_letters():
    text = ("(docs/maths.md 2.2-2.4) docs/maths.md 3.1, 3.2 and 3.5; docs/maths.md 5b; "
            "docs/maths.md 3.1/3.4, Sun et al.; docs/maths.md 1.8's loop")
    assert cited_sections(text) == ["2.2", "2.4", "3.1", "3.2", "3.5", "5b", "3.1", "3.4", "1.8"]
    assert DESIGN_CITE.findall('(docs/design.md, "State layouts"); `docs/design.md`, "Floors"') \
        == ["State layouts", "Floors"]
    assert STALE.search("see " + "SP" + "EC.md 1.4") and not STALE.search("SPECS = 1")


def test_maths_has_the_sections_the_code_relies_on():
    sections = maths_sections()
    for s in ("1", "1.4", "2.4", "3.5", "4.4", "5.1", "5b", "6", "7.3"):
        assert s in sections, f"docs/maths.md has no section {s}"


def test_every_maths_citation_names_an_existing_section(texts):
    sections = maths_sections()
    bad = [f"{name}: docs/maths.md {s}" for name, text in texts.items()
           for s in cited_sections(text) if s not in sections]
    assert not bad, "citations of sections docs/maths.md does not have:\n" + "\n".join(bad)
    assert sum(len(cited_sections(t)) for t in texts.values()) > 100  # the scan found them


def test_every_design_citation_names_an_existing_heading(texts):
    names = set(headings("design.md"))
    bad = [f'{name}: docs/design.md, "{h}"' for name, text in texts.items()
           for h in DESIGN_CITE.findall(text) if h not in names]
    assert not bad, "citations of headings docs/design.md does not have:\n" + "\n".join(bad)
    assert sum(len(DESIGN_CITE.findall(t)) for t in texts.values()) > 10


def test_every_docs_page_mentioned_exists(texts):
    bad = sorted({f"{name}: docs/{page}" for name, text in texts.items()
                  for page in DOC_PATH.findall(text) if not (DOCS / page).is_file()})
    assert not bad, "mentions of docs pages that do not exist:\n" + "\n".join(bad)


def test_nothing_cites_the_documents_outside_the_repository(texts):
    bad = [f"{name}:{i}: {line.strip()}" for name, text in texts.items()
           for i, line in enumerate(text.splitlines(), 1) if STALE.search(line)]
    assert not bad, ("cite docs/maths.md or docs/design.md instead of documents outside the "
                     "repository:\n" + "\n".join(bad))


# A backticked path in docs/ whose first part is a folder of the repository or of the package
# names a file or folder that exists (relative to the repository, or to src/fastweights).
TOP_FOLDERS = ("src", "tests", "docs", "benchmarks", "examples")
PACKAGE = ROOT / "src" / "fastweights"


def _repository_paths(text: str) -> list[str]:
    """The backticked repository paths in ``text`` (``ops/ttt/recurrent.py``,
    ``tests/test_docs.py``, ``benchmarks/results/...``; ``path:line`` and ``path::name``
    stand for the path)."""
    folders = {*TOP_FOLDERS, *(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())}
    found = []
    for token in re.findall(r"`([^`\s]+)`", text):
        path = re.sub(r":\d+$", "", token.split("::")[0]).rstrip("/")
        if "/" in path and path.split("/")[0] in folders and not re.search(r"[*<>{}]", path):
            found.append(path)
    return found


def test_every_backticked_repository_path_in_docs_exists():
    missing = []
    for page in sorted(DOCS.glob("*.md")):
        for path in _repository_paths(page.read_text()):
            base = ROOT if path.split("/")[0] in TOP_FOLDERS else PACKAGE
            if not (base / path).exists():
                missing.append(f"docs/{page.name}: `{path}`")
    assert missing == []


def test_the_path_check_sees_a_stale_path():
    assert _repository_paths("see `ops/ttt/decode.py` and `cli/bench/`, not `1/sqrt(d)`") == [
        "ops/ttt/decode.py", "cli/bench"]
    assert not (PACKAGE / "ops/ttt/decode.py").exists()


def test_design_lists_the_registered_mixers():
    """docs/design.md, "Models" names every registered mixer, in registry order."""
    from fastweights import mixer_names

    text = (DOCS / "design.md").read_text()
    listed = re.search(r"Names \(in registry order[^:]*\):\s*`([^`]+)`", text)
    assert listed is not None, "docs/design.md lost its list of mixer names"
    assert [n.strip() for n in listed.group(1).split(",")] == mixer_names()
