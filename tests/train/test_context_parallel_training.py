"""Context-parallel training (``train(..., context_parallel=N)``, ``fastweights train
--context-parallel N``): the same losses as one process on the same global batch.

The models are float64 (default dtype set in every process), float64 end to end (the
cross-entropy, the validation loss, the reductions across ranks), so that the only differences
are summation order: within ``TOL64`` (its derivation: tests/spawned.py). Each world size is spawned once for the module; the workers record their losses, validation
losses and refusals in JSON files that the tests read.
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
from tests.spawned import (
    assert_same_losses,
    assert_same_run,
    float64_default,
    free_port,
    worker_env,
)

TEXT = "".join(f"def g{i}(y):\n    return y - {i % 9} * {i % 4}\n\n" for i in range(300))
# (id, mixer, options): one per strategy family the trainer meets (scan with a transition, plain
# sum scan, gather, relay).
MIXERS = [("delta", "delta", {}), ("linear", "linear", {}), ("softmax", "softmax", {}),
          ("ttt-linear", "ttt-linear", {"mini_batch_size": 4})]


def model_cfg(mixer: str, options: dict) -> LMConfig:
    return LMConfig(d_model=16, n_layers=1, n_heads=2, mixer=mixer, mixer_options=options,
                    ffn_hidden=32)


def train_cfg(**kw) -> TrainConfig:
    base = {"steps": 3, "batch_size": 4, "seq_len": 16, "lr": 3e-3, "warmup": 1, "eval_every": 3,
            "eval_windows": 2, "seed": 5}
    return TrainConfig(**{**base, **kw})


def _worker(rank: int, world: int, port: int, root: str, cases: list[str]) -> None:
    worker_env(rank, world, port)
    corpus = load_corpus(str(Path(root) / "corpus.txt"))
    out: dict[str, object] = {}
    for case_id, mixer, options in MIXERS:
        if case_id in cases:
            out[case_id] = train(Path(root) / f"cp-{case_id}", model_cfg(mixer, options), train_cfg(),
                                 corpus, progress=False, context_parallel=2)
    if "resume" in cases:  # killed after step 2 (saved: step 1), then resumed to step 3
        run = Path(root) / "cp-resume"
        train(run, model_cfg("delta", {}), train_cfg(save_every=1), corpus, progress=False,
              context_parallel=2, stop_after=2)
        out["resume"] = train(run, None, None, corpus, resume=True, progress=False,
                              context_parallel=2)
    if "refuse-diag" in cases:  # shards of 8 tokens, blocks of 3: refused on every rank
        try:
            train(Path(root) / "cp-diag", model_cfg("diag", {"block_size": 3}), train_cfg(),
                  corpus, progress=False, context_parallel=2)
            out["refuse-diag"] = "no error"
        except ValueError as err:
            out["refuse-diag"] = str(err)
    torch.distributed.destroy_process_group()
    Path(root, f"rank{rank}.json").write_text(json.dumps(out))


def _spawn(root: Path, world: int, cases: list[str]) -> list[dict]:
    (root / "corpus.txt").write_text(TEXT)
    mp.spawn(_worker, args=(world, free_port(), str(root), cases), nprocs=world, join=True)
    return [json.loads((root / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def corpus_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cp-corpus") / "corpus.txt"
    path.write_text(TEXT)
    return path


@pytest.fixture(scope="module")
def single(tmp_path_factory, corpus_path) -> dict[str, tuple[list, Path]]:
    """One process, float64: (losses, run folder) per case."""
    root = tmp_path_factory.mktemp("one")
    corpus = load_corpus(str(corpus_path))
    with float64_default():
        return {case_id: (train(root / case_id, model_cfg(mixer, options), train_cfg(), corpus,
                                progress=False), root / case_id)
                for case_id, mixer, options in MIXERS}


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("cp2")
    return root, _spawn(root, 2, [c[0] for c in MIXERS] + ["resume", "refuse-diag"])


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> tuple[Path, list[dict]]:
    """2 context-parallel ranks x 2 data-parallel replicas."""
    root = tmp_path_factory.mktemp("cp4")
    return root, _spawn(root, 4, ["delta", "ttt-linear"])


@pytest.mark.parametrize("case_id", [c[0] for c in MIXERS])
def test_context_parallel_2_equals_one_process(world2, single, case_id):
    root, records = world2
    for rec in records:
        assert_same_run(rec[case_id], root / f"cp-{case_id}", *single[case_id])


@pytest.mark.parametrize("case_id", ["delta", "ttt-linear"])
def test_context_parallel_2_times_data_parallel_2_equals_one_process(world4, single, case_id):
    root, records = world4
    for rec in records:
        assert_same_run(rec[case_id], root / f"cp-{case_id}", *single[case_id])


def test_context_parallel_resume_reproduces_the_run(world2):
    _, records = world2
    for rec in records:
        assert [s for s, _ in rec["resume"]] == [2, 3]  # from the checkpoint of step 1
        assert_same_losses(rec["resume"], rec["delta"][1:])


def test_shard_off_a_block_border_is_refused_on_every_rank(world2):
    root, records = world2
    for rec in records:
        assert "DiagAttention needs every shard to start on a block border" in rec["refuse-diag"]
    assert not (root / "cp-diag" / "run.json").exists()  # refused before anything is written


@pytest.mark.parametrize("extra, message", [
    (["--seq-len", "15"], "seq_len 15 must be divisible by context_parallel 2"),
    (["--pack"], "pack is not supported with context_parallel 2"),
    ([], "the world size 1 must be a multiple of context_parallel 2"),
    (["--context-parallel", "0"], "must be a positive integer"),
])
def test_cli_refusals_are_one_line_and_exit_2(tmp_path, corpus_path, capsys, extra, message):
    rc = main(["train", "--data", str(corpus_path), "--out", str(tmp_path / "run"), "--steps", "1",
               "--seq-len", "16", "--batch-size", "2", "--d-model", "16", "--quiet",
               "--context-parallel", "2", *extra])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "run" / "run.json").exists()
