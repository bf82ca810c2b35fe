"""The state-tree module: flatten/unflatten, map, tensors, bytes and row concatenation."""

from typing import NamedTuple

import pytest
import torch

from fastweights import state_tree


class Pair(NamedTuple):
    S: torch.Tensor
    pos: int


def _state(rows: int = 2, pos: int = 3):
    return [Pair(torch.randn(rows, 4), pos), None, (torch.zeros(rows, 2, dtype=torch.long), 7)]


def test_flatten_unflatten_round_trip_keeps_types_and_constants():
    state = _state()
    tensors, layout = state_tree.flatten(state)
    assert len(tensors) == layout.num_tensors == 2
    again = state_tree.unflatten(tensors, layout)
    assert type(again[0]) is Pair and again[0].pos == 3 and again[1] is None and again[2][1] == 7
    assert again[0].S is state[0].S
    assert state_tree.flatten(again)[1].same_as(layout)
    assert not state_tree.flatten(_state(pos=4))[1].same_as(layout)
    with pytest.raises(ValueError, match="holds 2 tensors, got 1"):
        state_tree.unflatten(tensors[:1], layout)


def test_map_tensors_tensors_and_nbytes():
    state = _state()
    doubled = state_tree.map_tensors(lambda t: t * 2, state)
    assert torch.equal(doubled[0].S, state[0].S * 2) and doubled[0].pos == 3
    assert [t.shape for t in state_tree.tensors(state)] == [(2, 4), (2, 2)]
    assert state_tree.nbytes(state) == 2 * 4 * 4 + 2 * 2 * 8
    assert state_tree.tensors(None) == [] and state_tree.map_tensors(torch.neg, None) is None


def test_a_tuple_subclass_with_hidden_tensors_is_refused():
    class Odd(tuple):
        pass

    with pytest.raises(TypeError, match="cannot hold a Odd"):
        state_tree.flatten([Odd((torch.zeros(1),))])


def test_cat_rows_concatenates_along_the_batch_and_names_what_differs():
    a, b = _state(rows=2), _state(rows=3)
    out = state_tree.cat_rows([a, b], "states")
    assert out[0].S.shape == (5, 4) and out[0].pos == 3 and out[2][0].shape == (5, 2)
    assert torch.equal(out[0].S, torch.cat([a[0].S, b[0].S]))
    assert state_tree.cat_rows([a, b], "states", [2, 3])[0].S.shape == (5, 4)
    with pytest.raises(ValueError, match=r"cannot stack states\[0\]\.S"):
        state_tree.cat_rows([a, b], "states", [3, 2])
    with pytest.raises(ValueError, match=r"cannot stack states\[0\]\.pos: values \[3, 4\]"):
        state_tree.cat_rows([a, _state(pos=4)], "states")
    with pytest.raises(ValueError, match="differ in structure"):
        state_tree.cat_rows([a, a[:2]], "states")
    with pytest.raises(ValueError, match="differ beyond the batch dim"):
        state_tree.cat_rows([torch.zeros(1, 2), torch.zeros(1, 3)], "k")
    with pytest.raises(ValueError, match="differ beyond the batch dim"):
        state_tree.cat_rows([torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.float64)], "k")
