"""The transnormer reproduction's analyses: the mixing matrices read from a trained model's own
ops, the far-share (1 - l(i, r, N)) ratio, and the per-step gradient norms of metrics.csv."""

from __future__ import annotations

import csv
import math

import pytest
import torch

from fastweights.layers import fwp as fwp_layers
from fastweights.layers import transnormer as transnormer_layers
from fastweights.models import LanguageModel, LMConfig
from fastweights.reproduce.transnormer import attention_matrices, far_share
from fastweights.tasks.text import Corpus
from fastweights.train.trainer import TrainConfig, train

T = 12


def model(mixers, options):
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=256, d_model=16, n_layers=len(mixers), n_heads=2, mixer=mixers,
                   mixer_options=options)
    return LanguageModel(cfg).double().eval()


def test_mixing_matrices_reproduce_the_layers_outputs():
    """Each layer's matrix applied to its values gives the op's output: checked by comparing a
    second capture with real values. Softmax / normalised linear rows sum to 1, every matrix is
    causal, DiagAttention's does not cross a block border, NormAttention's is q.k."""
    m = model(["softmax", "linear", "diag", "norm"], [{}, {}, {"block_size": 5}, {}])
    x = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(1))
    mats = attention_matrices(m, x)
    assert len(mats) == 4 and all(A.shape == (2, 2, T, T) for A in mats)
    upper = torch.ones(T, T, dtype=torch.bool).triu(1)
    for A in mats:
        assert A[..., upper].abs().max() == 0
    for A in mats[:3]:
        assert torch.allclose(A.sum(-1), torch.ones(2, 2, T), atol=1e-4)
    block = torch.arange(T) // 5
    assert mats[2][..., block[:, None] != block[None, :]].abs().max() == 0
    # the layers' ops are untouched, and the capture hooks are removed after it
    from fastweights.ops import linear_attn
    assert transnormer_layers.linear_attn is linear_attn and fwp_layers.linear_attn is linear_attn
    assert all(block.mixer.op_hook is None for block in m.blocks)


@pytest.mark.parametrize("mixer", ["norm", "linear", "softmax", "diag"])
def test_mixing_matrix_times_values_is_the_layer_output(mixer, monkeypatch):
    """A spy records the values and the output of the layer's op: A @ v is that output."""
    m = model([mixer], [{"block_size": 5} if mixer == "diag" else {}])
    x = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(2))
    seen = []

    def spy(op, q, k, v, kw):
        o = op(q, k, v, **kw)
        seen.append((v.detach(), (o[0] if isinstance(o, tuple) else o).detach()))

    monkeypatch.setattr(m.blocks[0].mixer, "op_hook", spy)
    with torch.no_grad():
        m(x)
    monkeypatch.undo()
    (A,) = attention_matrices(m, x)
    (v, o), = seen[:1]
    # o[b, i, h] = sum_j A[b, h, i, j] v[b, j, h]
    assert torch.allclose(torch.einsum("bhij,bjhd->bihd", A.double(), v.double()), o.double(), atol=1e-5)


def test_far_share_on_known_matrices():
    eye = torch.eye(8).expand(1, 1, 8, 8)
    assert far_share(eye, 0.125) == 0.0  # all mass on the query itself
    uniform = torch.ones(1, 1, 8, 8).tril()
    # queries 4..7 keep r*N = 2 nearest of their i + 1 keys: far share 1 - 2/(i+1)
    expected = 1 - sum(2 / (i + 1) for i in range(4, 8)) / 4
    assert far_share(uniform, 0.25) == pytest.approx(expected)
    assert far_share(-uniform, 0.25) == pytest.approx(expected)  # signed weights: |A|
    assert far_share(uniform, 1.0) == pytest.approx(0.0)


def test_training_logs_the_gradient_norm_of_every_step(tmp_path):
    text = bytes(range(32, 127)) * 40
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    corpus = Corpus(train=data[:3000], val=data[3000:], name="t")
    cfg = LMConfig(vocab_size=256, d_model=16, n_layers=1, n_heads=2, mixer="linear")
    train(tmp_path / "r", cfg, TrainConfig(steps=4, batch_size=2, seq_len=16, eval_every=4,
                                           eval_windows=2, save_every=4), corpus, progress=False)
    with open(tmp_path / "r" / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["split"] == "train"]
    assert len(rows) == 4 and all(math.isfinite(float(r["grad_norm"])) and float(r["grad_norm"]) > 0
                                  for r in rows)
    # the mixers' share: positive, and below the whole model's (a subset of the same gradients)
    assert all(0 < float(r["mixer_grad_norm"]) < float(r["grad_norm"]) for r in rows)


def test_mixer_gradient_norm_is_the_norm_over_the_mixers_parameters():
    from fastweights.layers.base import Mixer
    from fastweights.models import LanguageModel
    from fastweights.train.metrics import mixer_grad_norm

    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, mixer="norm"))
    assert mixer_grad_norm(model) is None  # no gradients yet
    logits, _ = model(torch.randint(0, 32, (2, 9)))
    logits.square().mean().backward()
    grads = [p.grad.flatten() for m in model.modules() if isinstance(m, Mixer) for p in m.parameters()]
    assert mixer_grad_norm(model) == pytest.approx(float(torch.cat(grads).norm()), rel=1e-5)


@pytest.mark.parametrize("mixer,srms", [("linear", False), ("norm", True)])
def test_score_gradients_grow_as_one_over_c_until_the_eps(mixer, srms):
    """(b)'s direct test: scaling the keys by c scales the scores (and linear attention's
    denominators) by c; both normalised forms are scale-free in them, so the gradient with respect
    to the keys grows as 1/c (3 decades at c = 1e-3) until the normaliser's eps caps it."""
    from fastweights.reproduce.transnormer import grad_metric, score_gradients

    m = model([mixer], [{}])
    x = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(3))
    got = score_gradients(m, x, [1.0, 1e-3, 1e-14], srms)
    assert got[grad_metric(1.0)] == 0.0
    assert got[grad_metric(1e-3)] == pytest.approx(3.0, abs=0.05)
    assert got[grad_metric(1e-14)] < 13.0  # the eps caps the growth short of 14 decades
