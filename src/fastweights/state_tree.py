"""State trees: the one walker of the states layers and models carry.

A state is a tree of lists, tuples and NamedTuples (docs/design.md, "State layouts") whose leaves
are tensors, ints and None (``LanguageModel``'s state is the list of its layers' states). Every
user of states walks them here, on ``torch.utils._pytree``: the Hugging Face cache (map rows,
concatenate groups, count bytes), the language model (gradient checkpointing passes a state as
flat tensors), the trainer (detach, gather), context parallelism (send a state's structure and
tensors separately), export (a program takes flat tensors) and multistream decoding
(``Mixer.stack_states`` concatenates states row-wise).

- ``flatten(state) -> (tensors, layout)`` and ``unflatten(tensors, layout)``: the tensors in
  order and a ``Layout`` (structure and the non-tensor leaves) that rebuilds the state;
- ``tensors(state)``, ``nbytes(state)``, ``map_tensors(fn, state)``;
- ``cat_rows(states, what)``: states of one structure concatenated along the batch (dim 0).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

__all__ = ["Layout", "cat_rows", "flatten", "map_tensors", "nbytes", "tensors", "unflatten"]


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a state flattens: its pytree structure, the position of every tensor leaf and the
    values of the other leaves (ints, None), fixed for every state of this layout."""

    spec: pytree.TreeSpec
    tensor_slots: tuple[int, ...]
    constants: tuple[Any, ...]  # every leaf, tensors as None

    @property
    def num_tensors(self) -> int:
        return len(self.tensor_slots)

    def same_as(self, other: Layout) -> bool:
        """Same structure and the same non-tensor leaves: one flat form serves both."""
        return (self.spec == other.spec and self.tensor_slots == other.tensor_slots
                and self.constants == other.constants)


def _leaves(state: Any) -> tuple[list[Any], pytree.TreeSpec]:
    leaves, spec = pytree.tree_flatten(state)
    for leaf in leaves:
        # A list/tuple subclass that is not a NamedTuple (one with extra attributes) is a leaf
        # to pytree: its tensors would pass unseen, so it is refused.
        if isinstance(leaf, (list, tuple)):
            raise TypeError(f"a state cannot hold a {type(leaf).__name__} (only lists, tuples, "
                            "NamedTuples, tensors, ints and None)")
    return leaves, spec


def flatten(state: Any) -> tuple[list[torch.Tensor], Layout]:
    """A state -> (its tensors in order, its layout)."""
    leaves, spec = _leaves(state)
    slots = tuple(i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor))
    constants = tuple(None if isinstance(x, torch.Tensor) else x for x in leaves)
    return [leaves[i] for i in slots], Layout(spec, slots, constants)


def unflatten(tensors: Sequence[torch.Tensor], layout: Layout) -> Any:
    """Inverse of ``flatten``: the state of ``layout`` holding ``tensors``."""
    if len(tensors) != layout.num_tensors:
        raise ValueError(f"the state layout holds {layout.num_tensors} tensors, got {len(tensors)}")
    leaves = list(layout.constants)
    for i, t in zip(layout.tensor_slots, tensors):
        leaves[i] = t
    return pytree.tree_unflatten(leaves, layout.spec)


def tensors(state: Any) -> list[torch.Tensor]:
    """The tensors of a state, in order."""
    return flatten(state)[0]


def nbytes(state: Any) -> int:
    """Bytes held by the tensors of a state."""
    return sum(t.numel() * t.element_size() for t in tensors(state))


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], state: Any) -> Any:
    """The state with ``fn`` applied to every tensor, everything else kept:
    ``map_tensors(torch.Tensor.detach, s)`` cuts the graph of a carried state."""
    ts, layout = flatten(state)
    return unflatten([fn(t) for t in ts], layout)


def cat_rows(states: Sequence[Any], what: str, sizes: Sequence[int] | None = None) -> Any:
    """States of one structure concatenated row-wise: tensors along dim 0, every other leaf
    required to be equal in all of them. ``sizes`` (optional) are the states' batch sizes,
    which every tensor's first dim must then be. ValueError naming ``what`` (and the leaf)
    when the structures, the tensors' other dims or dtypes, or the other leaves differ
    (streams at different positions)."""
    _leaves(states[0])
    paths, spec = pytree.tree_flatten_with_path(states[0])
    columns = [[leaf for _, leaf in paths]]
    for s in states[1:]:
        leaves, other = _leaves(s)
        if other != spec:
            raise ValueError(f"cannot stack {what}: the states differ in structure")
        columns.append(leaves)
    rows = [None] * len(states) if sizes is None else list(sizes)
    out = []
    for i, (path, first) in enumerate(paths):
        items = [c[i] for c in columns]
        name = what + pytree.keystr(path)
        if isinstance(first, torch.Tensor):
            if not all(isinstance(x, torch.Tensor) and x.dim() == first.dim() and x.dim() >= 1
                       and x.shape[1:] == first.shape[1:] and x.dtype == first.dtype
                       and n in (None, x.shape[0]) for x, n in zip(items, rows)):
                shapes = [f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor)
                          else type(x).__name__ for x in items]
                raise ValueError(f"cannot stack {name}: tensors of shapes {shapes} differ beyond "
                                 "the batch dim (streams at different positions, which this "
                                 "layer cannot hold per row)")
            out.append(torch.cat(items))
        elif any(isinstance(x, torch.Tensor) or not (x is first or x == first) for x in items):
            raise ValueError(f"cannot stack {name}: values {items} differ (streams at "
                             "different positions, which this layer cannot hold per row)")
        else:
            out.append(first)
    return pytree.tree_unflatten(out, spec)
