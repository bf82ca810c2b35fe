"""FSDP2 training (``train(..., fsdp=True)``, ``fastweights train --fsdp``) and its sharded
checkpoints: the same losses, validation loss and final parameters as one process on the same
global batch, alone, with gradient accumulation and with context parallelism on one 2-D mesh;
bf16 mixed precision within a stated distance of float32; sharded checkpoints that resume on
another world size (and on one process, without FSDP) exactly, that ``--keep-last`` prunes,
whose damaged shard is reported by name, and that ``eval`` reads and ``consolidate_checkpoint``
writes as one file.

One model covers the three families the trainer meets (a delta scan, TTT's relay with an
initial state only the first shard reads, softmax's gather) in a 3-layer stack. Float64 models,
float64 end to end (the cross-entropy, the validation loss, the reductions across ranks), compared
within ``TOL64`` (its derivation: tests/spawned.py). World 4 (2 data shards x 2 context-parallel
ranks) and world 2 are each spawned once for the module; the workers record their losses and
refusals in JSON files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from fastweights.cli import main
from fastweights.models import LMConfig
from fastweights.tasks import load_corpus
from fastweights.train.checkpoint import (
    LATEST,
    checkpoint_problem,
    consolidate_checkpoint,
    load_model,
    resume_point,
)
from fastweights.train.config import check_fsdp
from fastweights.train.trainer import TrainConfig, train
from tests.spawned import (
    assert_same_losses,
    assert_same_params,
    assert_same_run,
    float64_default,
    free_port,
    run_params,
    worker_env,
)

TEXT = "".join(f"def k{i}(w):\n    return w * {i % 8} - {i % 3}\n\n" for i in range(300))
# bf16 parameters in compute (8 bits of mantissa) move this 3-step loss of ~5.5 by 8e-4
# (measured); the bound leaves a factor of 12.
MIXED_TOL = 1e-2


def model_cfg() -> LMConfig:
    return LMConfig(d_model=16, n_layers=3, n_heads=2, mixer=["delta", "ttt-linear", "softmax"],
                    mixer_options=[{}, {"mini_batch_size": 4}, {}], ffn_hidden=32)


def carry_model_cfg() -> LMConfig:
    """Fixed-size states only (carried-state training refuses softmax's growing cache)."""
    return LMConfig(d_model=16, n_layers=2, n_heads=2, mixer=["delta", "ttt-linear"],
                    mixer_options=[{}, {"mini_batch_size": 4}], ffn_hidden=32)


def train_cfg(**kw) -> TrainConfig:
    base = {"steps": 3, "batch_size": 4, "seq_len": 16, "lr": 3e-3, "warmup": 1, "eval_every": 3,
            "eval_windows": 2, "seed": 11, "save_every": 1}
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fsdp")
    (root / "corpus.txt").write_text(TEXT)
    return root


@pytest.fixture(scope="module")
def single(root) -> dict[str, tuple[list, Path]]:
    """One process: (losses, run folder) in float64 ("whole") and float32 ("whole-f32")."""
    corpus = load_corpus(str(root / "corpus.txt"))
    out = {"whole-f32": (train(root / "whole-f32", model_cfg(), train_cfg(), corpus,
                               progress=False), root / "whole-f32")}
    with float64_default():
        out["whole"] = (train(root / "whole", model_cfg(), train_cfg(), corpus, progress=False),
                        root / "whole")
        out["carry"] = (train(root / "carry", carry_model_cfg(), train_cfg(carry_state=True),
                              corpus, progress=False), root / "carry")
        # killed after step 2 (saved, whole: step 1), resumed under FSDP on 2 processes below
        train(root / "whole-stopped", model_cfg(), train_cfg(), corpus, progress=False,
              stop_after=2)
    return out


def _worker(rank: int, world: int, port: int, root: str) -> None:
    worker_env(rank, world, port)
    root_dir = Path(root)
    corpus = load_corpus(str(root_dir / "corpus.txt"))
    out: dict[str, object] = {}
    if world == 4:  # 2 data shards x 2 context-parallel ranks
        out["fsdp-cp"] = train(root_dir / "w4", model_cfg(), train_cfg(), corpus, progress=False,
                               fsdp=True, context_parallel=2)
        # killed after step 2 (saved: step 1): resumed below on 2 processes and on 1
        train(root_dir / "w4-stopped", model_cfg(), train_cfg(), corpus, progress=False,
              fsdp=True, context_parallel=2, stop_after=2)
    else:
        out["fsdp"] = train(root_dir / "w2", model_cfg(), train_cfg(keep_last=2), corpus,
                            progress=False, fsdp=True)
        out["accum"] = train(root_dir / "w2-accum", model_cfg(),
                             train_cfg(batch_size=2, grad_accum=2), corpus, progress=False,
                             fsdp=True)
        out["resume"] = train(root_dir / "w4-on-2", None, None, corpus, resume=True,
                              progress=False, fsdp=True)
        out["carry"] = train(root_dir / "w2-carry", carry_model_cfg(), train_cfg(carry_state=True),
                             corpus, progress=False, fsdp=True)
        out["whole-resume"] = train(root_dir / "whole-on-2", None, None, corpus, resume=True,
                                    progress=False, fsdp=True)
        torch.set_default_dtype(torch.float32)
        out["mixed"] = train(root_dir / "w2-bf16", model_cfg(), train_cfg(), corpus,
                             progress=False, fsdp=True, fsdp_mixed="bf16")
    torch.distributed.destroy_process_group()
    Path(root, f"rank{rank}-of-{world}.json").write_text(json.dumps(out))


def _spawn(root: Path, world: int) -> list[dict]:
    mp.spawn(_worker, args=(world, free_port(), str(root)), nprocs=world, join=True)
    return [json.loads((root / f"rank{r}-of-{world}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def world4(root) -> list[dict]:
    records = _spawn(root, 4)
    for copy in ("w4-on-2", "w4-on-1"):  # the interrupted run, resumed twice
        shutil.copytree(root / "w4-stopped", root / copy)
    return records


@pytest.fixture(scope="module")
def world2(root, single, world4) -> list[dict]:
    shutil.copytree(root / "whole-stopped", root / "whole-on-2")
    return _spawn(root, 2)


@pytest.mark.parametrize("case, run, reference", [
    ("fsdp", "w2", "whole"),
    ("accum", "w2-accum", "whole"),  # 2 micro-batches of 2 rows == one batch of 4
    ("carry", "w2-carry", "carry"),  # carried state (gathered per row at the save)
], ids=["plain", "grad-accum-2", "carry-state"])
def test_fsdp_2_equals_one_process(root, world2, single, case, run, reference):
    for rec in world2:
        assert_same_run(rec[case], root / run, *single[reference])


def test_fsdp_2_times_context_parallel_2_equals_one_process(root, world4, single):
    for rec in world4:
        assert_same_run(rec["fsdp-cp"], root / "w4", *single["whole"])
    shards = sorted(p.name for p in (root / "w4" / "checkpoints" / "step-0000003").glob("*.distcp"))
    assert shards == [f"__{r}_0.distcp" for r in range(4)]  # every rank wrote its shard


def test_bf16_mixed_precision_is_close_to_float32(world2, single):
    for rec in world2:
        assert_same_losses(rec["mixed"], single["whole-f32"][0], tol=MIXED_TOL)


def _assert_resumed_from_step_1(losses: list, run: Path, single: dict) -> None:
    """A run resumed from its checkpoint of step 1 trained steps 2 and 3 as the uninterrupted
    one-process run did, to its final weights."""
    assert [s for s, _ in losses] == [2, 3]
    assert_same_losses(losses, single["whole"][0][1:])
    assert_same_params(run_params(run), run_params(single["whole"][1]))


@pytest.mark.parametrize("case, run", [("resume", "w4-on-2"), ("whole-resume", "whole-on-2")],
                         ids=["fsdp-world-4-checkpoint", "whole-one-process-checkpoint"])
def test_checkpoint_resumes_under_fsdp_2_exactly(root, world2, single, case, run):
    """A sharded checkpoint of 4 ranks (2 x 2 context parallel), and a whole one of one
    process, continue sharded on 2 processes."""
    for rec in world2:
        _assert_resumed_from_step_1(rec[case], root / run, single)
    shards = list((root / run / "checkpoints" / "step-0000003").glob("*.distcp"))
    assert len(shards) == 2  # saved sharded, now by 2 ranks


def test_world_4_checkpoint_resumes_on_one_process_exactly(root, world4, single):
    with float64_default():
        losses = train(root / "w4-on-1", None, None, load_corpus(str(root / "corpus.txt")),
                       resume=True, progress=False)
    _assert_resumed_from_step_1(losses, root / "w4-on-1", single)
    assert (root / "w4-on-1" / "checkpoints" / "step-0000003" / "model.safetensors").is_file()


def test_keep_last_prunes_sharded_checkpoints(root, world2):
    ckpts = root / "w2" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [LATEST, "step-0000002", "step-0000003"]
    assert checkpoint_problem(ckpts / "step-0000003") is None


def test_damaged_shard_is_named_and_nothing_is_overwritten(root, world2, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(root / "w2", run)
    shard = run / "checkpoints" / "step-0000003" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match=r"__1_0\.distcp is corrupted"):
        load_model(run)
    ckpt, problems = resume_point(run)  # a resumed run falls back to the older checkpoint
    assert ckpt.name == "step-0000002" and "__1_0.distcp" in problems[0]
    with pytest.raises(ValueError, match=r"__1_0\.distcp is corrupted"):
        consolidate_checkpoint(run / "checkpoints" / "step-0000003", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert before == {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}


def test_sharded_checkpoint_consolidates_and_evaluates(root, world2, single, tmp_path, capsys):
    out = consolidate_checkpoint(root / "w2", tmp_path / "model")  # in a float32 process
    assert load_file(out / "model.safetensors")["embed.weight"].dtype == torch.float64
    consolidated, sharded = run_params(out), run_params(root / "w2")
    assert all(torch.equal(consolidated[k], sharded[k]) for k in sharded)  # not rounded
    assert_same_params(consolidated, run_params(single["whole"][1]))
    with pytest.raises(ValueError, match="already exists"):
        consolidate_checkpoint(root / "w2", out)
    assert main(["export", str(root / "w2"), "--consolidate", "--out", str(tmp_path / "cli")]) == 0
    a, b = (load_file(f / "model.safetensors") for f in (out, tmp_path / "cli"))
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    assert main(["eval", "--checkpoint", str(root / "w2"), "--data", str(root / "corpus.txt"),
                 "--seq-len", "16", "--windows", "2"]) == 0
    assert "loss" in capsys.readouterr().out


@pytest.mark.parametrize("extra, message", [
    (["--fsdp"], "fsdp shards the model across processes: launch with torchrun"),
    (["--fsdp-mixed", "bf16"], "fsdp_mixed bf16 is FSDP's mixed precision: it needs fsdp"),
    (["--fsdp", "--fsdp-mixed", "fp8"], "invalid choice"),
])
def test_cli_refusals_are_one_line_and_exit_2(tmp_path, root, capsys, extra, message):
    rc = main(["train", "--data", str(root / "corpus.txt"), "--out", str(tmp_path / "run"),
               "--steps", "1", "--seq-len", "16", "--batch-size", "2", "--d-model", "16",
               "--quiet", *extra])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "run" / "run.json").exists()


def test_check_fsdp_refuses_bf16_autocast_with_mixed_precision():
    with pytest.raises(ValueError, match="fsdp_mixed bf16 and bf16 autocast exclude each other"):
        check_fsdp(True, "bf16", 2, train_cfg(bf16=True))
    check_fsdp(True, "bf16", 2, train_cfg())
    check_fsdp(False, None, 1, train_cfg())


SIGNAL_STEPS = 12


def signal_cfg() -> TrainConfig:
    return train_cfg(steps=SIGNAL_STEPS, eval_every=SIGNAL_STEPS, save_every=0)


def _signal_worker(rank: int, world: int, port: int, root: str) -> None:
    """Rank 1 alone is sent SIGTERM once two steps are logged: every rank stops at the same
    step boundary and writes its shard of that step's checkpoint."""
    import os
    import signal
    import threading
    import time

    from fastweights.train.trainer import Trainer, TrainingInterrupted

    worker_env(rank, world, port)
    run = Path(root) / "signalled"

    def send() -> None:
        while True:
            try:
                rows = (run / "metrics.csv").read_text().count(",train,")
            except OSError:
                rows = 0
            if rows >= 2:
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.01)

    if rank == 1:
        threading.Thread(target=send, daemon=True).start()
    out: dict[str, object] = {}
    try:
        train(run, model_cfg(), signal_cfg(), load_corpus(str(Path(root) / "corpus.txt")),
              progress=False, fsdp=True)
        out["stopped"] = None
    except TrainingInterrupted as stop:
        out["stopped"] = [stop.signum, stop.step, None if stop.checkpoint is None else str(stop.checkpoint)]
    # a save before the first step (a signal during start-up's last moments): AdamW still empty
    trainer = Trainer(Path(root) / "step-0", model_cfg(), signal_cfg(),
                      load_corpus(str(Path(root) / "corpus.txt")), progress=False, fsdp=True)
    try:
        trainer.setup()
        trainer.save()
    finally:
        trainer.teardown()
    torch.distributed.destroy_process_group()
    Path(root, f"signal-rank{rank}.json").write_text(json.dumps(out))


def test_sigterm_under_fsdp_saves_a_complete_sharded_checkpoint(root, single, tmp_path):
    import signal

    mp.spawn(_signal_worker, args=(2, free_port(), str(root)), nprocs=2, join=True)
    records = [json.loads((root / f"signal-rank{r}.json").read_text())["stopped"] for r in (0, 1)]
    assert all(rec is not None and rec[0] == signal.SIGTERM for rec in records)
    step = records[0][1]
    assert records[1][1] == step and 2 <= step < SIGNAL_STEPS  # one decision for both ranks
    ckpt = root / "signalled" / "checkpoints" / f"step-{step:07d}"
    assert records[0][2] == str(ckpt) and records[1][2] is None
    assert (ckpt.parent / LATEST).read_text().strip() == ckpt.name
    assert checkpoint_problem(ckpt) is None
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    corpus = load_corpus(str(root / "corpus.txt"))
    with float64_default():
        resumed = train(root / "signalled", None, None, corpus, resume=True, progress=False)
        reference = train(tmp_path / "reference", model_cfg(), signal_cfg(), corpus,
                          progress=False)
        from_step_0 = train(root / "step-0", None, None, corpus, resume=True, progress=False)
    assert [s for s, _ in resumed] == list(range(step + 1, SIGNAL_STEPS + 1))
    assert_same_losses(resumed, reference[step:])
    # FSDP's state-dict helpers give an empty AdamW zero moments at step 1 to save: dropped again
    assert (root / "step-0" / "checkpoints" / "step-0000000" / "__1_0.distcp").is_file()
    assert_same_losses(from_step_0, reference)
