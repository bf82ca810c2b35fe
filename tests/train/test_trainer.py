"""Trainer: loss goes down, schedule, atomic checkpoints, exact resume, 2-process DDP == 1 process
(float64)."""

from __future__ import annotations

import itertools
import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from fastweights.models import LanguageModel, LMConfig
from fastweights.tasks import load_corpus
from fastweights.train import trainer as trainer_module
from fastweights.train.checkpoint import (
    checkpoint_files,
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
)
from fastweights.train.trainer import TrainConfig, Trainer, lr_factor, train
from tests.spawned import assert_same_run, float64_default, free_port, val_loss

TEXT = "".join(f"def f{i}(x):\n    return x * {i % 7} + {i % 5}\n\n" for i in range(400))


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return load_corpus(str(path))


def model_cfg(mixer="delta", **kw) -> LMConfig:
    return LMConfig(d_model=16, n_layers=1, n_heads=2, mixer=mixer, ffn_hidden=32, **kw)


def train_cfg(**kw) -> TrainConfig:
    base = {"steps": 12, "batch_size": 4, "seq_len": 16, "lr": 3e-3, "warmup": 2, "eval_every": 6,
            "eval_windows": 4, "seed": 3}
    return TrainConfig(**{**base, **kw})


def test_tiny_training_lowers_the_loss(tmp_path, corpus):
    losses = train(tmp_path / "run", model_cfg(), train_cfg(steps=40, eval_every=40), corpus,
                   progress=False)
    first, last = sum(x for _, x in losses[:5]) / 5, sum(x for _, x in losses[-5:]) / 5
    assert last < first - 1.0, (first, last)
    rows = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    assert rows[0].startswith("step,split,loss") and any(",val," in r for r in rows)


def test_lr_schedule_warms_up_then_decays():
    cfg = train_cfg(steps=100, warmup=10, min_lr_ratio=0.1)
    f = [lr_factor(s, cfg) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(f[10:]))
    assert f[99] == pytest.approx(0.1, abs=1e-3)


def test_resume_continues_with_identical_losses(tmp_path, corpus):
    full = train(tmp_path / "full", model_cfg(), train_cfg(), corpus, progress=False)
    part = train(tmp_path / "cut", model_cfg(), train_cfg(save_every=5), corpus, stop_after=8,
                 progress=False)  # "killed" after step 8: latest checkpoint is step 5
    assert (tmp_path / "cut" / "checkpoints" / "latest").read_text().strip() == "step-0000005"
    rest = train(tmp_path / "cut", None, None, corpus, resume=True, progress=False)
    assert [s for s, _ in rest] == list(range(6, 13))
    assert part[:5] + rest == full  # bit-identical losses, steps 1..12
    a = LanguageModel.from_pretrained(resolve_checkpoint(tmp_path / "full"))
    b = LanguageModel.from_pretrained(resolve_checkpoint(tmp_path / "cut"))
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    steps = [r.split(",")[0] for r in (tmp_path / "cut" / "metrics.csv").read_text().splitlines()[1:]
             if ",train," in r]
    assert steps == [str(i) for i in range(1, 13)]  # rows of the lost steps 6..8 not duplicated


# Validation losses by step for the early-stopping tests: a new best at 1, 2 and 4; 3 and 5 are
# worse, 6 only equals the best (no new best), so with patience 3 the count reads 1 at 3, 0 at 4,
# then 1, 2, 3 at 5, 6, 7: training stops after step 7.
SCRIPTED_VAL = {1: 5.0, 2: 4.2, 3: 4.5, 4: 3.9, 5: 4.0, 6: 3.9, 7: 4.1, 8: 4.3, 9: 4.4, 10: 4.2,
                11: 4.6, 12: 4.7}


@pytest.fixture
def scripted_validation(monkeypatch) -> None:
    """The trainer's validation returns SCRIPTED_VAL[step] for the step it just trained: the
    early-stopping rule is tested on chosen losses (the real ones of a tiny model are not)."""
    now = {"step": 0}
    real_step = Trainer.train_step

    def train_step(self):
        loss = real_step(self)
        now["step"] = self.step
        return loss

    monkeypatch.setattr(Trainer, "train_step", train_step)
    monkeypatch.setattr(trainer_module, "evaluate", lambda *a, **k: SCRIPTED_VAL[now["step"]])


def _val_steps(run_dir: Path) -> list[int]:
    rows = (run_dir / "metrics.csv").read_text().splitlines()[1:]
    return [int(r.split(",")[0]) for r in rows if ",val," in r]


def test_early_stopping_stops_where_patience_says(tmp_path, corpus, scripted_validation):
    """patience P: training ends after the P-th validation in a row without a new best (an
    equal loss is none), and that step is saved; a new best resets the count; patience 0
    never stops."""
    cfg = train_cfg(eval_every=1, patience=3)
    losses = train(tmp_path / "p3", model_cfg(), cfg, corpus, progress=False)
    assert [s for s, _ in losses] == list(range(1, 8))
    assert _val_steps(tmp_path / "p3") == list(range(1, 8))
    assert resolve_checkpoint(tmp_path / "p3").name == "step-0000007"
    _, _, state = load_checkpoint(tmp_path / "p3")
    assert (state["step"], state["best_val_loss"], state["since_best"]) == (7, 3.9, 3)
    losses = train(tmp_path / "p1", model_cfg(), train_cfg(eval_every=1, patience=1), corpus,
                   progress=False)
    assert losses[-1][0] == 3  # step 3 is the first without a new best
    losses = train(tmp_path / "p0", model_cfg(), train_cfg(eval_every=1), corpus, progress=False)
    assert losses[-1][0] == 12


def test_resume_keeps_the_early_stopping_count(tmp_path, corpus, scripted_validation):
    """A run resumed from a checkpoint whose early-stopping count is above 0 (step 5: best 3.9
    at step 4, one validation since) stops at the same step as the uninterrupted run, with the
    same losses: the count and the best loss are restored, not restarted."""
    cfg = train_cfg(eval_every=1, patience=3, save_every=5)
    full = train(tmp_path / "full", model_cfg(), cfg, corpus, progress=False)
    part = train(tmp_path / "cut", model_cfg(), cfg, corpus, stop_after=6, progress=False)
    _, _, state = load_checkpoint(tmp_path / "cut")
    assert (state["step"], state["best_val_loss"], state["since_best"]) == (5, 3.9, 1)
    rest = train(tmp_path / "cut", None, None, corpus, resume=True, progress=False)
    assert [s for s, _ in full] == list(range(1, 8))
    assert part[:5] + rest == full
    assert _val_steps(tmp_path / "cut") == list(range(1, 8))


def test_resume_restores_the_torch_random_state(tmp_path, corpus):
    """With dropout the training draws from torch's generator every step: a resumed run
    continues from the saved generator state (rng "torch" of the checkpoint) and reproduces the
    uninterrupted run's losses bit for bit."""
    cfg = model_cfg(dropout=0.3)
    full = train(tmp_path / "full", cfg, train_cfg(), corpus, progress=False)
    part = train(tmp_path / "cut", cfg, train_cfg(save_every=5), corpus, stop_after=8,
                 progress=False)
    rest = train(tmp_path / "cut", None, None, corpus, resume=True, progress=False)
    assert part[:5] + rest == full
    no_dropout = train(tmp_path / "plain", model_cfg(), train_cfg(steps=6), corpus, progress=False)
    assert [x for _, x in no_dropout] != [x for _, x in full[:6]]  # dropout did draw


def test_interrupted_save_keeps_latest_complete(tmp_path):
    model = LanguageModel(model_cfg())
    save_checkpoint(tmp_path, 5, model, {"x": 1}, {"step": 5})
    # A crash mid-save leaves a temporary folder and no pointer change.
    broken = tmp_path / "checkpoints" / ".tmp-step-0000010-1"
    broken.mkdir()
    (broken / "config.json").write_text("{")
    ckpt = resolve_checkpoint(tmp_path)
    assert ckpt.name == "step-0000005"
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(checkpoint_files())
    _, opt, state = load_checkpoint(tmp_path)
    assert opt == {"x": 1} and state == {"step": 5}
    save_checkpoint(tmp_path, 10, model, {"x": 2}, {"step": 10})
    assert resolve_checkpoint(tmp_path).name == "step-0000010"


def _ddp_worker(rank: int, world: int, port: int, run_dir: str, corpus_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                      RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    losses = train(run_dir, model_cfg(), train_cfg(steps=6, eval_every=6), load_corpus(corpus_path),
                   progress=False)
    Path(run_dir, f"losses-{rank}.json").write_text(json.dumps(losses))
    assert not torch.distributed.is_initialized()  # train() tears down the group it created


def test_two_process_ddp_equals_one_process(tmp_path, corpus):
    """Float64 end to end: losses, validation loss and weights within TOL64 (tests/spawned.py)."""
    with float64_default():
        one = train(tmp_path / "one", model_cfg(), train_cfg(steps=6, eval_every=6), corpus,
                    progress=False)
    (tmp_path / "corpus.txt").write_text(TEXT)
    mp.spawn(_ddp_worker, args=(2, free_port(), str(tmp_path / "two"), str(tmp_path / "corpus.txt")),
             nprocs=2, join=True)
    for rank in (0, 1):
        two = json.loads((tmp_path / "two" / f"losses-{rank}.json").read_text())
        assert_same_run(two, tmp_path / "two", one, tmp_path / "one")


def test_a_float64_model_trains_and_validates_in_float64(tmp_path, corpus):
    """Its training and validation losses are float64 cross-entropies, not float32 ones (a
    float64 value is float32-representable by chance with probability ~2^-29)."""
    with float64_default():
        losses = train(tmp_path / "run", model_cfg(), train_cfg(steps=2, eval_every=2), corpus,
                       progress=False)
    values = [x for _, x in losses] + [val_loss(tmp_path / "run")]
    assert all(float(torch.tensor(x, dtype=torch.float32)) != x for x in values), values


def test_recompute_trains_to_the_same_losses(tmp_path, corpus):
    plain = train(tmp_path / "plain", model_cfg(), train_cfg(steps=3, eval_every=3), corpus,
                  progress=False)
    recomputed = train(tmp_path / "ck", model_cfg(), train_cfg(steps=3, eval_every=3, recompute=True),
                       corpus, progress=False)
    assert [s for s, _ in plain] == [s for s, _ in recomputed]
    assert max(abs(a - b) for (_, a), (_, b) in zip(plain, recomputed)) < 1e-5
    assert json.loads((tmp_path / "ck" / "run.json").read_text())["train"]["recompute"] is True


def test_bf16_autocast_trains_with_float32_weights(tmp_path, corpus):
    losses = train(tmp_path / "bf16", model_cfg(), train_cfg(steps=3, eval_every=3, bf16=True),
                   corpus, progress=False)
    assert len(losses) == 3 and all(math.isfinite(x) for _, x in losses)
    model = LanguageModel.from_pretrained(resolve_checkpoint(tmp_path / "bf16"))
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_ttt_mlp_inner_learning_rate_ramps_over_warmup():
    """docs/maths.md 2.6: TTT-MLP's eta is scaled by a multiplier ramping linearly 0.1 -> 1 over the
    outer warm-up; TTT-Linear has no ramp."""
    from fastweights import build_mixer
    from fastweights.train.trainer import set_inner_lr_ramp

    model = LanguageModel(LMConfig(d_model=16, n_layers=2, n_heads=2, mixer=["ttt-mlp", "ttt-linear"]))
    mlp, lin = model.blocks[0].mixer, model.blocks[1].mixer
    for step, expected in [(0, 0.1), (5, 0.1 + 0.9 * 0.5), (10, 1.0), (50, 1.0)]:
        set_inner_lr_ramp(model, step, warmup=10)
        assert abs(mlp.eta_scale - expected) < 1e-12 and lin.eta_scale == 1.0
    set_inner_lr_ramp(model, 0, warmup=0)
    assert mlp.eta_scale == 1.0
    # the multiplier acts exactly as a smaller eta_base
    torch.manual_seed(0)
    a = build_mixer("ttt-mlp", 16, 2).double()
    b = build_mixer("ttt-mlp", 16, 2, eta_base=0.01).double()
    b.load_state_dict(a.state_dict())
    a.eta_scale = 0.1
    x = torch.randn(1, 7, 16, dtype=torch.float64)
    assert torch.allclose(a(x)[0], b(x)[0], atol=1e-12)
