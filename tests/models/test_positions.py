"""Absolute position encodings (LMConfig.position): the sinusoidal formula, pieces == whole with
the positions continuing across the carried state, packed documents restarting at 0, generate ==
greedy full forwards, the learned table's limit, config validation."""

from __future__ import annotations

import math

import pytest
import torch

from fastweights.models import LanguageModel, LMConfig
from tests.helpers import assert_close64
from tests.models.test_lm import ids, tiny

POSITIONS = ("learned", "sinusoidal")


def model_with(position: str, mixer: str = "delta") -> LanguageModel:
    return tiny(mixer, position=position, max_seq_len=40)


def test_sinusoidal_encoding_is_the_formula():
    model = LanguageModel(LMConfig(vocab_size=7, d_model=5, n_layers=1, n_heads=1,
                                   position="sinusoidal"))
    pe = model._position_encoding(torch.tensor([0, 3, 17]))
    for row, p in zip(pe, (0, 3, 17)):
        for j in range(5):
            angle = p / 10000 ** ((j - j % 2) / 5)
            assert row[j].item() == pytest.approx(math.sin(angle) if j % 2 == 0 else math.cos(angle),
                                                  abs=1e-12)


def test_position_scale_multiplies_the_sinusoid_only():
    base = dict(vocab_size=7, d_model=6, n_layers=1, n_heads=1, position="sinusoidal")
    unit = LanguageModel(LMConfig(**base))._position_encoding(torch.tensor([1, 9]))
    scaled = LanguageModel(LMConfig(**base, position_scale=0.02))._position_encoding(torch.tensor([1, 9]))
    assert_close64(scaled.double(), 0.02 * unit.double())
    for bad in (0.0, -1.0, float("inf"), "x"):
        with pytest.raises(ValueError, match="position_scale"):
            LMConfig(**base, position_scale=bad)
    with pytest.raises(ValueError, match="position_scale applies to position='sinusoidal' only"):
        LMConfig(vocab_size=7, d_model=6, n_layers=1, n_heads=1, position_scale=0.5)


@pytest.mark.parametrize("position", POSITIONS)
@pytest.mark.parametrize("mixer", ["delta", "linear", "softmax"])
def test_pieces_equal_whole_with_positions(position, mixer):
    model = model_with(position, mixer)
    x = ids(T=17)
    whole, final = model(x)
    assert len(final) == 3 and torch.equal(final[-1], torch.tensor([17, 17]))
    outs, state = [], None
    for a, b in ((0, 5), (5, 6), (6, 17)):
        y, state = model(x[:, a:b], state)
        outs.append(y)
    assert_close64(torch.cat(outs, 1), whole, what=f"{mixer}/{position} pieces vs whole")
    # The encoding is used: the same tokens at other positions give other logits.
    shifted, _ = model(x[:, 5:], [None, None, torch.tensor([0, 0])])
    assert (shifted - whole[:, 5:]).abs().max() > 1e-3


def test_no_position_keeps_the_layer_state_list():
    model = tiny("delta")
    _, state = model(ids())
    assert len(state) == 2
    with pytest.raises(ValueError, match="list of 2 layer states and then the position offsets"):
        model_with("sinusoidal")(ids(), state)


@pytest.mark.parametrize("position", POSITIONS)
def test_packed_documents_restart_positions(position):
    model = model_with(position)
    x = ids(B=1, T=12)
    cu = torch.tensor([0, 5, 12])
    packed, state = model(x, cu_seqlens=cu)
    for a, b in ((0, 5), (5, 12)):
        alone, _ = model(x[:, a:b])
        assert_close64(packed[:, a:b], alone, what="packed document")
    assert torch.equal(state[-1], torch.tensor([5, 7]))


@pytest.mark.parametrize("position", POSITIONS)
def test_generate_equals_greedy_full_forwards(position):
    model = model_with(position)
    prompt = ids(B=2, T=6)
    out = model.generate(prompt, 5, temperature=0)
    seq = prompt
    for _ in range(5):
        logits, _ = model(seq)
        seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)


def test_learned_table_limit_and_bad_configs():
    model = model_with("learned")
    _, state = model(ids(T=30))
    model(ids(T=10), state)  # positions 30..39: the last row of the table
    _, state = model(ids(T=35))
    with pytest.raises(ValueError, match="beyond the learned position table of max_seq_len 40"):
        model(ids(T=10), state)
    with pytest.raises(ValueError, match="state\\[-1\\] \\(position offsets\\)"):
        model(ids(), [None, None, torch.tensor([1.0, 2.0])])
    with pytest.raises(ValueError, match="'learned' needs max_seq_len"):
        LMConfig(position="learned")
    with pytest.raises(ValueError, match="position must be one of"):
        LMConfig(position="rope")
    assert LanguageModel(LMConfig(position="learned", max_seq_len=8, d_model=8)).pos_embed.weight.shape == (8, 8)


def test_json_round_trip(tmp_path):
    model = model_with("learned").float()
    model.save_pretrained(tmp_path)
    loaded = LanguageModel.from_pretrained(tmp_path)
    x = ids()
    assert loaded.config.position == "learned"
    assert torch.equal(loaded(x)[0], model(x)[0])
