"""infini-passkey's evaluation pieces: prompts of the asked length, greedy retrieval read in
pieces equal to one whole read, and the memory switch-off (segment-local only)."""

from __future__ import annotations

import torch

from fastweights.models import LanguageModel, LMConfig
from fastweights.reproduce.infini_passkey_bytes import _batch, _n_filler, retrieve
from fastweights.reproduce.passkey_common import memory_off


def infini(layers=2):
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=256, d_model=16, n_layers=layers, n_heads=2, mixer="infini",
                   mixer_options={"segment_len": 8})
    return LanguageModel(cfg).eval()


def test_prompt_lengths_follow_the_request():
    gen = torch.Generator().manual_seed(0)
    for length in (300, 1024, 4096):
        prompts, answers = _batch(_n_filler(length), [0.0, 0.5, 1.0], gen)
        assert abs(prompts.shape[1] - length) <= 50 and answers.shape == (3, 5)
        assert all(bytes(a.tolist()).decode().isdigit() for a in answers)


def test_retrieval_in_pieces_equals_one_read():
    model = infini()
    prompts, _ = _batch(_n_filler(200), [0.0, 1.0], torch.Generator().manual_seed(1))
    whole = retrieve(model, prompts, prompts.shape[1])
    for piece in (7, 64):
        assert torch.equal(retrieve(model, prompts, piece), whole)


def test_memory_off_sees_only_the_current_segment():
    model = infini()
    off = memory_off(model)
    x = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    y = x.clone()
    y[0, :8] = (y[0, :8] + 1) % 256  # change the first segment only
    with torch.no_grad():
        assert torch.allclose(off(x)[0][:, 8:], off(y)[0][:, 8:], atol=1e-6)
        assert not torch.allclose(model(x)[0][:, 8:], model(y)[0][:, 8:], atol=1e-4)
    # the original model keeps its gates
    assert all(torch.isfinite(m.gate).all() for m in model.modules() if hasattr(m, "gate"))
