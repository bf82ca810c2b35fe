"""`fastweights train --resume`, `--overwrite` and `eval` on a folder of the user's own text files,
as a user runs them: the CLI in a subprocess.

Resuming takes every setting from run.json (data included) and refuses an option that
contradicts it; --overwrite touches the earlier run only once the new one is checked; an
extended run's first new step uses the new total's learning-rate schedule.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fastweights.cli import main
from fastweights.cli.main import build_parser
from fastweights.train import metrics, trainer
from fastweights.train.trainer import RUN_FILE, TrainConfig, lr_factor

TINY = ["--seq-len", "16", "--batch-size", "4", "--d-model", "16", "--n-heads", "2",
        "--n-layers", "2", "--mixer", "softmax,delta", "--lr", "0.003", "--warmup", "2",
        "--eval-every", "3", "--eval-windows", "2", "--seed", "5", "--quiet"]


def fastweights(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "fastweights", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def one_line(res: subprocess.CompletedProcess) -> str:
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.fixture
def home(tmp_path) -> Path:
    """The user's working folder with their own texts in ``my_texts/``."""
    texts = tmp_path / "home" / "my_texts"
    texts.mkdir(parents=True)
    for i in range(6):
        (texts / f"note{i}.txt").write_text("".join(
            f"Note {i}.{j}: the {['cat', 'dog', 'owl'][(i + j) % 3]} sat on mat {j % 7}.\n"
            for j in range(120)))
    return tmp_path / "home"


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def train_rows(run: Path) -> list[dict[str, str]]:
    with open(run / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def losses(run: Path) -> list[tuple[str, ...]]:
    return [(r["step"], r["split"], r["loss"], r["lr"]) for r in train_rows(run)]


def test_resume_takes_the_runs_own_data_and_settings(home, tmp_path):
    """`--resume` without --data, from another working folder, continues on the run's
    own texts with its own settings: the rows after the checkpoint are the uninterrupted run's."""
    res = fastweights("train", "--data", "my_texts", "--out", "run", "--steps", "6",
                      "--save-every", "2", *TINY, cwd=home)
    assert res.returncode == 0, res.stderr
    run = home / "run"
    record = json.loads((run / RUN_FILE).read_text())
    assert record["data"] == str((home / "my_texts").resolve())  # absolute: cwd-independent
    full = losses(run)
    # A crash after step 2: later checkpoints gone, metrics.csv still holds every row.
    for step in (4, 6):
        shutil.rmtree(run / "checkpoints" / f"step-{step:07d}")
    (run / "checkpoints" / "latest").write_text("step-0000002\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    res = fastweights("train", "--out", str(run), "--resume", "--quiet", cwd=elsewhere)
    assert res.returncode == 0, res.stderr
    assert losses(run) == full  # same data, same settings: the same losses and rates
    assert json.loads((run / RUN_FILE).read_text()) == record  # nothing rewritten to defaults


def test_resume_refuses_options_that_contradict_the_run(home, tmp_path, capsys, monkeypatch):
    """An option given on resume that differs from run.json is one line naming it, exit
    2, and the run is untouched; one equal to the record is accepted; the resumable ones are
    applied and recorded. "Given" means on the command line, not "different from the default"."""
    run = home / "run"
    assert main(["train", "--data", str(home / "my_texts"), "--out", str(run), "--steps", "3",
                 *TINY]) == 0
    before = snapshot(run)
    res = fastweights("train", "--out", "run", "--resume", "--lr", "0.01", cwd=home)
    assert res.returncode == 2 and re.search(r"--lr 0\.01 \(the run has 0\.003\)", one_line(res))
    other = tmp_path / "other_texts"
    shutil.copytree(home / "my_texts", other)
    capsys.readouterr()
    for option, value in [("--mixer", "delta"), ("--batch-size", "8"), ("--data", str(other)),
                          ("--d-model", "128"),  # the default, but not this run's 16
                          ("--pack", None), ("--seed", "0"), ("--steps", "2")]:
        args = [option] if value is None else [option, value]
        assert main(["train", "--out", str(run), "--resume", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{option.lstrip('-')} {value or ''}" in err, err
    assert snapshot(run) == before
    # The run's own values (not the defaults) are accepted, the data path relative or not.
    monkeypatch.chdir(home)
    assert main(["train", "--out", "run", "--resume", "--data", "my_texts", "--seq-len", "16",
                 "--mixer", "softmax,delta", "--d-model", "16", "--steps", "5", "--save-every",
                 "1", "--keep-last", "2", "--eval-every", "5", "--quiet"]) == 0
    saved = json.loads((run / RUN_FILE).read_text())["train"]
    assert (saved["steps"], saved["save_every"], saved["keep_last"], saved["eval_every"]) == (5, 1, 2, 5)
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-0000004", "step-0000005"]


def test_resumable_options_are_the_trainers(home):
    """Every setting the trainer lets a resumed run change is a `train` run setting (one the
    parser can tell given from left out) and a TrainConfig field, and --help names each."""
    parser = build_parser()
    args = parser.parse_args(["train"])
    assert set(trainer.RESUMABLE) <= set(args.setting_defaults)
    assert set(trainer.RESUMABLE) <= {f for f in TrainConfig.__dataclass_fields__}
    train_parser = parser._subparsers._group_actions[0].choices["train"]
    for dest in trainer.RESUMABLE:
        assert "--" + dest.replace("_", "-") in train_parser.description


def test_eval_defaults_to_the_runs_data(home, capsys):
    """`eval --checkpoint RUN` (or one of its checkpoint folders) reads the run's data."""
    run = home / "run"
    assert main(["train", "--data", str(home / "my_texts"), "--out", str(run), "--steps", "2",
                 "--save-every", "1", *TINY]) == 0
    res = fastweights("eval", "--checkpoint", "run", "--seq-len", "16", "--windows", "2", cwd=home)
    assert res.returncode == 0, res.stderr
    default = json.loads(res.stdout)
    assert default["data"] == str((home / "my_texts").resolve())
    capsys.readouterr()
    for checkpoint, data in [(run / "checkpoints" / "step-0000002", []),
                             (run, ["--data", str(home / "my_texts")])]:
        assert main(["eval", "--checkpoint", str(checkpoint), "--seq-len", "16", "--windows",
                     "2", *data]) == 0
        assert json.loads(capsys.readouterr().out)["loss"] == default["loss"]


def test_overwrite_keeps_the_earlier_run_until_the_new_one_is_checked(home, capsys):
    """`--overwrite` with a mistake (missing data, a config only the first forward
    rejects, data too short for --seq-len) exits 2 and leaves the earlier run as it was."""
    run = home / "run"
    assert main(["train", "--data", str(home / "my_texts"), "--out", str(run), "--steps", "2",
                 *TINY]) == 0
    (run / "notes.txt").write_text("mine\n")
    before = snapshot(run)
    res = fastweights("train", "--out", "run", "--overwrite", "--data", "typo/", *TINY, cwd=home)
    assert res.returncode == 2 and "does not exist" in one_line(res)
    assert snapshot(run) == before
    (home / "short.txt").write_text("tiny text\n")
    capsys.readouterr()
    for args in (["--mixer", "aft-full:max_len=8", "--data", "my_texts"],
                 ["--data", str(home / "short.txt")],
                 ["--keep-last", "0", "--data", "my_texts"]):
        assert main(["train", "--out", str(run), "--overwrite", *TINY, *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert snapshot(run) == before
    assert main(["train", "--out", str(run), "--overwrite", "--data", str(home / "my_texts"),
                 "--steps", "1", *TINY]) == 0
    assert (run / "notes.txt").read_text() == "mine\n"
    assert json.loads((run / RUN_FILE).read_text())["train"]["steps"] == 1
    assert not list(run.glob(".replaced-*"))


def test_overwrite_puts_the_earlier_run_back_when_writing_fails(home, monkeypatch, capsys):
    """A failure while the new run writes its first files (disk full) restores the
    earlier run's files."""
    run = home / "run"
    assert main(["train", "--data", str(home / "my_texts"), "--out", str(run), "--steps", "2",
                 *TINY]) == 0
    before = snapshot(run)
    real = metrics.write_atomic

    def full_disk(path, data):
        if Path(path).name == "metrics.csv":
            raise OSError(28, "No space left on device")
        real(path, data)

    monkeypatch.setattr(metrics, "write_atomic", full_disk)
    assert main(["train", "--data", str(home / "my_texts"), "--out", str(run), "--steps", "3",
                 "--overwrite", *TINY]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert snapshot(run) == before and not list(run.glob(".replaced-*"))


def test_extended_run_uses_the_new_totals_schedule(home):
    """`--resume --steps 12` after a finished 6-step run: the learning rate of step 7 is
    the 12-step schedule's value at step index 6, not the 6-step schedule's final rate."""
    res = fastweights("train", "--data", "my_texts", "--out", "run", "--steps", "6", *TINY, cwd=home)
    assert res.returncode == 0, res.stderr
    res = fastweights("train", "--out", "run", "--resume", "--steps", "12", "--quiet", cwd=home)
    assert res.returncode == 0, res.stderr
    lrs = {int(r["step"]): float(r["lr"]) for r in train_rows(home / "run") if r["split"] == "train"}
    assert sorted(lrs) == list(range(1, 13))
    old = TrainConfig(steps=6, lr=0.003, warmup=2)
    new = TrainConfig(steps=12, lr=0.003, warmup=2)
    assert lrs[6] == pytest.approx(0.003 * lr_factor(5, old), rel=1e-5)
    assert lrs[7] == pytest.approx(0.003 * lr_factor(6, new), rel=1e-5)
    assert lrs[7] > 2 * 0.003 * lr_factor(6, old)  # not the old schedule's final rate
    assert lrs[12] == pytest.approx(0.003 * lr_factor(11, new), rel=1e-5)
