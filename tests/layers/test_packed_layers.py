"""Packed documents (cu_seqlens) through every mixer: the packed forward equals running each
document on its own, for documents of odd lengths that cross chunk, mini-batch, segment, block
and window borders, with states carried in (some mid-block, some None) and out, and for the
gradients. Variants cover the layers' parts that are not ops: the TTT Mamba convolution cache,
LRPE and rotary positions, AFT position tables, TransNormer decay, Infini's memory keys."""

from __future__ import annotations

import pytest
import torch

from fastweights import build_mixer, mixer_names
from tests.helpers import assert_close64
from tests.layers.test_contract import D_MODEL, N_HEADS, SMALL_OPTIONS

VARIANTS: list[tuple[str, dict]] = [(n, SMALL_OPTIONS.get(n, {})) for n in mixer_names()] + [
    ("ttt-linear", {"mini_batch_size": 4, "mamba_backbone": True}),
    ("ttt-mlp", {"mini_batch_size": 3, "mamba_backbone": True, "mode": "primal"}),
    ("ttt-linear", {"mini_batch_size": 4, "rope": False, "inner_norm": False, "residual": False}),
    ("norm", {"chunk_size": 4, "decay": True}),
    ("norm", {"chunk_size": 3, "lrpe": False, "mode": "recurrent"}),
    ("diag", {"block_size": 3, "kernel": "relu"}),
    ("infini", {"segment_len": 3, "update": "delta", "rope_memory": True}),
    ("infini", {"segment_len": 5, "rope": False, "mode": "recurrent"}),
    ("linear", {"chunk_size": 4, "normalize": "sum", "mode": "recurrent"}),
    ("aft-local", {"window": 3, "max_len": 40, "d_bias": 4, "chunk_size": 2, "mode": "recurrent"}),
    ("aft-conv", {"window": 5, "chunk_size": 4, "reparam": False}),
]
LENGTHS = [5, 1, 7, 9]  # odd, none dividing the small block sizes above
PREFIXES = [3, 0, 6, 1]  # tokens each document has seen before (0: starts with state None)


def _id(variant: tuple[str, dict]) -> str:
    name, opts = variant
    return "-".join([name] + [f"{k}={v}" for k, v in opts.items()])


def _make(name: str, opts: dict):
    torch.manual_seed(0)
    layer = build_mixer(name, D_MODEL, N_HEADS, **opts).double().eval()
    with torch.no_grad():  # non-trivial values everywhere (zero-initialised gates, kernels)
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return layer


def _leaves(state) -> list:
    """The tensors and ints of a (nested) state, in order."""
    if isinstance(state, (tuple, list)):
        return [x for s in state for x in _leaves(s)]
    return [] if state is None else [state]


def _assert_same_state(a, b, what: str) -> None:
    la, lb = _leaves(a), _leaves(b)
    assert len(la) == len(lb), f"{what}: {len(la)} != {len(lb)} items"
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor):
            # AFT log-sum-exp references may be -inf: compare exactly there.
            torch.testing.assert_close(x, y, atol=1e-9, rtol=0, msg=what)
        else:
            assert x == y, what


def _docs():
    g = torch.Generator().manual_seed(3)
    prefixes = [torch.randn(1, n, D_MODEL, generator=g, dtype=torch.float64) if n else None
                for n in PREFIXES]
    docs = [torch.randn(1, n, D_MODEL, generator=g, dtype=torch.float64) for n in LENGTHS]
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    return prefixes, docs, cu


@pytest.mark.parametrize("variant", VARIANTS, ids=_id)
def test_packed_equals_documents_with_states_in_and_out(variant):
    layer = _make(*variant)
    prefixes, docs, cu = _docs()
    states_in = [None if p is None else layer(p)[1] for p in prefixes]
    y, states_out = layer(torch.cat(docs, dim=1), states_in, cu_seqlens=cu)
    assert isinstance(states_out, list) and len(states_out) == len(docs)
    for i, (doc, s_in, s_out) in enumerate(zip(docs, states_in, states_out)):
        y_ref, s_ref = layer(doc, s_in)
        assert_close64(y[:, cu[i]:cu[i + 1]], y_ref, atol=1e-9, what=f"{_id(variant)} doc {i}")
        _assert_same_state(s_out, s_ref, f"{_id(variant)} doc {i} state")


@pytest.mark.parametrize("variant", VARIANTS, ids=_id)
def test_packed_gradients_equal_documents(variant):
    layer = _make(*variant)
    _, docs, cu = _docs()
    x = torch.cat(docs, dim=1).requires_grad_()
    y, _ = layer(x, cu_seqlens=cu)
    y.square().sum().backward()
    packed = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    x_grad = x.grad
    layer.zero_grad(set_to_none=True)
    parts = [d.clone().requires_grad_() for d in docs]
    sum(layer(d)[0].square().sum() for d in parts).backward()
    separate = {n: p.grad for n, p in layer.named_parameters() if p.grad is not None}
    assert packed.keys() == separate.keys() and packed
    for n, grad in packed.items():
        assert_close64(grad, separate[n], atol=1e-9, what=f"{_id(variant)} grad {n}")
    assert_close64(x_grad, torch.cat([d.grad for d in parts], dim=1), atol=1e-9, what="x grad")


@pytest.mark.parametrize("name", mixer_names())
def test_packed_input_is_checked(name):
    layer = _make(name, SMALL_OPTIONS.get(name, {}))
    x = torch.randn(1, 6, D_MODEL, dtype=torch.float64)
    cu = torch.tensor([0, 2, 6])
    with pytest.raises(ValueError, match="one state per document"):
        layer(x, layer(x[:, :2])[1], cu_seqlens=cu)  # a bare state, not a list
    with pytest.raises(ValueError, match="one state per document"):
        layer(x, [None], cu_seqlens=cu)
    with pytest.raises(ValueError, match="batch size B = 1"):
        layer(x.expand(2, -1, -1), cu_seqlens=cu)
    with pytest.raises(ValueError, match="end at T = 6"):
        layer(x, cu_seqlens=torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match="d_model"):
        layer(x[..., :-1], cu_seqlens=cu)
