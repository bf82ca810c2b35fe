"""Ctrl-C (SIGINT) and SIGTERM sent to a real `fastweights train` process, and checkpoint
retention (`--keep-last`).

A signal during training saves a checkpoint of the last finished step (with the default
--save-every 0, the only checkpoint) and exits 130 (SIGINT) or 143 (SIGTERM) with one line;
resuming from it reproduces the uninterrupted run. A signal during start-up is one line too.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fastweights.cli import main
from fastweights.models import LanguageModel, LMConfig
from fastweights.train.checkpoint import (
    LATEST,
    checkpoint_problem,
    prune_checkpoints,
    resolve_checkpoint,
    save_checkpoint,
)
from fastweights.train.trainer import RUN_FILE

TEXT = "".join(f"def f{i}(x):\n    return x * {i % 7} + {i % 5}\n\n" for i in range(300))
STEPS = 150
ARGS = ["--steps", str(STEPS), "--seq-len", "16", "--batch-size", "4", "--d-model", "16",
        "--n-layers", "1", "--n-heads", "2", "--eval-every", "50", "--eval-windows", "2",
        "--warmup", "5", "--seed", "2", "--quiet"]


@pytest.fixture
def texts(tmp_path) -> Path:
    folder = tmp_path / "texts"
    folder.mkdir()
    for i in range(3):
        (folder / f"part{i}.py").write_text(TEXT[i * 3000:(i + 1) * 3000 + 3000])
    return folder


def launch(*args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "fastweights", "train", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def rows(run: Path) -> list[tuple[str, str, str]]:
    """(step, split, loss) of every complete metrics.csv row."""
    lines = [line for line in (run / "metrics.csv").read_text().splitlines(keepends=True)
             if line.endswith("\n")]
    return [(r["step"], r["split"], r["loss"]) for r in csv.DictReader(lines)]


def trained(run: Path) -> int:
    try:
        return max((int(s) for s, split, _ in rows(run) if split == "train"), default=0)
    except (OSError, ValueError):
        return 0


def wait_until(proc: subprocess.Popen, ready, limit: float = 120.0) -> None:
    end = time.monotonic() + limit
    while not ready():
        assert proc.poll() is None, f"exited {proc.returncode} first: {proc.stderr.read()}"
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_saves_a_checkpoint_and_resuming_reproduces_the_run(tmp_path, texts, sig, code):
    reference = launch("--data", str(texts), "--out", str(tmp_path / "reference"), *ARGS)
    run = tmp_path / "run"
    proc = launch("--data", str(texts), "--out", str(run), *ARGS)  # default --save-every 0
    wait_until(proc, lambda: trained(run) >= 3)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    err = err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    step = trained(run)
    assert 3 <= step < STEPS
    name = f"step-{step:07d}"
    assert signal.Signals(sig).name in err and name in err and "--resume" in err
    assert (run / "checkpoints" / LATEST).read_text().strip() == name
    assert [p.name for p in (run / "checkpoints").glob("step-*")] == [name]  # only this save
    assert checkpoint_problem(run / "checkpoints" / name) is None

    resumed = launch("--out", str(run), "--resume", "--quiet")
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()
    assert reference.wait(timeout=300) == 0, reference.stderr.read()
    assert rows(run) == rows(tmp_path / "reference")  # every step once, identical losses
    a = LanguageModel.from_pretrained(resolve_checkpoint(run)).state_dict()
    b = LanguageModel.from_pretrained(resolve_checkpoint(tmp_path / "reference")).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)


def _torch_loaded(pid: int) -> bool:
    """Process ``pid`` has begun importing torch (its library is mapped): start-up is under way."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc to time the signal")
@pytest.mark.parametrize(("sig", "code", "word"), [(signal.SIGINT, 130, "interrupted"),
                                                   (signal.SIGTERM, 143, "terminated")])
def test_signal_during_start_up_is_one_line(tmp_path, texts, sig, code, word):
    run = tmp_path / "run"
    proc = launch("--data", str(texts), "--out", str(run), *ARGS)
    wait_until(proc, lambda: _torch_loaded(proc.pid))
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert err.strip() == f"fastweights: {word}"
    assert not (run / RUN_FILE).exists()


def test_keep_last_on_the_command_line(tmp_path, texts, capsys):
    run = tmp_path / "run"
    assert main(["train", "--data", str(texts), "--out", str(run), *ARGS, "--steps", "10",
                 "--save-every", "2", "--keep-last", "2"]) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        LATEST, "step-0000008", "step-0000010"]
    capsys.readouterr()
    assert main(["train", "--data", str(texts), "--out", str(tmp_path / "new"), *ARGS,
                 "--keep-last", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "keep_last must be a positive int" in err


def _save(run: Path, step: int) -> Path:
    torch.manual_seed(step)
    model = LanguageModel(LMConfig(d_model=8, n_layers=1, n_heads=2, ffn_hidden=8))
    return save_checkpoint(run, step, model, {"x": torch.ones(2)}, {"step": step})


def test_prune_keeps_the_newest_complete_checkpoints(tmp_path):
    for step in (1, 2, 3, 4, 5):
        _save(tmp_path, step)
    ckpts = tmp_path / "checkpoints"
    # step 4 is damaged: it does not count, so steps 5 and 3 are the two kept complete ones
    (ckpts / "step-0000004" / "optimizer.pt").write_bytes(b"damaged")
    deleted = prune_checkpoints(tmp_path, 2)
    assert [p.name for p in deleted] == ["step-0000001", "step-0000002"]
    assert sorted(p.name for p in ckpts.glob("step-*")) == ["step-0000003", "step-0000004",
                                                           "step-0000005"]
    assert not list(ckpts.glob(".tmp-*"))


def test_prune_never_deletes_latest_or_the_newest_intact_one(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step)
    ckpts = tmp_path / "checkpoints"
    (ckpts / "step-0000003" / "model.safetensors").write_bytes(b"damaged")  # latest is damaged
    (ckpts / "step-0000002" / "config.json").unlink()
    assert [p.name for p in prune_checkpoints(tmp_path, 1)] == []  # step 1: the newest intact
    (ckpts / LATEST).write_text("step-0000001\n")  # latest names the oldest: nothing is older
    _newer = ckpts / "step-0000009"
    _newer.mkdir()  # saved but never published: not a candidate
    assert prune_checkpoints(tmp_path, 1) == []
    assert _newer.is_dir() and (ckpts / "step-0000001").is_dir()
    (ckpts / LATEST).unlink()
    assert prune_checkpoints(tmp_path, 1) == []  # no latest: nothing is deleted
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="keep_last"):
            prune_checkpoints(tmp_path, bad)
