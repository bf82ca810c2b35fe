"""Faults in training and checkpoints: SIGKILL at random moments (mid-save included) then resume
gives the uninterrupted run's losses; truncated or corrupted checkpoint files and run.json are
reported by name; a corrupt latest checkpoint falls back to the previous complete one; disk full
mid-save keeps the previous checkpoint; the anomaly guard; earlier outputs are not overwritten.

The kill tests run ``python -m fastweights train`` as a subprocess with the test hook
``FASTWEIGHTS_TEST_SLOW_SAVE`` (seconds slept before every file of a save, see
fastweights.train.checkpoint) so that a kill can be aimed at the middle of a save.
"""

from __future__ import annotations

import csv
import errno
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import fastweights.models.lm as lm_module
import fastweights.train.checkpoint as ckpt_module
from fastweights.cli import main
from fastweights.models import LanguageModel, LMConfig
from fastweights.tasks import load_corpus
from fastweights.train.checkpoint import (
    LATEST,
    MANIFEST_FILE,
    SLOW_SAVE_ENV,
    CheckpointWriteError,
    checkpoint_files,
    checkpoint_problem,
    load_checkpoint,
    resolve_checkpoint,
    resume_point,
    save_checkpoint,
)
from fastweights.train.trainer import RUN_FILE, TrainConfig, TrainingAnomaly, train

TEXT = "".join(f"def f{i}(x):\n    return x * {i % 7} + {i % 5}\n\n" for i in range(300))
STEPS = 12
CLI_ARGS = ["--steps", str(STEPS), "--seq-len", "16", "--batch-size", "4", "--d-model", "16",
            "--n-layers", "1", "--n-heads", "2", "--eval-every", "6", "--eval-windows", "2",
            "--save-every", "2", "--warmup", "2", "--seed", "3", "--quiet"]


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return path


@pytest.fixture
def corpus(text_file):
    return load_corpus(str(text_file))


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory) -> tuple[Path, Path]:
    """(run folder, corpus file) of one tiny ``fastweights train`` run; tests copy before damaging."""
    root = tmp_path_factory.mktemp("cli_run")
    (root / "corpus.txt").write_text(TEXT)
    assert main(["train", "--data", str(root / "corpus.txt"), "--out", str(root / "run"), *CLI_ARGS]) == 0
    return root / "run", root / "corpus.txt"


def model_cfg() -> LMConfig:
    return LMConfig(d_model=16, n_layers=1, n_heads=2, mixer="delta", ffn_hidden=32)


def train_cfg(**kw) -> TrainConfig:
    base = {"steps": STEPS, "batch_size": 4, "seq_len": 16, "lr": 3e-3, "warmup": 2,
            "eval_every": 6, "eval_windows": 2, "seed": 3}
    return TrainConfig(**{**base, **kw})


def metric_rows(run: Path) -> list[tuple[str, str, str]]:
    """(step, split, loss) of every metrics.csv row, in file order."""
    with open(run / "metrics.csv", newline="") as f:
        return [(r["step"], r["split"], r["loss"]) for r in csv.DictReader(f)]


def latest(run: Path) -> str | None:
    pointer = run / "checkpoints" / LATEST
    return pointer.read_text().strip() if pointer.is_file() else None


# ---------------------------------------------------------------- SIGKILL at random moments

def _launch(run: Path, text_file: Path, resume: bool, slow: float,
            steps: int = STEPS) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", SLOW_SAVE_ENV: str(slow)}
    args = [sys.executable, "-m", "fastweights", "train", "--data", str(text_file), "--out", str(run),
            *CLI_ARGS, "--steps", str(steps), "--resume" if resume else "--overwrite"]
    return subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _step_of(name: str | None) -> int:
    return int(name.split("-")[1]) if name else 0


def _training(run: Path, since_ns: int) -> bool:
    """The launch started at ``since_ns`` has begun training (it rewrote run.json)."""
    path = run / RUN_FILE
    return path.is_file() and path.stat().st_mtime_ns > since_ns


def _tmp_files(run: Path, pid: int) -> int:
    """Files in process ``pid``'s temporary checkpoint folder (-1 when it has none)."""
    return max((len(list(t.iterdir())) for t in (run / "checkpoints").glob(f".tmp-step-*-{pid}")),
               default=-1)


def _unpublished(run: Path, since_ns: int) -> bool:
    """A checkpoint folder completed after ``since_ns`` is in place but ``latest`` does not name
    it yet (between the folder's rename and the ``latest`` update)."""
    done = (p for p in (run / "checkpoints").glob("step-*") if p.stat().st_mtime_ns > since_ns)
    return any(_step_of(p.name) > _step_of(latest(run)) for p in done)


def _kill_when(proc: subprocess.Popen, ready, limit: float = 60.0) -> bool:
    """SIGKILL ``proc`` as soon as ``ready()``; False when it exited first."""
    end = time.monotonic() + limit
    while time.monotonic() < end and proc.poll() is None:
        try:
            hit = ready()
        except OSError:  # a folder renamed or removed while it was listed
            hit = False
        if hit:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.002)
    proc.kill()
    proc.wait()
    return False


def _trigger(moment: str, rng: random.Random, run: Path, pid: int, since: int, base: int):
    """The ``ready()`` test of a kill at ``moment`` (see kill_and_resume)."""
    if moment == "random":
        delay, began = rng.uniform(0.0, 3.0), []

        def ready() -> bool:
            if not began and _training(run, since):
                began.append(time.monotonic())
            return bool(began) and time.monotonic() - began[0] >= delay
        return ready
    if moment == "mid-save":
        files, skip = rng.randint(0, 4), rng.randint(0, 2)
        return lambda: _step_of(latest(run)) >= base + 2 * skip and _tmp_files(run, pid) >= files
    return lambda: _unpublished(run, since)


def kill_and_resume(run: Path, text_file: Path, schedule: list[str], seed: int, slow: float,
                    steps: int = STEPS) -> list[str]:
    """Train ``run`` to the end through one launch per ``schedule`` entry, each SIGKILLed at the
    moment the entry names, then one last launch left to finish. ``random``: a seeded random
    delay (0 to 3 s) after training began; ``mid-save``: while this launch's temporary checkpoint
    folder holds a seeded number of files, after letting 0 to 2 saves through; ``publish``: a
    new checkpoint folder renamed into place but ``latest`` not yet updated. After every kill
    the run folder must resolve to a complete checkpoint (or none yet). Returns one line per
    kill saying where it landed."""
    rng = random.Random(seed)
    outcomes = []
    for moment in schedule:
        since = time.time_ns()
        base = _step_of(latest(run))
        proc = _launch(run, text_file, (run / RUN_FILE).is_file(), slow, steps)
        killed = _kill_when(proc, _trigger(moment, rng, run, proc.pid, since, base))
        done = [int(s) for s, split, _ in metric_rows(run) if split == "train"] if (
            run / "metrics.csv").is_file() else []
        reached = max(done, default=0)
        where = ("during start-up" if not _training(run, since)
                 else f"mid-save ({_tmp_files(run, proc.pid)} files written)"
                 if _tmp_files(run, proc.pid) >= 0
                 else "with a checkpoint in place but latest not updated"
                 if _unpublished(run, since)
                 else "before its first step" if reached == base else "between saves")
        outcomes.append(f"{moment}: {'killed' if killed else 'finished first'} {where}, resumed "
                        f"from step {base}, reached step {reached}, latest {latest(run)}")
        if latest(run) is not None:
            assert checkpoint_problem(resolve_checkpoint(run)) is None
        assert resume_point(run)[1] == []  # nothing damaged: no fallback needed
    proc = _launch(run, text_file, (run / RUN_FILE).is_file(), slow, steps)
    assert proc.wait(timeout=300) == 0, proc.stderr.read().decode()
    return outcomes


def _assert_same_run(run: Path, reference: Path, steps: int = STEPS) -> None:
    rows, expected = metric_rows(run), metric_rows(reference)
    assert rows == expected  # every train and val row exactly once, identical losses
    assert [int(s) for s, split, _ in rows if split == "train"] == list(range(1, steps + 1))
    a = LanguageModel.from_pretrained(resolve_checkpoint(run)).state_dict()
    b = LanguageModel.from_pretrained(resolve_checkpoint(reference)).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_sigkill_at_random_moments_then_resume_gives_identical_losses(tmp_path, text_file):
    reference = _launch(tmp_path / "reference", text_file, False, 0)  # runs alongside
    outcomes = kill_and_resume(tmp_path / "killed", text_file,
                               ["random", "mid-save", "publish", "random"], seed=0, slow=0.1)
    assert reference.wait(timeout=300) == 0, reference.stderr.read().decode()
    assert sum("killed" in o for o in outcomes) >= 2, outcomes
    print("\n".join(outcomes))
    _assert_same_run(tmp_path / "killed", tmp_path / "reference")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_many_sigkills_then_resume_gives_identical_losses(tmp_path, text_file, seed):
    steps = 120
    reference = _launch(tmp_path / "reference", text_file, False, 0, steps)
    rng = random.Random(seed)
    schedule = [rng.choice(["random", "random", "mid-save", "publish"]) for _ in range(12)]
    outcomes = kill_and_resume(tmp_path / "killed", text_file, schedule, seed=seed, slow=0.05,
                               steps=steps)
    assert reference.wait(timeout=300) == 0, reference.stderr.read().decode()
    print("\n".join(outcomes))
    assert sum("killed" in o for o in outcomes) >= 8, outcomes
    _assert_same_run(tmp_path / "killed", tmp_path / "reference", steps)


# ---------------------------------------------------------------- damaged checkpoints

def _saved(tmp_path: Path, step: int = 5) -> Path:
    torch.manual_seed(0)
    return save_checkpoint(tmp_path, step, LanguageModel(model_cfg()), {"x": torch.ones(3)},
                           {"step": step})


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[:len(data) // 2])
    elif how == "flipped":
        i = len(data) // 2
        path.write_bytes(data[:i] + bytes([data[i] ^ 0x10]) + data[i + 1:])
    else:
        path.unlink()


@pytest.mark.parametrize("how", ["truncated", "flipped", "deleted"])
@pytest.mark.parametrize("name", [f for f in checkpoint_files() if f != MANIFEST_FILE])
def test_damaged_checkpoint_file_is_named(tmp_path, name, how):
    ckpt = _saved(tmp_path)
    _damage(ckpt / name, how)
    word = {"truncated": "truncated", "flipped": "corrupted", "deleted": "missing"}[how]
    for load in (load_checkpoint, resolve_checkpoint):
        for where in (tmp_path, ckpt):  # the run folder and the checkpoint folder itself
            with pytest.raises(ValueError, match=re.escape(f"{ckpt / name} is {word}")):
                load(where)


@pytest.mark.parametrize("how", ["truncated", "deleted"])
def test_damaged_manifest_is_named(tmp_path, how):
    ckpt = _saved(tmp_path)
    _damage(ckpt / MANIFEST_FILE, how)
    with pytest.raises(ValueError, match=MANIFEST_FILE):
        load_checkpoint(tmp_path)


def test_model_only_folder_needs_no_manifest(tmp_path):
    LanguageModel(model_cfg()).save_pretrained(tmp_path / "m")
    assert resolve_checkpoint(tmp_path / "m") == tmp_path / "m"


def test_eval_of_a_corrupt_checkpoint_is_one_clear_line(tmp_path, cli_run, capsys):
    run, text_file = shutil.copytree(cli_run[0], tmp_path / "run"), cli_run[1]
    weights = run / "checkpoints" / f"step-{STEPS:07d}" / "model.safetensors"
    _damage(weights, "flipped")
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), "--data", str(text_file), "--windows", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{weights} is corrupted" in err


def test_resume_falls_back_when_the_latest_checkpoint_is_corrupt(tmp_path, corpus, capsys):
    full = train(tmp_path / "full", model_cfg(), train_cfg(), corpus, progress=False)
    cut = tmp_path / "cut"
    train(cut, model_cfg(), train_cfg(save_every=4), corpus, stop_after=10, progress=False)
    bad = cut / "checkpoints" / "step-0000008" / "optimizer.pt"
    _damage(bad, "flipped")
    with pytest.raises(ValueError, match=re.escape(f"{bad} is corrupted")):  # no silent fallback here
        resolve_checkpoint(cut)
    capsys.readouterr()
    rest = train(cut, None, None, corpus, resume=True, progress=False)
    err = capsys.readouterr().err
    assert f"warning: {bad} is corrupted" in err and "step-0000004" in err
    assert full[4:] == rest  # steps 5..12 from the older checkpoint, identical losses
    assert [s for s, split, _ in metric_rows(cut) if split == "train"] == [str(i) for i in range(1, 13)]
    assert checkpoint_problem(cut / "checkpoints" / "step-0000008") is None  # rewritten
    assert latest(cut) == "step-0000012"


def test_resume_with_every_checkpoint_corrupt_says_so(tmp_path, corpus):
    run = tmp_path / "run"
    train(run, model_cfg(), train_cfg(steps=4, save_every=2), corpus, progress=False)
    for step in (2, 4):
        _damage(run / "checkpoints" / f"step-{step:07d}" / "model.safetensors", "truncated")
    with pytest.raises(ValueError, match=r"no complete checkpoint to resume from.*step-0000004"
                                         ".*truncated.*step-0000002.*truncated"):
        train(run, None, None, corpus, resume=True, progress=False)


def test_resume_before_the_first_checkpoint_restarts_at_step_0(tmp_path, corpus, capsys):
    full = train(tmp_path / "full", model_cfg(), train_cfg(steps=4), corpus, progress=False)
    train(tmp_path / "cut", model_cfg(), train_cfg(steps=4), corpus, stop_after=2, progress=False)
    assert latest(tmp_path / "cut") is None
    assert train(tmp_path / "cut", None, None, corpus, resume=True, progress=False) == full
    assert "no checkpoint yet" in capsys.readouterr().err


def test_damaged_run_json_is_named(tmp_path, corpus, text_file, capsys):
    run = tmp_path / "run"
    train(run, model_cfg(), train_cfg(steps=2, save_every=1), corpus, progress=False)
    good = (run / RUN_FILE).read_text()
    (run / RUN_FILE).write_text(good[:len(good) // 2])
    with pytest.raises(ValueError, match=re.escape(f"{run / RUN_FILE} is corrupt")):
        train(run, None, None, corpus, resume=True, progress=False)
    capsys.readouterr()
    assert main(["train", "--resume", "--out", str(run), "--data", str(text_file), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{run / RUN_FILE} is corrupt" in err
    # Still valid JSON but no longer the run the checkpoint belongs to.
    (run / RUN_FILE).write_text(good.replace('"lr": 0.003', '"lr": 0.3'))
    with pytest.raises(ValueError, match=re.escape(f"{run / RUN_FILE} disagrees with ") + ".*train.lr"):
        train(run, None, None, corpus, resume=True, progress=False)


def test_cut_metrics_row_is_dropped_on_resume(tmp_path, corpus):
    full = tmp_path / "full"
    train(full, model_cfg(), train_cfg(), corpus, progress=False)
    cut = tmp_path / "cut"
    train(cut, model_cfg(), train_cfg(save_every=4), corpus, stop_after=9, progress=False)
    with open(cut / "metrics.csv", "a") as f:
        f.write("1")  # a crash in the middle of writing a row (of step 10, say)
    train(cut, None, None, corpus, resume=True, progress=False)
    assert metric_rows(cut) == metric_rows(full)


# ---------------------------------------------------------------- disk full while saving

def _enospc():
    return OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("where", ["weights", "optimizer", "trainer_state", "manifest", "latest"])
def test_disk_full_mid_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch, where):
    before = _saved(tmp_path, 5)
    expected = load_checkpoint(tmp_path)[1]
    real_write = ckpt_module._write_bytes

    def half_then_fail(path, *_args, **_kw):
        with open(path, "wb") as f:
            f.write(b"partial")
        raise _enospc()

    def fail_for(name):
        def write(path, data):
            if Path(path).name == name:
                half_then_fail(path)
            real_write(path, data)
        return write

    if where == "weights":
        monkeypatch.setattr(lm_module, "save_model", lambda model, path: half_then_fail(path))
    elif where == "optimizer":
        monkeypatch.setattr(ckpt_module.torch, "save", lambda obj, path: half_then_fail(path))
    elif where == "trainer_state":
        monkeypatch.setattr(ckpt_module, "_write_bytes", fail_for("trainer_state.json"))
    elif where == "manifest":
        monkeypatch.setattr(ckpt_module, "_write_bytes", fail_for(MANIFEST_FILE))
    else:
        monkeypatch.setattr(ckpt_module, "_write_bytes", fail_for(f".{LATEST}.tmp-{os.getpid()}"))
    with pytest.raises(CheckpointWriteError, match=r"cannot write checkpoint step-0000010 .*No space "
                                                   "left on device; latest still names step-0000005") as info:
        _saved(tmp_path, 10)
    assert info.value.errno == errno.ENOSPC
    monkeypatch.undo()  # space freed
    assert latest(tmp_path) == "step-0000005" and resolve_checkpoint(tmp_path) == before
    assert load_checkpoint(tmp_path)[1]["x"].equal(expected["x"])
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))  # the partial folder is gone
    if where != "latest":
        assert not (tmp_path / "checkpoints" / "step-0000010").exists()
    assert _saved(tmp_path, 10).name == "step-0000010"  # the next save works
    assert latest(tmp_path) == "step-0000010"


def test_disk_full_during_training_is_one_clear_line_then_resumes(tmp_path, cli_run,
                                                                   monkeypatch, capsys):
    (ref, text_file), run = cli_run, tmp_path / "run"
    real_save, calls = torch.save, []

    def full_disk(obj, path):
        calls.append(path)
        if len(calls) == 3:  # the optimizer file of the third checkpoint (step 6)
            raise _enospc()
        real_save(obj, path)

    monkeypatch.setattr(ckpt_module.torch, "save", full_disk)
    capsys.readouterr()
    assert main(["train", "--data", str(text_file), "--out", str(run), *CLI_ARGS]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "No space left on device" in err and "latest still names step-0000004" in err
    monkeypatch.setattr(ckpt_module.torch, "save", real_save)
    assert main(["train", "--resume", "--out", str(run), "--data", str(text_file), "--quiet"]) == 0
    assert metric_rows(run) == metric_rows(ref)


def test_stale_temporary_folders_of_dead_processes_are_removed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / "checkpoints" / f".tmp-step-0000003-{dead.pid}"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"x" * 100)
    _saved(tmp_path, 5)
    assert not stale.exists()


# ---------------------------------------------------------------- anomaly guard

@pytest.fixture
def nan_from_step_7(monkeypatch):
    """Training forward passes return NaN logits from the 7th on (evaluation is untouched)."""
    monkeypatch.setattr(LanguageModel, "forward", LanguageModel.forward)  # restored afterwards
    _nan_forward_from(7)


def test_anomaly_guard_stops_and_keeps_the_last_good_checkpoint(tmp_path, corpus, nan_from_step_7):
    run = tmp_path / "run"
    with pytest.raises(TrainingAnomaly, match=r"at step 7 the training loss is nan.*the last good "
                                              "checkpoint, step-0000006, is kept"):
        train(run, model_cfg(), train_cfg(save_every=2, anomaly_guard=True), corpus, progress=False)
    assert latest(run) == "step-0000006"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        LATEST, "step-0000002", "step-0000004", "step-0000006"]
    model, _, state = load_checkpoint(run)
    assert state["step"] == 6 and all(torch.isfinite(p).all() for p in model.parameters())
    assert [s for s, split, _ in metric_rows(run) if split == "train"] == [str(i) for i in range(1, 7)]


def test_without_the_guard_nonfinite_weights_are_never_saved(tmp_path, corpus, nan_from_step_7):
    run = tmp_path / "run"
    with pytest.raises(ValueError, match=r"refusing to save checkpoint step-0000008.*NaN or inf"):
        train(run, model_cfg(), train_cfg(save_every=2), corpus, progress=False)
    assert latest(run) == "step-0000006"
    assert not (run / "checkpoints" / "step-0000008").exists()


def _nan_forward_from(call: int) -> None:
    """Make training forward passes of this process return NaN logits from the ``call``-th on."""
    real, calls = LanguageModel.forward, []

    def forward(self, *args, **kwargs):
        logits, state = real(self, *args, **kwargs)
        if self.training:
            calls.append(1)
            if len(calls) >= call:
                logits = logits * float("nan")
        return logits, state

    LanguageModel.forward = forward


def _ddp_guard_worker(rank: int, port: int, run_dir: str, corpus_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2",
                      RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if rank == 1:
        _nan_forward_from(3)  # only rank 1 sees the anomaly
    try:
        train(run_dir, model_cfg(), train_cfg(steps=6, save_every=2, anomaly_guard=True),
              load_corpus(corpus_path), progress=False)
        outcome = "finished"
    except TrainingAnomaly as err:
        outcome = str(err)
    # train() created the process group, so it tears it down too, also when it raises
    outcome += f"\ngroup left: {torch.distributed.is_initialized()}"
    Path(run_dir, f"guard-{rank}.txt").write_text(outcome)


def test_anomaly_guard_stops_every_ddp_rank(tmp_path, text_file):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    run = tmp_path / "run"
    ctx = mp.spawn(_ddp_guard_worker, args=(port, str(run), str(text_file)), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:  # a rank left waiting in a collective: a deadlock
            for proc in ctx.processes:
                proc.kill()
            pytest.fail("the anomaly guard left a DDP rank hanging")
    for rank in (0, 1):
        outcome = (run / f"guard-{rank}.txt").read_text()
        assert "anomaly guard: at step 3" in outcome and "group left: False" in outcome
    assert latest(run) == "step-0000002"


def test_anomaly_guard_on_the_command_line(tmp_path, text_file, capsys):
    run = tmp_path / "run"
    args = ["train", "--data", str(text_file), "--out", str(run), *CLI_ARGS, "--lr", "1e30",
            "--warmup", "0", "--save-every", "1", "--anomaly-guard"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "anomaly guard: at step 2 the training loss is nan" in err
    assert latest(run) == "step-0000001" and checkpoint_problem(resolve_checkpoint(run)) is None


# ---------------------------------------------------------------- earlier outputs

def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


@pytest.mark.parametrize("command", ["train", "recall", "bench", "eval"])
def test_earlier_outputs_are_never_overwritten_without_the_flag(tmp_path, cli_run, capsys, command):
    run, text_file = cli_run
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.csv").write_text("earlier\n")
    (out / RUN_FILE).write_text("{}\n")
    args = {
        "train": ["train", "--data", str(text_file), "--out", str(out), *CLI_ARGS],
        "recall": ["recall", "--task", "capacity", "--mixers", "linear", "--sizes", "2", "--d-key",
                   "4", "--steps", "2", "--out", str(out), "--quiet"],
        "bench": ["bench", "--quick", "--mixers", "delta", "--lengths", "8", "--repeats", "1",
                  "--passes", "fwd", "--no-progress", "--out", str(out)],
        # eval prints its result and must write nothing into the checkpoint it reads
        "eval": ["eval", "--checkpoint", str(run), "--data", str(text_file), "--windows", "1"],
    }[command]
    before, run_before = _snapshot(out), _snapshot(run)
    capsys.readouterr()
    rc = main(args)
    err = capsys.readouterr().err.strip()
    if command == "eval":
        assert rc == 0
    else:
        assert rc == 2 and len(err.splitlines()) == 1 and "--overwrite" in err
    assert _snapshot(out) == before and _snapshot(run) == run_before


def test_overwrite_deletes_only_the_commands_own_outputs(tmp_path, cli_run):
    out, text_file = shutil.copytree(cli_run[0], tmp_path / "out"), cli_run[1]
    (out / "notes.txt").write_text("mine\n")
    (out / "checkpoints" / "step-0009999").mkdir()  # a stale checkpoint of the earlier run
    assert main(["train", "--data", str(text_file), "--out", str(out), *CLI_ARGS, "--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == "mine\n"
    assert not (out / "checkpoints" / "step-0009999").exists()
