"""torch.export / ONNX programs of LanguageModel (models/export.py) against eager, every mixer."""

from __future__ import annotations

import pytest
import torch

from fastweights.models import LanguageModel, LMConfig
from fastweights.models.export import export_forward, export_step, export_step_onnx
from fastweights.models.registry import mixer_names
from fastweights.state_tree import flatten, unflatten

# Fixed-size states, and growing caches that one program follows (module docstring).
REUSABLE = ["linear", "dpfp", "favor", "delta", "aft-simple", "softmax", "infini", "diag",
            "gated-delta"]
ONNX_STEP = ["linear", "delta", "softmax", "ttt-linear", "gated-delta"]  # checked with onnxruntime


def _model(name: str, seed: int = 0) -> LanguageModel:
    torch.manual_seed(seed)
    return LanguageModel(LMConfig(vocab_size=29, d_model=12, n_layers=1, n_heads=2,
                                  mixer=name)).eval()


def _ids(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 29, (B, T), generator=torch.Generator().manual_seed(seed))


def _assert_same(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", mixer_names())
def test_forward_export_matches_eager(name):
    model, ids = _model(name), _ids(2, 13)
    program = export_forward(model, ids).module()
    with torch.no_grad():
        logits, state = model(ids)
    _assert_same(program(ids), [logits, *flatten(state)[0]])


@pytest.mark.parametrize(("name", "multiple", "T"), [("softmax", 1, 21), ("diag", 64, 128)])
def test_forward_export_dynamic_length(name, multiple, T):
    model = _model(name)
    program = export_forward(model, _ids(2, multiple * 2 if multiple > 1 else 8), dynamic=True,
                             multiple=multiple).module()
    ids = _ids(2, T, seed=3)
    with torch.no_grad():
        logits, state = model(ids)
    _assert_same(program(ids), [logits, *flatten(state)[0]])


@pytest.mark.parametrize("name", mixer_names())
def test_step_export_matches_eager(name):
    """Static shapes: every mixer's step equals eager (logits and every state tensor)."""
    model, ids = _model(name), _ids(2, 9)
    with torch.no_grad():
        _, state = model(ids)
        nxt = _ids(2, 1, seed=5)
        logits, new = model(nxt, state)
    step = export_step(model, state, nxt, dynamic=False)
    tensors, _ = flatten(state)
    _assert_same(step.program.module()(nxt, *[t.contiguous() for t in tensors]),
                 [logits, *flatten(new)[0]])


@pytest.mark.parametrize("name", REUSABLE)
def test_step_program_decodes_from_its_own_state(name):
    """One program with dynamic cache lengths, fed back its own state for several tokens."""
    model, ids = _model(name), _ids(2, 9)
    with torch.no_grad():
        _, state = model(ids)
    step = export_step(model, state, _ids(2, 1, seed=5))
    assert step.reusable
    run = step.program.module()
    carried = [t.contiguous() for t in flatten(state)[0]]
    for i in range(3):
        nxt = _ids(2, 1, seed=10 + i)
        with torch.no_grad():
            logits, state = model(nxt, state)
        out = run(nxt, *carried)
        _assert_same(out, [logits, *flatten(state)[0]])
        carried = list(out[1:])


@pytest.mark.parametrize("name", ["norm", "ttt-linear", "aft-local"])
def test_step_with_position_in_state_is_marked_one_shot(name):
    model, ids = _model(name), _ids(2, 9)
    with torch.no_grad():
        _, state = model(ids)
    assert not export_step(model, state, _ids(2, 1), dynamic=False).reusable


def test_state_layout_round_trip():
    model = _model("ttt-linear")
    with torch.no_grad():
        _, state = model(_ids(2, 5))
    tensors, layout = flatten(state)
    again = unflatten(tensors, layout)
    assert flatten(again)[1].same_as(layout)
    with pytest.raises(ValueError, match="holds"):
        unflatten(tensors[:-1], layout)


def test_export_keeps_eager_checks():
    model = _model("delta")
    with pytest.raises(ValueError, match=r"ids in \[0, 29\)"):
        export_forward(model, torch.tensor([[3, 29]]))
    with pytest.raises(ValueError, match=r"\[B, 1\]"):
        export_step(model, None, _ids(1, 2))
    with pytest.raises(TypeError, match="LanguageModel"):
        export_forward(torch.nn.Linear(2, 2), _ids(1, 2))
    with pytest.raises(ValueError, match=r"ids in \[0, 29\)"):
        model(torch.tensor([[-1]]))  # the eager check is still there


@pytest.mark.parametrize("name", ONNX_STEP)
def test_onnx_step_matches_eager(name, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    model, ids = _model(name), _ids(2, 9)
    with torch.no_grad():
        _, state = model(ids)
        nxt = _ids(2, 1, seed=5)
        logits, new = model(nxt, state)
    path = tmp_path / "step.onnx"
    export_step_onnx(model, state, nxt, str(path))
    tensors = flatten(state)[0]
    feeds = {"input_ids": nxt.numpy(), **{f"state_{i}": t.contiguous().numpy()
                                          for i, t in enumerate(tensors)}}
    out = ort.InferenceSession(str(path)).run(None, feeds)
    _assert_same([torch.from_numpy(o) for o in out], [logits, *flatten(new)[0]])
