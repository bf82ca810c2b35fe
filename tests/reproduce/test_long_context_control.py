"""long-context's built-in control: each position range read after the stream's own prefix,
after an unrelated stream's prefix, and from a fresh state."""

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
    values = [got[lc.control_metric(c, lo, hi)] for c in lc.CONDITIONS]
    assert len({round(v, 6) for v in values}) == 3, values


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
