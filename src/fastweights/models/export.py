"""``torch.export`` and ONNX programs of a ``LanguageModel``: the forward and the decoding step.

A model's state is a list of per-layer states, each a (possibly nested) tuple of tensors, ints
and None. Exported programs take and return flat tensors only, so the state crosses the program
boundary as the list of its tensor leaves in ``torch.utils._pytree`` order
(``fastweights.state_tree.flatten``); its structure and its non-tensor leaves (the position
counters some mixers carry) are a ``state_tree.Layout`` fixed when the program is exported.

- ``ForwardModule(model)``: ``input_ids [B, T] -> (logits [B, T, V], *state tensors)``, the
  prefill from the start of a sequence.
- ``StepModule(model, layout)``: ``input_ids [B, 1], *state tensors -> (logits [B, 1, V],
  *state tensors)``, one decoding step from a carried state.

What an exported program covers, per mixer (the tests check every claim; ``export_step``
reports it as ``reusable``):

- Forward, static T: every registered mixer. Dynamic T (``dynamic=True``): softmax (any T)
  and diag (T a multiple of its block size, ``multiple=``), whose forms have no loop over chunks; the chunked recurrent forms (linear, dpfp, favor, delta,
  norm, infini, ttt-*) loop over chunks / mini-batches / segments in Python, and the AFT forms'
  exact fallback scans in log2(T) steps, so their programs are specialised to the traced T.
- Decoding step: every mixer's step exports from a given state and equals eager there
  (``dynamic=False``: every shape is the state's). With ``dynamic=True`` (the default) the
  cache lengths that grow by a step are dynamic dimensions, and the program is *reusable*
  (valid for the state it returns, so one program decodes any number of tokens) for linear,
  dpfp, favor, delta, aft-simple (fixed-size states), softmax, infini and diag (growing
  caches). aft-full, aft-local, and aft-conv while its cache is still filling cannot take a
  dynamic cache length (their exact fallback scans in log2(length) steps), so export them with
  ``dynamic=False``; aft-conv with a full cache (s - 1 tokens) is reusable either way. Mixers
  whose state carries a Python int (norm: the LRPE position, aft-local: the bias row, ttt-*:
  the place in the mini-batch, which also changes the state's structure) get a program for the
  exported position only (``reusable`` False).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch
from torch import nn

from .. import state_tree
from .._checks import check_positive_int
from .lm import LanguageModel, LMState


class ForwardModule(nn.Module):
    """``input_ids [B, T] -> (logits [B, T, V], *state tensors)``: the model's forward from the
    start of a sequence with the final state flattened (``state_tree.flatten``)."""

    def __init__(self, model: LanguageModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits, state = self.model(input_ids)
        return (logits, *_dense(state_tree.flatten(state)[0]))


class StepModule(nn.Module):
    """``input_ids [B, 1], *state tensors -> (logits [B, 1, V], *state tensors)``: one decoding
    step of the model from the state ``state_tree.unflatten(tensors, layout)``."""

    def __init__(self, model: LanguageModel, layout: state_tree.Layout) -> None:
        super().__init__()
        self.model = model
        self.layout = layout

    def forward(self, input_ids: torch.Tensor, *state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        logits, new = self.model(input_ids, state_tree.unflatten(state, self.layout))
        return (logits, *_dense(state_tree.flatten(new)[0]))


def _dense(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies where needed: an exported program checks its inputs' strides, so the
    state it returns must be laid out as the state it takes (a cache sliced from a projection
    would not be)."""
    return [t.contiguous() for t in tensors]


@dataclasses.dataclass
class ExportedStep:
    """An exported decoding step: ``program`` maps (input_ids [B, 1], *state tensors in
    ``layout``) to (logits, *state tensors in ``out_layout``). ``reusable``: its output state has
    the input's layout, so the program can be fed its own state (module docstring)."""

    program: torch.export.ExportedProgram
    layout: state_tree.Layout
    out_layout: state_tree.Layout
    reusable: bool


def _check_model(model: Any) -> LanguageModel:
    if not isinstance(model, LanguageModel):
        raise TypeError(f"model must be a LanguageModel, got {type(model).__name__}")
    return model


def _check_ids(input_ids: Any, model: LanguageModel, name: str) -> torch.Tensor:
    # The model's own check (type, shape, id range) in eager mode, before any tracing.
    model._check_ids(input_ids, name)
    return input_ids


def export_forward(model: LanguageModel, input_ids: torch.Tensor, *,
                   dynamic: bool = False, multiple: int = 1) -> torch.export.ExportedProgram:
    """``torch.export`` of ``ForwardModule(model)`` traced on ``input_ids`` [B, T].

    ``dynamic``: T is a dynamic dimension, any multiple of ``multiple`` (diag needs its block
    size; the mixers that allow it: module docstring); a mixer that would specialise T makes
    ``torch.export`` raise. The model is exported in eval mode."""
    model = _check_model(model)
    ids = _check_ids(input_ids, model, "input_ids")
    if not isinstance(dynamic, bool):
        raise TypeError(f"dynamic must be a bool, got {dynamic!r}")
    check_positive_int("multiple", multiple)
    shapes = None
    if dynamic:
        if ids.shape[1] % multiple:
            raise ValueError(f"input_ids must have a length that is a multiple of multiple="
                             f"{multiple} for a dynamic export, got {ids.shape[1]}")
        top = (model.config.max_seq_len or 2**20) // multiple
        T = torch.export.Dim("T_blocks", min=1, max=max(top, 2)) * multiple if multiple > 1 \
            else torch.export.Dim("T", min=1, max=max(top, 2))
        shapes = ({1: T},)
    with _eval(model):
        return torch.export.export(ForwardModule(model), (ids,), dynamic_shapes=shapes)


def _step_shapes(layout: state_tree.Layout, before: list[torch.Tensor],
                 after_layout: state_tree.Layout,
                 after: list[torch.Tensor]) -> tuple[Any, ...] | None:
    """Dynamic-shape spec of (input_ids, *state): every state dim that a step changes (a cache
    that grows by one token) is ``Dim.DYNAMIC`` (export fails rather than specialise it); the
    rest is static. None (all static) when the step returns a state of another layout (a
    position counter or the structure changes): no program could take its own output then, and
    a shape tied to such a constant is one the trace specialises."""
    if not after_layout.same_as(layout):
        return None
    specs: list[Any] = []
    for t, a in zip(before, after):
        dims = {d: torch.export.Dim.DYNAMIC for d in range(t.dim()) if a.shape[d] != t.shape[d]}
        specs.append(dims or None)
    return (None, tuple(specs))  # StepModule.forward(input_ids, *state)


def export_step(model: LanguageModel, state: LMState, input_ids: torch.Tensor, *,
                dynamic: bool = True) -> ExportedStep:
    """``torch.export`` of one decoding step (``StepModule``) from ``state`` (as the model's
    forward returns it) with the next tokens ``input_ids`` [B, 1]. With ``dynamic`` the cache
    dimensions that grow by a step are dynamic (``torch.export`` raises for a mixer that cannot
    keep them so: module docstring); otherwise every shape is that of ``state``.
    The model is exported in eval mode."""
    model = _check_model(model)
    ids = _check_ids(input_ids, model, "input_ids")
    if not isinstance(dynamic, bool):
        raise TypeError(f"dynamic must be a bool, got {dynamic!r}")
    if ids.shape[1] != 1:
        raise ValueError(f"input_ids must have shape [B, 1] (one token per sequence), got {tuple(ids.shape)}")
    tensors, layout = state_tree.flatten(state)
    tensors = _dense(tensors)
    with _eval(model), torch.no_grad():
        _, new = model(ids, state)  # eager: checks the state and finds the growing dims
        after, out_layout = state_tree.flatten(new)
        shapes = _step_shapes(layout, tensors, out_layout, after) if dynamic else None
        program = torch.export.export(StepModule(model, layout), (ids, *tensors),
                                      dynamic_shapes=shapes)
    grows = any(a.shape != b.shape for a, b in zip(after, tensors))
    reusable = out_layout.same_as(layout) and (shapes is not None or not grows)
    return ExportedStep(program, layout, out_layout, reusable)


def export_step_onnx(model: LanguageModel, state: LMState, input_ids: torch.Tensor,
                     path: str, *, dynamic: bool = True) -> None:
    """The decoding step of ``export_step`` written as an ONNX model to ``path`` through the
    dynamo exporter (``torch.onnx.export(..., dynamo=True)``; needs onnx and onnxscript).
    Inputs are named ``input_ids, state_0, state_1, ...``, outputs ``logits, new_state_0, ...``;
    ``dynamic`` as in ``export_step``. Checked with onnxruntime for linear, dpfp, favor, delta,
    norm, softmax, diag and ttt-linear; the AFT forms (``torch.cond``, ``cummax``) and infini do
    not convert with torch 2.13's exporter."""
    model = _check_model(model)
    ids = _check_ids(input_ids, model, "input_ids")
    tensors, layout = state_tree.flatten(state)
    with _eval(model), torch.no_grad():
        _, new = model(ids, state)
        after, out_layout = state_tree.flatten(new)
        names = [f"state_{i}" for i in range(len(tensors))]
        out_names = [f"new_state_{i}" for i in range(len(after))]
        torch.onnx.export(
            StepModule(model, layout), (ids, *tensors), path, dynamo=True,
            input_names=["input_ids", *names], output_names=["logits", *out_names],
            dynamic_shapes=_step_shapes(layout, tensors, out_layout, after) if dynamic else None,
            verbose=False)


def layout_json(layout: state_tree.Layout, tensors: list[torch.Tensor]) -> str:
    """A description of a flattened state for the files ``fastweights export`` writes: each
    tensor's shape and dtype and the state's fixed non-tensor entries."""
    return json.dumps({
        "state_tensors": [{"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                          for t in tensors],
        "constants": [c for c in layout.constants if c is not None],
    })


class _eval:
    """Context: the model in eval mode (dropout off), its previous mode restored after."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.was_training = model, model.training

    def __enter__(self) -> None:
        self.model.eval()

    def __exit__(self, *exc: object) -> None:
        self.model.train(self.was_training)
