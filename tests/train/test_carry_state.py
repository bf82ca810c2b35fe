"""Carried-state training (truncated BPTT across windows): the trainer equals a hand-written loop
that carries the detached state over consecutive windows of each row's stream, resumes exactly,
splits exactly over DDP ranks, and refuses what cannot carry a state."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from fastweights import state_tree
from fastweights.models import LanguageModel, LMConfig
from fastweights.tasks import load_corpus
from fastweights.train.batches import STREAM_WINDOWS, BatchSource
from fastweights.train.checkpoint import load_checkpoint
from fastweights.train.trainer import TrainConfig, lr_factor, train
from tests.spawned import TOL64, assert_same_run, float64_default, free_port

# About 1,300 training bytes: segments of STREAM_WINDOWS = 16 windows of 16 bytes fit, and 30 steps
# cross one segment boundary (a jump to new offsets with a fresh state).
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
    """The trainer's carried-state training written out: every row reads a segment of
    STREAM_WINDOWS consecutive windows from its own random offset (drawn from the seeded data
    generator over the offsets where the segment fits), the state detached and carried; after
    the segment every row jumps to a new offset with a fresh state. Also returns the jumps."""
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    model = LanguageModel(mcfg)
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    B, T, K = cfg.batch_size, cfg.seq_len, STREAM_WINDOWS
    state, losses, resets, starts, w = None, [], 0, None, K
    for _ in range(cfg.steps):
        if w == K:
            resets += starts is not None
            starts, state, w = torch.randint(0, data.numel() - K * T, (B,), generator=gen), None, 0
        batch = torch.stack([data[s + w * T: s + w * T + T + 1].long() for s in starts.tolist()])
        logits, state = model(batch[:, :-1], state)
        state = [tuple(t.detach() for t in s) for s in state] if carry else None  # delta: (S,)
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        losses.append(loss.item())
        w += 1
    return losses, resets


def source(corpus, batch_size: int = 4, seq_len: int = 16, seed: int = 5) -> BatchSource:
    cfg = train_cfg(batch_size=batch_size, seq_len=seq_len, seed=seed)
    return BatchSource(cfg, corpus, torch.Generator().manual_seed(seed), 0, batch_size, 0, 1,
                       torch.device("cpu"))


def test_streams_are_segments_of_consecutive_windows_from_independent_offsets(corpus):
    src = source(corpus)
    data = corpus.train
    got = [src.next() for _ in range(STREAM_WINDOWS + 1)]
    assert [restarted for _, restarted in got] == [False] * STREAM_WINDOWS + [True]
    windows = [batches[0][:2] for batches, _ in got]  # (x, y) of each step
    assert len({bytes(row.tolist()) for row in windows[0][0]}) == 4  # every row its own offset
    for (_, y_prev), (x, _) in itertools.pairwise(windows[:STREAM_WINDOWS]):
        assert torch.equal(x[:, 0], y_prev[:, -1])  # window w continues window w - 1, every row
    starts = src.stream_pos["starts"]  # the new segment's offsets, after the jump
    x, y = windows[-1]
    assert torch.equal(x, torch.stack([data[s:s + 16].long() for s in starts]))
    assert torch.equal(y, torch.stack([data[s + 1:s + 17].long() for s in starts]))


def test_one_rows_segments_spread_over_the_whole_split(corpus):
    """Row 0 jumps over the whole training split (the old layout kept it in its quarter)."""
    src = source(corpus, batch_size=4)
    seen = []
    for _ in range(40 * STREAM_WINDOWS):
        src.next()
        if src.stream_pos["window"] == 1:
            seen.append(src.stream_pos["starts"][0])
    quarter = corpus.train.numel() / 4
    assert {int(s // quarter) for s in seen} == {0, 1, 2, 3}


def test_an_old_integer_stream_position_starts_a_new_segment(corpus):
    src = source(corpus)
    src.stream_pos = 7  # a checkpoint of the one-shard-per-row layout
    _, restarted = src.next()
    assert restarted and src.stream_pos["window"] == 1 and len(src.stream_pos["starts"]) == 4


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


def test_the_truncation_control_equals_the_same_loop_with_the_state_reset_every_window(tmp_path, corpus):
    """reset_state: the carried run's segments in the same order, every window from a fresh
    state (docs/reproductions.md, "The truncation control"): the hand loop without carrying."""
    cfg = train_cfg(reset_state=True)
    losses = train(tmp_path / "run", model_cfg(), cfg, corpus, progress=False)
    expected, resets = hand_loop(model_cfg(), cfg, corpus.train, carry=False)
    carried, _ = hand_loop(model_cfg(), cfg, corpus.train)
    assert resets >= 1
    assert max(abs(a - b) for (_, a), b in zip(losses, expected)) < 1e-6
    assert losses[0][1] == pytest.approx(carried[0], abs=1e-6)  # same weights, same first window
    assert abs(losses[1][1] - carried[1]) > 1e-3  # and then only the truncation differs
    _, ckpt_opt, _ = load_checkpoint(tmp_path / "run")
    assert ckpt_opt["carry"]["state"] is None and ckpt_opt["carry"]["position"]["window"] >= 1
    # resumed mid-way it continues the same segments
    part = train(tmp_path / "cut", model_cfg(), train_cfg(reset_state=True, save_every=9), corpus,
                 stop_after=12, progress=False)
    rest = train(tmp_path / "cut", None, None, corpus, resume=True, progress=False)
    assert part[:9] + rest == losses
    with pytest.raises(ValueError, match="reset_state needs carry_state"):
        train_cfg(carry_state=False, reset_state=True)


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
    torch.set_default_dtype(torch.float64)
    losses = train(run_dir, model_cfg(), train_cfg(steps=8, eval_every=8),
                   load_corpus(corpus_path), progress=False)
    Path(run_dir, f"losses-{rank}.json").write_text(json.dumps(losses))


def test_two_process_ddp_carries_each_ranks_rows(tmp_path, corpus):
    """Float64 end to end: losses, validation loss (one carried stream), weights and the carried
    state within TOL64 (tests/spawned.py)."""
    with float64_default():
        one = train(tmp_path / "one", model_cfg(), train_cfg(steps=8, eval_every=8), corpus,
                    progress=False)
    mp.spawn(_ddp_worker, args=(2, free_port(), str(tmp_path / "two"), str(tmp_path / "corpus.txt")),
             nprocs=2, join=True)
    for rank in (0, 1):
        two = json.loads((tmp_path / "two" / f"losses-{rank}.json").read_text())
        assert_same_run(two, tmp_path / "two", one, tmp_path / "one")
    # The checkpoint holds the whole global batch's carried state, gathered in rank order.
    with float64_default():
        _, a, _ = load_checkpoint(tmp_path / "one")
        _, b, _ = load_checkpoint(tmp_path / "two")
    assert a["carry"]["position"] == b["carry"]["position"]
    got, want = (state_tree.tensors(c["carry"]["state"]) for c in (b, a))
    assert len(got) == len(want) and any(x.dtype == torch.float64 for x in want)
    for x, y in zip(got, want):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert (x - y).abs().max().item() < TOL64


def test_a_carried_ttt_state_of_an_older_checkpoint_loads(tmp_path, monkeypatch):
    """Checkpoints written before the TTT state had one form pickled a carried TTT layer's
    open mini-batch as a NamedTuple of the removed module ops/ttt/decode.py (start, prior,
    rows, pos, prior_steps): it loads as the TTTState it equals (the rows form)."""
    import sys
    import types
    from typing import NamedTuple

    from fastweights.ops import TTTState
    from fastweights.train import checkpoint

    old = types.ModuleType("fastweights.ops.ttt.decode")

    class Rows(NamedTuple):
        start: tuple
        prior: object
        rows: tuple
        pos: int
        prior_steps: int

    Rows.__module__, Rows.__qualname__ = old.__name__, "Rows"
    old.Rows = Rows
    monkeypatch.setitem(sys.modules, old.__name__, old)
    start, rows = (torch.ones(1, 2, 4, 4), None), (torch.zeros(1, 2, 3, 4), torch.ones(1, 2, 3, 4))
    torch.save({"carry": {"state": [(3, None, Rows(start, None, rows, 3, 0))]}},
               tmp_path / "optimizer.pt")
    monkeypatch.delitem(sys.modules, old.__name__)
    saved = torch.load(tmp_path / "optimizer.pt", weights_only=False,
                       pickle_module=checkpoint._saved_states)
    inner = saved["carry"]["state"][0][2]
    assert isinstance(inner, TTTState) and inner.pos == 3 and inner.start[1] is None
    assert torch.equal(inner.rows[1], rows[1])
