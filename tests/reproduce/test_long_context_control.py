"""long-context's built-in control: each position range read after the stream's own prefix,
after an unrelated stream's prefix, from a fresh state, and window by window (the truncated
reading the truncation control is judged by); the per-stream losses and the bigram bar."""

from __future__ import annotations

import pytest
import torch

from fastweights.models import LanguageModel, LMConfig
from fastweights.reproduce import lm
from fastweights.reproduce import long_context as lc

SETTINGS = {"seq_len": 16, "factor": 4, "streams": 4}


def model(mixer: str, **options) -> LanguageModel:
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=256, d_model=16, n_layers=2, n_heads=2, mixer=mixer, mixer_options=options)
    return LanguageModel(cfg).eval()


@pytest.fixture
def data():
    return torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))


def test_ranges_double_from_the_training_length():
    assert lc.control_ranges(SETTINGS) == [(16, 32), (32, 64)]
    assert lc.control_ranges({"seq_len": 128, "factor": 16}) == [(128, 256), (256, 512), (512, 1024),
                                                                   (1024, 2048)]


def streams(data: torch.Tensor) -> torch.Tensor:
    return data[:4 * 65].long().view(4, 65)  # 4 streams of 64 + 1 bytes


FILES = [0, 1, 2, 3]  # each stream in its own file


@pytest.mark.parametrize("mixer,options", [("delta", {}), ("softmax", {}), ("infini", {"segment_len": 8})])
def test_own_prefix_is_the_ordinary_reading(mixer, options, data):
    m = model(mixer, **options)
    per_position = lm.position_losses(m, streams(data), piece=16)
    got = lc.control_losses(m, streams(data), FILES, SETTINGS)
    assert got["unrelated_same_file"] == 0.0
    for lo, hi in lc.control_ranges(SETTINGS):
        assert got[lc.control_metric("own", lo, hi)] == pytest.approx(float(per_position[lo:hi].mean()), abs=1e-5)
    # a model with a memory reads the three prefixes differently
    lo, hi = lc.control_ranges(SETTINGS)[-1]
    values = [got[lc.control_metric(c, lo, hi)] for c in ("own", "unrelated", "fresh")]
    assert len({round(v, 6) for v in values}) == 3, values


@pytest.mark.parametrize("mixer", ["delta", "linear"])
def test_the_window_reading_scores_every_window_from_a_fresh_state(mixer, data):
    m, x = model(mixer), streams(data)
    per_stream: dict[str, list[float]] = {}
    got = lc.control_losses(m, x, FILES, SETTINGS, per_stream)
    for lo, hi in lc.control_ranges(SETTINGS):
        pieces = [lm.range_loss(m, x[:, a:], None, 0, 16, 16) for a in range(lo, hi, 16)]
        assert got[lc.control_metric("window", lo, hi)] == pytest.approx(sum(pieces) / len(pieces), abs=1e-6)
    lo, hi = lc.control_ranges(SETTINGS)[-1]
    # past one window the carried fresh reading and the window-by-window one differ
    assert abs(got[lc.control_metric("window", lo, hi)] - got[lc.control_metric("fresh", lo, hi)]) > 1e-4
    # the per-stream losses of the last range average to the metric
    assert set(per_stream) == {lc.control_metric(c, lo, hi) for c in lc.CONDITIONS}
    for name, values in per_stream.items():
        assert len(values) == 4 and sum(values) / 4 == pytest.approx(got[name], abs=1e-6)


def test_the_bigram_bar_scores_the_windows_targets_from_the_byte_before():
    from fastweights.tasks.text import Corpus

    train = torch.tensor([1, 2, 1, 2, 1, 3] * 50, dtype=torch.uint8)
    val = torch.tensor([1, 2, 1, 3, 1, 2, 5], dtype=torch.uint8)
    corpus = Corpus("t", train, val)
    table = lm.bigram_table(corpus)
    ones = torch.bincount(train.long()[:-1], minlength=256)[1]
    # add-one: p(2 | 1) = (count(1, 2) + 1) / (count(1) + 256)
    assert table[1, 2].exp().item() == pytest.approx((100 + 1) / (int(ones) + 256))
    assert table.exp().sum(1) == pytest.approx(torch.ones(256, dtype=torch.float64))
    got = lm.bigram_loss(corpus, val, torch.tensor([0, 2]), 3)  # bytes 1,2,1,3 and 1,3,1,2
    pairs = [(1, 2), (2, 1), (1, 3), (1, 3), (3, 1), (1, 2)]
    assert got == pytest.approx(-sum(table[a, b].item() for a, b in pairs) / 6)
    assert lm.trained_metrics(2.0, 2.5) == {"bigram": 2.5, "trained": 1.0}
    assert lm.trained_metrics(2.6, 2.5)["trained"] == 0.0
    assert lm.trained_metrics(9.0, None) == {"trained": 1.0}


def test_a_model_without_memory_beyond_its_block_cannot_tell_the_prefixes_apart(data):
    """Block-local attention (blocks of 8, ranges starting on a block boundary) sees nothing of
    the prefix: own, unrelated and fresh give one loss, so the control cannot pass by accident."""
    got = lc.control_losses(model("diag", block_size=8), streams(data), FILES, SETTINGS)
    for lo, hi in lc.control_ranges(SETTINGS):
        own = got[lc.control_metric("own", lo, hi)]
        assert got[lc.control_metric("unrelated", lo, hi)] == pytest.approx(own, abs=1e-6)
        assert got[lc.control_metric("fresh", lo, hi)] == pytest.approx(own, abs=1e-6)


def test_a_prefix_of_the_wrong_shape_is_refused(data):
    x = data[:4 * 65].long().view(4, 65)
    with pytest.raises(ValueError, match="prefix"):
        lm.range_loss(model("delta"), x, x[:, :8], 16, 32, 16)


def test_the_unrelated_prefix_comes_from_another_file():
    # two streams per file in stream order: the half-way shift would pair each with ... another
    # file; a shift of 1 would pair streams of the same file
    files = [0, 0, 1, 1, 2, 2, 3, 3]
    shift = lc.unrelated_shift(files)
    assert all(files[i] != files[(i - shift) % 8] for i in range(8))
    files = [0, 0, 0, 0, 0, 1]  # one file dominates: as few same-file pairs as can be
    shift = lc.unrelated_shift(files)
    assert sum(files[i] == files[(i - shift) % 6] for i in range(6)) == 4


def test_streams_lie_inside_files_spread_over_all_of_them():
    from fastweights.tasks.text import Corpus

    val = torch.arange(1000, dtype=torch.long).to(torch.uint8)
    starts = torch.tensor([0, 101, 402, 703])  # files of 100, 300, 300 and 296 bytes
    corpus = Corpus("t", val, val, val_starts=starts)
    got = lm.stream_starts(corpus, 63, 6)
    files = lm.file_of(corpus, got)
    assert sorted(set(files)) == [0, 1, 2, 3]
    ends = [*starts.tolist()[1:], 1001]
    assert all(starts[f] <= g and g + 64 <= ends[f] - 1 for g, f in zip(got.tolist(), files))
