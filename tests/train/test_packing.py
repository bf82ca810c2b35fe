"""Packed training batches: document boundaries become cu_seqlens cuts, no target crosses a
document, and training on packed rows works."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from fastweights.models import LanguageModel, LMConfig
from fastweights.tasks import load_corpus
from fastweights.tasks.text import packed_windows, random_windows
from fastweights.train.trainer import TrainConfig, train


def test_packed_windows_cut_at_documents():
    data = torch.arange(40, dtype=torch.uint8)
    starts = torch.tensor([0, 7, 9, 30])
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    x, y, cu = packed_windows(data, starts, 3, 10, g1)
    xr, _yr = random_windows(data, 3, 10, g2)
    assert torch.equal(x, xr.reshape(1, -1))  # same draws as unpacked windows
    for row in range(3):
        s = int(xr[row, 0])
        for i in range(10):
            pos = s + i
            crosses = (pos + 1) in starts.tolist()
            assert (y[0, row * 10 + i] == -100) == crosses
            if (pos in starts.tolist()) and i > 0:
                assert row * 10 + i in cu.tolist()
    assert cu[0] == 0 and cu[-1] == 30 and all(10 * r in cu.tolist() for r in range(4))


def test_packed_rows_select_a_share():
    data = torch.arange(60, dtype=torch.uint8)
    starts = torch.tensor([0, 13, 41])
    full = packed_windows(data, starts, 4, 8, torch.Generator().manual_seed(1))
    half = packed_windows(data, starts, 4, 8, torch.Generator().manual_seed(1), rows=(2, 4))
    assert torch.equal(half[0], full[0][:, 16:])
    assert torch.equal(half[1], full[1][:, 16:])


def test_packed_loss_equals_per_document_loss(tmp_path):
    docs = ["alpha beta gamma\n" * 3, "x = 1\n", "def g():\n    pass\n" * 2, "zzz"]
    for i, d in enumerate(docs):
        (tmp_path / f"f{i}.py").write_text(d)
    corpus = load_corpus(str(tmp_path))
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(d_model=16, n_layers=1, n_heads=2, mixer="delta")).double().eval()
    x, y, cu = packed_windows(corpus.train, corpus.train_starts, 2, 12, torch.Generator().manual_seed(2))
    logits, _ = model(x, cu_seqlens=cu)
    bounds = cu.tolist()
    for a, b in itertools.pairwise(bounds):
        ref, _ = model(x[:, a:b])
        assert (logits[:, a:b] - ref).abs().max().item() < 1e-10
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
    assert torch.isfinite(loss)


def test_training_with_packing_lowers_the_loss(tmp_path):
    for i in range(6):
        (tmp_path / "data").mkdir(exist_ok=True)
        (tmp_path / "data" / f"m{i}.py").write_text(
            "".join(f"def f{j}(x):\n    return x * {j % 7}\n\n" for j in range(40 + 10 * i)))
    corpus = load_corpus(str(tmp_path / "data"))
    cfg = TrainConfig(steps=30, batch_size=4, seq_len=32, lr=3e-3, warmup=2, eval_every=30,
                      eval_windows=4, seed=0, pack=True)
    losses = train(tmp_path / "run", LMConfig(d_model=16, n_layers=1, n_heads=2, mixer="delta"), cfg,
                   corpus, progress=False)
    first, last = sum(v for _, v in losses[:5]) / 5, sum(v for _, v in losses[-5:]) / 5
    assert last < first - 0.5, (first, last)
