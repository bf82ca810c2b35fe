"""Gradient accumulation (``TrainConfig.grad_accum``, ``fastweights train --grad-accum K``): K
micro-batches of ``batch_size`` rows per optimiser step train exactly as one batch of K x
``batch_size`` rows (same data, same mean loss, same gradient), in one process, under DDP and
under context parallelism.

Float64 models, float64 end to end (the cross-entropy, the validation loss, the reductions
across ranks), compared within ``TOL64`` (its derivation: tests/spawned.py). The two-process
cases share one spawned world.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from fastweights.cli import main
from fastweights.models import LMConfig
from fastweights.tasks import load_corpus
from fastweights.train.trainer import TrainConfig, train
from tests.spawned import assert_same_run, float64_default, free_port, worker_env

TEXT = "".join(f"def h{i}(z):\n    return z + {i % 6} * {i % 5}\n\n" for i in range(300))


def model_cfg() -> LMConfig:
    return LMConfig(d_model=16, n_layers=1, n_heads=2, mixer="delta", ffn_hidden=32)


def train_cfg(**kw) -> TrainConfig:
    base = {"steps": 3, "batch_size": 4, "seq_len": 16, "lr": 3e-3, "warmup": 1, "eval_every": 3,
            "eval_windows": 2, "seed": 7}
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def corpus_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("accum-corpus") / "corpus.txt"
    path.write_text(TEXT)
    return path


@pytest.fixture(scope="module")
def docs_path(tmp_path_factory) -> Path:
    """A folder corpus of 80 short documents of unequal lengths: packed windows cross document
    boundaries, whose targets are ignored (-100), so the micro-batches of a step predict
    different numbers of tokens."""
    root = tmp_path_factory.mktemp("accum-docs")
    for i in range(80):
        (root / f"doc{i:02d}.txt").write_text(f"def d{i}(z): return z * {i % 9}\n" * (1 + i % 4))
    return root


@pytest.fixture(scope="module")
def single(tmp_path_factory, corpus_path, docs_path) -> dict[str, tuple[list, Path]]:
    """One process, float64: (losses, run folder) of one batch of 4 rows per step, and of 2
    micro-batches of 2 rows, with and without packing (packed: on the corpus of many
    documents, where the micro-batches' token counts weigh their losses)."""
    root = tmp_path_factory.mktemp("accum-one")
    corpus, docs = load_corpus(str(corpus_path)), load_corpus(str(docs_path))
    cases = {"whole": {}, "accum": {"batch_size": 2, "grad_accum": 2},
             "whole-pack": {"pack": True}, "accum-pack": {"batch_size": 2, "grad_accum": 2,
                                                         "pack": True}}
    with float64_default():
        return {name: (train(root / name, model_cfg(), train_cfg(**kw),
                             docs if kw.get("pack") else corpus, progress=False),
                       root / name) for name, kw in cases.items()}


def _worker(rank: int, world: int, port: int, root: str) -> None:
    worker_env(rank, world, port)
    corpus = load_corpus(str(Path(root) / "corpus.txt"))
    cfg = train_cfg(batch_size=2, grad_accum=2)
    out = {"ddp": train(Path(root) / "ddp", model_cfg(), cfg, corpus, progress=False),
           "cp": train(Path(root) / "cp", model_cfg(), cfg, corpus, progress=False,
                       context_parallel=2)}
    torch.distributed.destroy_process_group()
    Path(root, f"rank{rank}.json").write_text(json.dumps(out))


@pytest.fixture(scope="module")
def world2(tmp_path_factory, corpus_path) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("accum-2")
    (root / "corpus.txt").write_text(corpus_path.read_text())
    mp.spawn(_worker, args=(2, free_port(), str(root)), nprocs=2, join=True)
    return root, [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("pack", [False, True], ids=["windows", "packed"])
def test_two_micro_batches_equal_one_batch_of_twice_the_rows(single, pack):
    suffix = "-pack" if pack else ""
    assert_same_run(*single["accum" + suffix], *single["whole" + suffix])
    record = json.loads((single["accum" + suffix][1] / "run.json").read_text())
    assert record["train"]["grad_accum"] == 2


@pytest.mark.parametrize("case", ["ddp", "cp"])
def test_accumulation_across_two_processes_equals_one_batch(world2, single, case):
    root, records = world2
    for rec in records:
        assert_same_run(rec[case], root / case, *single["whole"])


@pytest.mark.parametrize("kw, message", [
    ({"grad_accum": 0}, "grad_accum must be a positive int"),
    ({"grad_accum": 1.5}, "grad_accum must be a positive int"),
    ({"grad_accum": 2, "carry_state": True}, "grad_accum 2 is not supported with carry_state"),
])
def test_bad_grad_accum_is_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        train_cfg(**kw)


def test_cli_grad_accum_is_recorded_and_resume_keeps_it(tmp_path, corpus_path, capsys):
    run = tmp_path / "run"
    args = ["--data", str(corpus_path), "--out", str(run), "--seq-len", "16", "--batch-size", "2",
            "--d-model", "16", "--n-layers", "1", "--n-heads", "2", "--eval-every", "2",
            "--eval-windows", "1", "--quiet"]
    assert main(["train", *args, "--steps", "2", "--grad-accum", "2"]) == 0
    assert json.loads((run / "run.json").read_text())["train"]["grad_accum"] == 2
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--steps", "3", "--grad-accum", "3",
                 "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--grad-accum 3 (the run has 2)" in err, err
    assert main(["train", *args, "--out", str(tmp_path / "bad"), "--grad-accum", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "grad_accum must be a positive int" in err, err
    assert not (tmp_path / "bad" / "run.json").exists()
