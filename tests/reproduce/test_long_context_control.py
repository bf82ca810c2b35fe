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


@pytest.mark.parametrize("mixer,options", [("delta", {}), ("softmax", {}), ("infini", {"segment_len": 8})])
def test_own_prefix_is_the_ordinary_reading(mixer, options, data):
    m = model(mixer, **options)
    per_position = lm.position_losses(m, data, 64, 4, piece=16)
    got = lc.control_losses(m, data, SETTINGS)
    for lo, hi in lc.control_ranges(SETTINGS):
        assert got[lc.control_metric("own", lo, hi)] == pytest.approx(float(per_position[lo:hi].mean()), abs=1e-5)
    # a model with a memory reads the three prefixes differently
    lo, hi = lc.control_ranges(SETTINGS)[-1]
    values = [got[lc.control_metric(c, lo, hi)] for c in lc.CONDITIONS]
    assert len({round(v, 6) for v in values}) == 3, values


def test_a_model_without_memory_beyond_its_block_cannot_tell_the_prefixes_apart(data):
    """Block-local attention (blocks of 8, ranges starting on a block boundary) sees nothing of
    the prefix: own, unrelated and fresh give one loss, so the control cannot pass by accident."""
    got = lc.control_losses(model("diag", block_size=8), data, SETTINGS)
    for lo, hi in lc.control_ranges(SETTINGS):
        own = got[lc.control_metric("own", lo, hi)]
        assert got[lc.control_metric("unrelated", lo, hi)] == pytest.approx(own, abs=1e-6)
        assert got[lc.control_metric("fresh", lo, hi)] == pytest.approx(own, abs=1e-6)


def test_a_prefix_of_the_wrong_shape_is_refused(data):
    x = data[:4 * 65].long().view(4, 65)
    with pytest.raises(ValueError, match="prefix"):
        lm.range_loss(model("delta"), x, x[:, :8], 16, 32, 16)
