"""Packed documents are checked once (docs/design.md, "Packed documents"): a packed forward of an
8-layer model reads from the device once (the documents' boundaries and the ids' range, read
together), and a layer called alone with a cu_seqlens tensor reads it once; counted with
``fastweights.testing.HostReads`` (``.tolist()``, ``.item()``, ``nonzero``, truth tests, ...)."""

from __future__ import annotations

import pytest
import torch

from fastweights import build_mixer
from fastweights.models.config import LMConfig
from fastweights.models.lm import LanguageModel
from fastweights.testing import HostReads

# Mixers whose ops read nothing of their data (AFT's chunked forms choose a branch by the data,
# gated-delta's op checks the gates' values: those read on top).
QUIET = ["linear", "delta", "norm", "infini", "ttt-linear", "softmax", "diag", "dpfp"]


def _packed_forward(model: LanguageModel) -> list[str]:
    ids = torch.randint(0, model.config.vocab_size, (1, 30), generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, 7, 19, 30])
    with torch.no_grad():
        model(ids, cu_seqlens=cu)  # warm: a TTT layer reads its token scales once, then keeps them
        with HostReads() as seen:
            model(ids, cu_seqlens=cu)
    return seen.reads


@pytest.mark.parametrize("mixers", [["delta"] * 8, QUIET], ids=["delta", "mixed"])
def test_a_packed_forward_reads_the_device_once(mixers):
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=50, d_model=16, n_layers=8, n_heads=2,
                                   mixer=mixers)).eval()
    reads = _packed_forward(model)
    assert reads == ["tolist"], reads


@pytest.mark.parametrize("name", QUIET)
def test_a_layer_called_alone_reads_cu_seqlens_once(name):
    torch.manual_seed(0)
    layer = build_mixer(name, 16, 2).eval()
    x = torch.randn(1, 30, 16)
    cu = torch.tensor([0, 7, 19, 30])
    with torch.no_grad():
        layer(x, cu_seqlens=cu)
        with HostReads() as seen:
            layer(x, cu_seqlens=cu)
    assert seen.reads == ["tolist"], seen.reads
