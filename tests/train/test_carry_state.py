"""Carried-state training (truncated BPTT across windows): the trainer equals a hand-written loop
that carries the detached state over consecutive windows of each row's stream, resumes exactly,
splits exactly over DDP ranks, and refuses what cannot carry a state."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from fastweights.models import LanguageModel, LMConfig
from fastweights.tasks import load_corpus
from fastweights.train.checkpoint import load_checkpoint
from fastweights.train.trainer import TrainConfig, lr_factor, train
from tests.train.test_trainer import _free_port

# Short enough that each of the 4 rows' streams (about 350 bytes) wraps within 12 steps of 16.
TEXT = "".join(f"def g{i}(x):\n    return x - {i % 9}\n\n" for i in range(45))


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return load_corpus(str(path))


def model_cfg(mixer="delta", **kw) -> LMConfig:
    return LMConfig(d_model=16, n_layers=2, n_heads=2, mixer=mixer, ffn_hidden=32, **kw)


def train_cfg(**kw) -> TrainConfig:
    base = {"steps": 30, "batch_size": 4, "seq_len": 16, "lr": 3e-3, "warmup": 2,
            "eval_every": 30, "eval_windows": 2, "seed": 5, "carry_state": True}
    return TrainConfig(**{**base, **kw})


def hand_loop(mcfg: LMConfig, cfg: TrainConfig, data: torch.Tensor,
              carry: bool = True) -> tuple[list[float], int]:
    """The trainer's carried-state training written out: shard r of the training bytes is row
    r's stream, read window after window from a seeded random offset, the state detached and
    carried, restarted fresh at offset 0 when a window no longer fits. Also returns the resets."""
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    model = LanguageModel(mcfg)
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    B, T = cfg.batch_size, cfg.seq_len
    shard = data.numel() // B
    pos = int(torch.randint(0, shard - T, (1,), generator=gen))
    state, losses, resets = None, [], 0
    for _ in range(cfg.steps):
        if pos + T + 1 > shard:
            pos, state, resets = 0, None, resets + 1
        rows = [data[r * shard + pos: r * shard + pos + T + 1].long() for r in range(B)]
        batch = torch.stack(rows)
        logits, state = model(batch[:, :-1], state)
        state = [tuple(t.detach() for t in s) for s in state] if carry else None  # delta: (S,)
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        losses.append(loss.item())
        pos += T
    return losses, resets


def test_carried_training_equals_a_hand_written_carrying_loop(tmp_path, corpus):
    cfg = train_cfg()
    losses = train(tmp_path / "run", model_cfg(), cfg, corpus, progress=False)
    expected, resets = hand_loop(model_cfg(), cfg, corpus.train)
    assert resets >= 1  # the stream restart (fresh state) is exercised
    assert [s for s, _ in losses] == list(range(1, cfg.steps + 1))
    assert max(abs(a - b) for (_, a), b in zip(losses, expected)) < 1e-6
    _, ckpt_opt, _ = load_checkpoint(tmp_path / "run")
    assert ckpt_opt["carry"]["state"] is not None


def test_the_hand_loop_without_carrying_differs(corpus):
    """The equality above can fail: the same loop restarting every window from a fresh state
    (independent windows) gives other losses after the first step."""
    cfg = train_cfg(steps=4)
    carried, _ = hand_loop(model_cfg(), cfg, corpus.train)
    fresh, _ = hand_loop(model_cfg(), cfg, corpus.train, carry=False)
    assert carried[0] == fresh[0] and abs(carried[1] - fresh[1]) > 1e-3


def test_carried_training_resumes_exactly(tmp_path, corpus):
    cfg = train_cfg(steps=26, eval_every=13)
    full = train(tmp_path / "full", model_cfg(), cfg, corpus, progress=False)
    part = train(tmp_path / "cut", model_cfg(), train_cfg(steps=26, eval_every=13, save_every=9),
                 corpus, stop_after=12, progress=False)
    rest = train(tmp_path / "cut", None, None, corpus, resume=True, progress=False)
    assert [s for s, _ in rest] == list(range(10, 27))
    assert part[:9] + rest == full  # bit-identical: carried state and stream offset restored
    _, opt, _ = load_checkpoint(tmp_path / "cut")
    _, opt_full, _ = load_checkpoint(tmp_path / "full")
    assert opt["carry"]["position"] == opt_full["carry"]["position"]


def test_carried_validation_reads_one_stream(tmp_path, corpus):
    train(tmp_path / "run", model_cfg(), train_cfg(steps=4, eval_every=4), corpus, progress=False)
    rows = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    assert any(",val," in r for r in rows)
    assert json.loads((tmp_path / "run" / "run.json").read_text())["train"]["carry_state"] is True


@pytest.mark.parametrize("mixer", ["softmax", "aft-full"])
def test_carry_state_refuses_a_growing_state(tmp_path, corpus, mixer):
    mcfg = model_cfg(mixer, max_seq_len=64) if mixer == "aft-full" else model_cfg(mixer)
    with pytest.raises(ValueError, match="carry_state needs mixers with a fixed-size state"):
        train(tmp_path / "run", mcfg, train_cfg(), corpus, progress=False)
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_carry_state_refuses_a_learned_position_table_and_takes_sinusoidal(tmp_path, corpus):
    learned = model_cfg(position="learned", max_seq_len=16)
    with pytest.raises(ValueError, match=r"carry_state: the model cannot continue .* beyond the "
                                         "learned position table"):
        train(tmp_path / "run", learned, train_cfg(), corpus, progress=False)
    cfg = train_cfg(steps=3, eval_every=3)
    losses = train(tmp_path / "sin", model_cfg(position="sinusoidal"), cfg, corpus, progress=False)
    _, opt, _ = load_checkpoint(tmp_path / "sin")
    assert len(losses) == 3
    assert torch.equal(opt["carry"]["state"][-1], torch.full((4,), 3 * 16))  # positions continue


def test_carry_state_refuses_pack_and_short_streams(tmp_path, corpus):
    with pytest.raises(ValueError, match="pack and carry_state exclude each other"):
        train_cfg(pack=True)
    with pytest.raises(TypeError, match="carry_state must be a bool"):
        train_cfg(carry_state=1)
    with pytest.raises(ValueError, match=r"streams of .* fewer than seq_len"):
        train(tmp_path / "run", model_cfg(), train_cfg(batch_size=128, seq_len=16), corpus,
              progress=False)


def _ddp_worker(rank: int, world: int, port: int, run_dir: str, corpus_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                      RANK=str(rank), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    losses = train(run_dir, model_cfg(), train_cfg(steps=8, eval_every=8),
                   load_corpus(corpus_path), progress=False)
    Path(run_dir, f"losses-{rank}.json").write_text(json.dumps(losses))


def test_two_process_ddp_carries_each_ranks_rows(tmp_path, corpus):
    one = train(tmp_path / "one", model_cfg(), train_cfg(steps=8, eval_every=8), corpus,
                progress=False)
    mp.spawn(_ddp_worker, args=(2, _free_port(), str(tmp_path / "two"), str(tmp_path / "corpus.txt")),
             nprocs=2, join=True)
    for rank in (0, 1):
        two = json.loads((tmp_path / "two" / f"losses-{rank}.json").read_text())
        assert max(abs(a - b) for (_, a), (_, b) in zip(two, one)) < 1e-5
    # The checkpoint holds the whole global batch's carried state, gathered in rank order.
    _, a, _ = load_checkpoint(tmp_path / "one")
    _, b, _ = load_checkpoint(tmp_path / "two")
    assert a["carry"]["position"] == b["carry"]["position"]
    for s, t in zip(a["carry"]["state"], b["carry"]["state"]):
        for x, y in zip(s, t):
            assert x.shape == y.shape and torch.allclose(x, y, atol=1e-5)
