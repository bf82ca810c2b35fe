"""infini-passkey (token level): the task's layout and the evaluation's reading in pieces."""

from __future__ import annotations

import pytest
import torch

from fastweights.models import LanguageModel, LMConfig
from fastweights.reproduce.infini_passkey import answer
from fastweights.reproduce.passkey_common import memory_off
from fastweights.tasks import token_passkey, token_passkey_vocab


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_one_needle_in_an_earlier_segment_and_the_key_asked_last():
    ids, answers = token_passkey(5, 8, 64, gen(), n_filler=4, n_keys=6, n_values=7)
    assert ids.shape == (64, 40) and answers.shape == (64,)
    assert token_passkey_vocab(4, 6, 7) == 17
    keys = ids[:, -1]
    assert ((keys >= 4) & (keys < 10)).all() and ((answers >= 10) & (answers < 17)).all()
    for row, key, value in zip(ids, keys, answers):
        where = (row[:-1] == key).nonzero().flatten().tolist()
        assert len(where) == 1 and where[0] % 8 == 0 and where[0] < 32  # a segment start, not the last
        assert row[where[0] + 1] == value
        others = torch.cat([row[:where[0]], row[where[0] + 2:-1]])
        assert (others < 4).all()  # everything else is filler
    segments = {(row[:-1] == key).nonzero().item() // 8 for row, key in zip(ids, keys)}
    assert segments == {0, 1, 2, 3}  # uniform over the earlier segments


@pytest.mark.parametrize("depth,segment", [(0.0, 0), (0.5, 2), (1.0, 4)])
def test_depth_places_the_needle(depth, segment):
    ids, _ = token_passkey(6, 4, 3, gen(1), depth=depth)
    assert (ids[:, segment * 4] == ids[:, -1]).all()


@pytest.mark.parametrize("kwargs,match", [
    ({"n_segments": 1}, "n_segments"), ({"segment_len": 2}, "segment_len"),
    ({"batch": 0}, "batch"), ({"depth": 1.5}, "depth"), ({"n_values": 0}, "n_values"),
])
def test_bad_arguments_name_themselves(kwargs, match):
    args = {"n_segments": 3, "segment_len": 4, "batch": 2, **kwargs}
    extra = {k: args.pop(k) for k in ("depth", "n_values") if k in args}
    with pytest.raises(ValueError, match=match):
        token_passkey(args["n_segments"], args["segment_len"], args["batch"], gen(), **extra)


def test_reading_in_pieces_answers_as_one_read():
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=token_passkey_vocab(), d_model=16, n_layers=2, n_heads=2, mixer="infini",
                   mixer_options={"segment_len": 8})
    model = LanguageModel(cfg).eval()
    ids, _ = token_passkey(6, 8, 4, gen(2))
    whole = answer(model, ids, ids.shape[1])
    for piece in (5, 8, 16):
        assert torch.equal(answer(model, ids, piece), whole)
    off = answer(memory_off(model), ids, 8)
    assert off.shape == whole.shape


def test_word_level_passkey_is_the_text_prompt_cut_into_words():
    from fastweights.tasks import PASSKEY_WORDS, passkey_prompt, passkey_word_ids

    prompt_ids, answer_ids = passkey_word_ids(3, 0.5, gen(4))
    text, key = passkey_prompt(3, 0.5, gen(4))
    words = [PASSKEY_WORDS[i] for i in prompt_ids]
    assert "".join(words) == text.replace(" ", "")
    assert "".join(PASSKEY_WORDS[i] for i in answer_ids) == key and len(answer_ids) == 5
    # one filler repetition adds 24 words; the key appears twice in the prompt, digit by digit
    assert len(passkey_word_ids(4, 0.5, gen(4))[0]) - len(prompt_ids) == 24
    joined = "".join(words)
    assert joined.count(key) == 2
