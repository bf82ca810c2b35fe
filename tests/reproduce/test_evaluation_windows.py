"""The reproductions' evaluation data (issue 35): windows spread over every validation file rather
than the first bytes of the split, each window read fresh or after the bytes before it with the
state carried; carried-state training segments; extra seeds for some models of an experiment."""

from __future__ import annotations

import bisect
import csv

import pytest
import torch

from fastweights.models import LanguageModel, LMConfig
from fastweights.reproduce import lm
from fastweights.reproduce.driver import reproduce
from fastweights.tasks.text import Corpus, segment_windows, spread_starts, spread_windows

# five documents of 40, 300, 10, 600 and 49 items, joined by one separator each
LENGTHS = [40, 300, 10, 600, 49]
STARTS = torch.tensor([0, 41, 342, 353, 954])
TOTAL = 1003


def doc_of(offset: int) -> int:
    return bisect.bisect_right(STARTS.tolist(), offset) - 1


def test_spread_starts_cover_every_document_that_holds_a_stretch():
    got = spread_starts(STARTS, TOTAL, 33, 12).tolist()
    assert len(got) == 12 and got == sorted(got)
    docs = [doc_of(s) for s in got]
    assert set(docs) == {0, 1, 3, 4}  # the document of 10 items holds none
    for s, d in zip(got, docs):  # every stretch inside its document
        assert STARTS[d] <= s and s + 33 <= STARTS[d] + LENGTHS[d]
    assert docs.count(3) > docs.count(1) > docs.count(0)  # the rest in proportion to size
    # the first bytes of the split, what eval_windows reads, never reach the last document
    assert 4 not in {doc_of(i * 33) for i in range(12)}


def test_spread_starts_with_fewer_stretches_than_documents_and_errors():
    got = spread_starts(STARTS, TOTAL, 33, 2).tolist()
    assert len(got) == 2 and len({doc_of(s) for s in got}) == 2
    with pytest.raises(ValueError, match="no document holds"):
        spread_starts(STARTS, TOTAL, 700, 1)
    with pytest.raises(ValueError, match="do not fit"):
        spread_starts(STARTS, TOTAL, 33, 100)


def test_spread_windows_are_inputs_and_next_byte_targets():
    data = torch.arange(TOTAL) % 251
    x, y = spread_windows(data.to(torch.uint8), STARTS, 16, 8)
    starts = spread_starts(STARTS, TOTAL, 17, 8)
    assert x.shape == y.shape == (8, 16)
    assert torch.equal(x[:, 0], data[starts]) and torch.equal(y[:, :-1], x[:, 1:])


def test_segment_windows_read_consecutive_windows_from_each_start():
    data = torch.arange(200, dtype=torch.long)
    starts = torch.tensor([3, 100])
    x0, _ = segment_windows(data, starts, 10, 0)
    x2, y2 = segment_windows(data, starts, 10, 2)
    assert x0[:, 0].tolist() == [3, 100] and x2[:, 0].tolist() == [23, 120]
    assert torch.equal(y2, x2 + 1)
    with pytest.raises(ValueError, match="does not fit"):
        segment_windows(data, starts, 10, 9)  # 100 + 90 + 10 + 1 > 200


def corpus() -> Corpus:
    val = (torch.arange(TOTAL) * 7 % 256).to(torch.uint8)
    return Corpus("t", val, val, val_starts=STARTS)


def test_eval_starts_leave_room_for_the_context():
    got = lm.eval_starts(corpus(), 16, 10, context=64)
    assert bool((got >= 64).all()) and len(got) == 10
    with pytest.raises(Exception, match="cannot hold"):
        lm.eval_starts(corpus(), 16, 500)


def test_windows_loss_fresh_and_with_context():
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=256, d_model=16, n_layers=1, n_heads=2, mixer="delta")).eval()
    data = corpus().val
    starts = lm.eval_starts(corpus(), 16, 6, context=32)
    fresh = lm.windows_loss(model, data, starts, 16, batch=4)
    with torch.no_grad():  # the same windows, scored by hand from a fresh state
        x = data[starts[:, None] + torch.arange(17)].long()
        logits, _ = model(x[:, :-1])
        expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
    assert fresh == pytest.approx(float(expected), abs=1e-5)
    carried = lm.windows_loss(model, data, starts, 16, context=32, batch=4)
    span = data[starts[:, None] - 32 + torch.arange(49)].long()
    assert carried == pytest.approx(lm.range_loss(model, span, span[:, :32], 32, 48, 16), abs=1e-5)
    assert abs(carried - fresh) > 1e-4  # the context changes the reading of a model with a memory
    # the per-window losses (windows.csv): each window's own mean loss, averaging to the above
    per = lm.windows_losses(model, data, starts, 16, batch=4)
    with torch.no_grad():
        own = torch.nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none").mean(1)
    assert per.shape == (6,) and torch.allclose(per, own.double(), atol=1e-5)
    assert float(per.mean()) == pytest.approx(fresh, abs=1e-9)


def test_extra_seeds_for_some_models_keep_every_finished_run(tmp_path):
    out = tmp_path / "r"
    reproduce("fwp-recall", out, [0], quick=True, progress=False)
    picked = ["update linear S=3", "update delta S=3"]
    reproduce("fwp-recall", out, [1], quick=True, progress=False, models=picked)
    rows = list(csv.DictReader((out / "results.csv").read_text().splitlines()))
    seeds = {(r["model"], r["seed"]) for r in rows}
    assert {(m, "1") for m in picked} <= seeds and len(rows) == len(seeds) == 8 + 2
    assert [r["seed"] for r in rows] == sorted(r["seed"] for r in rows)  # seed-major, plan order
    with pytest.raises(ValueError, match="no model 'nope'"):
        reproduce("fwp-recall", out, [2], quick=True, progress=False, models=["nope"])
