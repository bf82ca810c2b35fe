"""A language model's decoding step on static buffers, captured once in a CUDA graph and replayed
per token (docs/design.md, "Decoding graphs").

``DecodeGraph(model, state, ids, max_len)`` puts the state a prefill left into its static form
(``LanguageModel.static_state``: every tensor keeps its shape and address from step to step) and
the next token's ids into a buffer; a call ``graph(ids) -> logits [B, 1, V]`` copies the ids in,
runs ``LanguageModel.step`` (which reads nothing back to the host) and copies the state after
the token back into the same buffers. With ``capture`` (CUDA) the step is warmed up on a side
stream (the layers keep what they make once, such as a TTT layer's token scales), the buffers
restored, and one ``torch.cuda.CUDAGraph`` recorded; each call then replays it: one launch of
the whole step instead of a launch per operation with Python in between. Without ``capture``
(any device) the same buffers and copies run eagerly: the code path the tests check on a CPU.

Dimension legend: B batch, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import state_tree
from ..ops import reading_nothing

__all__ = ["WARMUP_STEPS", "DecodeGraph"]

WARMUP_STEPS = 3  # eager steps on a side stream before capture (CUDA's advice: several)


class DecodeGraph:
    """One decoding step of ``model`` on static buffers (see the module docstring).

    model: a ``LanguageModel`` in eval mode (anything with its ``static_state`` and ``step``);
    state: what a forward over the prompt returned; ids [B, 1] long: the
    first token to decode (its values only shape the buffer); max_len: the longest sequence the
    caches must hold (prompt and new tokens). ``capture`` (default: the model is on CUDA)
    records the step as a CUDA graph. TypeError or ValueError when a mixer's state has no
    static form (``LanguageModel.static_state``)."""

    def __init__(self, model: Any, state: list[Any], ids: torch.Tensor, max_len: int,
                 capture: bool | None = None) -> None:
        self.model = model
        self.state = model.static_state(state, max_len)
        self.tensors, self.layout = state_tree.flatten(self.state)
        # The static form's tensors are the buffers: fresh, so that the caller's state is left
        # as it was and nothing else aliases what the graph writes.
        self.tensors = [t.clone() for t in self.tensors]
        self.state = state_tree.unflatten(self.tensors, self.layout)
        self.ids = ids.clone()
        self.capture = ids.is_cuda if capture is None else capture
        self.graph: Any = None
        self.logits: torch.Tensor | None = None
        if self.capture:
            self._record()

    def _step(self) -> torch.Tensor:
        """The step on the buffers: the state after the token copied back into them."""
        logits, new = self.model.step(self.ids, self.state)
        tensors, layout = state_tree.flatten(new)
        if not layout.same_as(self.layout):
            raise RuntimeError("a decoding step changed its state's layout; its mixer's "
                               "static_state is not static")
        for buffer, value in zip(self.tensors, tensors):
            buffer.copy_(value)  # (a no-op for a buffer the step wrote in place)
        return logits

    def _record(self) -> None:
        """Warm up on a side stream, put the buffers back, record the step."""
        saved = [t.clone() for t in self.tensors]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(WARMUP_STEPS):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        for buffer, value in zip(self.tensors, saved):
            buffer.copy_(value)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.no_grad(), reading_nothing():
            self.logits = self._step()

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """The logits [B, 1, V] of the next token ``ids`` [B, 1] (the state advances). The
        logits live in a buffer the next call overwrites."""
        self.ids.copy_(ids)
        if self.graph is None:
            with torch.no_grad():
                return self._step()
        self.graph.replay()
        return self.logits
