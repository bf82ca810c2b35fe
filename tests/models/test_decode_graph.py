"""A decoding step without host reads (docs/design.md, "Decoding graphs", "Host reads"): for every
mixer the one-token step reads nothing back to the host and compiles whole
(``torch.compile(fullgraph=True)``), from the state a forward leaves and from its static form;
the model's step on static buffers (``DecodeGraph`` without capture, the code path a CUDA graph
records) equals eager decoding, in float64, across block, segment and mini-batch boundaries."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from fastweights import build_mixer, mixer_names, state_tree
from fastweights.models.config import LMConfig
from fastweights.models.graph import DecodeGraph
from fastweights.models.lm import LanguageModel
from fastweights.ops import reading_nothing
from fastweights.testing import HostReads
from tests.helpers import assert_close64

# Small block, segment, window and mini-batch sizes, so that the decoded steps cross them.
OPTIONS = {"ttt-linear": {"mini_batch_size": 4}, "ttt-mlp": {"mini_batch_size": 4},
           "infini": {"segment_len": 4}, "diag": {"block_size": 4}, "aft-conv": {"window": 4},
           "aft-full": {"max_len": 64}, "aft-local": {"window": 4, "max_len": 64},
           "norm": {"decay": True}}
NO_STATIC_FORM: set[str] = set()  # every mixer has a static form
PROMPT, STEPS = 7, 6


def _layer(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = build_mixer(name, 16, 2, **OPTIONS.get(name, {})).double().eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return layer


def _x() -> torch.Tensor:
    return torch.randn(2, PROMPT + STEPS, 16, generator=torch.Generator().manual_seed(1),
                       dtype=torch.float64)


@pytest.mark.parametrize("name", mixer_names())
@pytest.mark.parametrize("form", ["forward", "static"])
@torch.no_grad()
def test_a_step_reads_nothing_and_compiles_whole(name, form):
    """Every one-token step from the prompt's state (as forward left it, or in its static
    form, under ``reading_nothing``) reads nothing back to the host; compiled with
    fullgraph=True (the static form, or the forward's where there is none) it gives the eager
    step's output and state."""
    if form == "static" and name in NO_STATIC_FORM:
        pytest.skip("no static form")
    layer, x = _layer(name), _x()
    _, state = layer(x[:, :PROMPT])
    if form == "static":
        state = layer.static_state(state, PROMPT + STEPS)
    start = state_tree.map_tensors(torch.clone, state)
    # The static forms' steps run under reading_nothing, as LanguageModel.step runs them (the
    # rows forms otherwise read which rows complete a block, segment or mini-batch, which an
    # eager multistream decode does on purpose: it then commits only those).
    with HostReads() as seen, reading_nothing() if form == "static" else nullcontext():
        for t in range(PROMPT, PROMPT + STEPS):
            y, state = layer(x[:, t:t + 1], state)
    assert seen.reads == [], seen.reads
    if form == "forward" and name not in NO_STATIC_FORM:
        return  # compiled below in its static form, what a CUDA graph captures
    torch._dynamo.reset()
    compiled = torch.compile(lambda xt, s: layer(xt, s), fullgraph=True, backend="eager")
    state, cstate = start, state_tree.map_tensors(torch.clone, start)
    for t in range(PROMPT, PROMPT + 2):
        y, state = layer(x[:, t:t + 1], state)
        cy, cstate = compiled(x[:, t:t + 1], cstate)
        assert_close64(cy, y, what=f"{name} step {t}")
    for a, b in zip(state_tree.tensors(cstate), state_tree.tensors(state)):
        assert_close64(a, b, what=f"{name} state")


@pytest.mark.parametrize("name", sorted(set(mixer_names()) - NO_STATIC_FORM))
@torch.no_grad()
def test_static_buffers_decode_as_eager_steps(name):
    """A 2-layer model decoding on static buffers (``DecodeGraph`` without capture) gives the
    logits of eager one-token forwards at every step, reads nothing back to the host, and
    leaves the caller's state as it was."""
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=40, d_model=16, n_layers=2, n_heads=2,
                                   mixer=name, mixer_options=OPTIONS.get(name, {}))).double().eval()
    ids = torch.randint(0, 40, (3, PROMPT + STEPS), generator=torch.Generator().manual_seed(2))
    _, prompt_state = model(ids[:, :PROMPT])
    kept = state_tree.map_tensors(torch.clone, prompt_state)
    graph = DecodeGraph(model, prompt_state, ids[:, PROMPT:PROMPT + 1], PROMPT + STEPS,
                        capture=False)
    with HostReads() as seen:
        outs = [graph(ids[:, t:t + 1]).clone() for t in range(PROMPT, PROMPT + STEPS)]
    assert seen.reads == [], seen.reads
    for a, b in zip(state_tree.tensors(prompt_state), state_tree.tensors(kept)):
        assert torch.equal(a, b), "the caller's state changed"
    state = prompt_state
    for t, got in zip(range(PROMPT, PROMPT + STEPS), outs):
        want, state = model(ids[:, t:t + 1], state)
        assert_close64(got, want, what=f"{name} token {t}")


@torch.no_grad()
def test_generate_on_static_buffers_equals_eager_and_refuses_what_it_cannot_do():
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=40, d_model=16, n_layers=2, n_heads=2,
                                   mixer=["ttt-linear", "softmax"],
                                   mixer_options=[{"mini_batch_size": 4}, {}])).eval()
    ids = torch.randint(0, 40, (2, 5))
    with pytest.raises(ValueError, match="graph=True captures a CUDA graph"):
        model.generate(ids, 3, graph=True)
    with pytest.raises(TypeError, match="graph must be None or a bool"):
        model.generate(ids, 3, graph="yes")
    with pytest.raises(ValueError, match=r"input_ids must be a long tensor \[B, 1\]"):
        model.step(ids, None)
    full = LanguageModel(LMConfig(vocab_size=40, d_model=16, n_layers=1, n_heads=2,
                                  mixer="aft-full", mixer_options={"max_len": 32}))
    with pytest.raises(ValueError, match=r"max_len must be in \[5, 32\]"):
        full.static_state(full(ids)[1], 33)  # past the positions of the layer's bias table
    cache = full.static_state(full(ids)[1], 16)
    with pytest.raises(ValueError, match="continues one token per call"):
        full(ids, cache)
    short = LanguageModel(LMConfig(vocab_size=40, d_model=16, n_layers=1, n_heads=2,
                                   mixer="aft-local", mixer_options={"window": 8}))
    with pytest.raises(ValueError, match="window - 1"):
        short.static_state(short(ids)[1], 16)
