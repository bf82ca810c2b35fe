"""Every record in benchmarks/results/reproduce/ is its own rendering: results.md and README.md
(from README.in.md) equal what ``fastweights reproduce --render`` makes of its results.csv, so a
figure edited by hand, or a results.csv changed without re-rendering, fails here."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from fastweights.reproduce.driver import check
from fastweights.reproduce.prose import TEMPLATE

ROOT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "reproduce"
RECORDS = sorted(p.parent.name for p in ROOT.glob("*/reproduce.json"))


def test_the_records_are_found():
    assert {"fwp-lm", "long-context", "aft", "transnormer", "ttt-ablation", "fwp-recall"} <= set(RECORDS)


@pytest.mark.parametrize("name", RECORDS)
def test_a_record_is_its_rendering(name):
    assert check(ROOT / name) == [], (f"{name}: rerender with `python -m fastweights reproduce "
                                      f"... --render --out benchmarks/results/reproduce/{name}`")


@pytest.mark.parametrize("name", [r for r in RECORDS if (ROOT / r / TEMPLATE).is_file()])
def test_every_readme_is_rendered_from_its_template(name):
    assert (ROOT / name / "README.md").is_file()


def _copy(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(ROOT / name, dst)
    return dst


def test_an_edited_number_in_the_prose_fails(tmp_path):
    rec = _copy("fwp-lm", tmp_path)
    text = (rec / "README.md").read_text()
    first = next(i for i, ch in enumerate(text) if ch.isdigit() and text[i - 1] == ".")
    edited = text[:first] + str((int(text[first]) + 1) % 10) + text[first + 1:]
    (rec / "README.md").write_text(edited)
    assert check(rec) == ["README.md"]


def test_an_edited_number_in_the_results_fails(tmp_path):
    rec = _copy("fwp-lm", tmp_path)
    csv = (rec / "results.csv").read_text().splitlines()
    cells = csv[1].split(",")
    cells[7] = f"{float(cells[7]) + 0.01:.6g}"  # the first run's loss
    (rec / "results.csv").write_text("\n".join([csv[0], ",".join(cells), *csv[2:]]) + "\n")
    assert "results.md" in check(rec)


def test_a_grown_record_quotes_its_base_from_the_base_record(tmp_path):
    """A record at K times the steps (fwp-lm-4x) quotes the default-size record beside it through
    ``base.`` placeholders: an edited number in the base's results.csv changes its README."""
    grown, base = _copy("fwp-lm-4x", tmp_path), _copy("fwp-lm", tmp_path)
    assert "{{base." in (grown / TEMPLATE).read_text()
    assert check(grown) == []
    csv = (base / "results.csv").read_text().splitlines()
    header = csv[0].split(",")
    row = next(i for i, line in enumerate(csv) if line.split(",")[header.index("model")] == "softmax")
    cells = csv[row].split(",")
    cells[header.index("loss")] = f"{float(cells[header.index('loss')]) + 0.5:.6g}"
    csv[row] = ",".join(cells)
    (base / "results.csv").write_text("\n".join(csv) + "\n")
    assert check(grown) == ["README.md"]
    shutil.rmtree(base)  # no base record beside it: its base placeholders cannot be filled
    with pytest.raises(Exception, match="no base record"):
        check(grown)
