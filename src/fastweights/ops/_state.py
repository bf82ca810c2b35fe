"""What every typed state shares: the check that a carried ``initial_state`` is a tuple of the
state's fields, and the check of its tensors (shape, q's device) with the cast to the compute
dtype. Each family's state is a NamedTuple (docs/design.md, "States") whose ``check`` builds on
these; a plain tuple in the same order is accepted everywhere a state is."""

from __future__ import annotations

from typing import Any, NamedTuple, TypeVar

import torch

from .._checks import check_arg, state_dtype

S = TypeVar("S", bound=NamedTuple)
Spec = tuple[tuple[int | None, ...], str]  # (expected shape, None = any size; layout for messages)


def check_items(state: Any, cls: type, what: str | None = None, name: str = "initial_state") -> None:
    """``state`` is a tuple (or list) with one item per field of ``cls``; ``what`` describes the
    expected tuple in the message (default: the field names)."""
    fields = cls._fields  # type: ignore[attr-defined]
    if not isinstance(state, (tuple, list)) or len(state) != len(fields):
        got = type(state).__name__
        if isinstance(state, (tuple, list)):
            got += f" of length {len(state)}"
        raise TypeError(f"{name} must be a tuple ({what or ', '.join(fields)}) or None, got {got}")


def checked_tensors(
    state: Any, cls: type, specs: dict[str, Spec], ref: torch.Tensor, dtype: torch.dtype,
    name: str = "initial_state",
) -> dict[str, torch.Tensor]:
    """The fields named in ``specs``, each checked (``initial_state[i] (field)`` in messages,
    ``name`` for the argument) and cast to ``dtype``."""
    out = {}
    for i, field in enumerate(cls._fields):  # type: ignore[attr-defined]
        if field in specs:
            shape, layout = specs[field]
            x = check_arg(f"{name}[{i}] ({field})", state[i], shape, layout, ref)
            out[field] = x if x.dtype == dtype else x.to(dtype)
    return out


class LinearAttnState(NamedTuple):
    """The state of the sum rule (``linear_attn``) and of the attention-normalised delta rule
    (``delta_rule_attn_norm``), here because both ops carry it: the fast weights S [B, H, Dk, Dv] = sum_t k_t^T v_t and the normaliser z [B, H, Dk] =
    sum_t k_t, in float32 (float64 for float64 inputs)."""

    S: torch.Tensor
    z: torch.Tensor

    @classmethod
    def zeros(cls, B: int, H: int, Dk: int, Dv: int, q: torch.Tensor) -> LinearAttnState:
        """The empty state for q [B, T, H, Dk] and values of size Dv."""
        cdtype = state_dtype(q.dtype)
        return cls(q.new_zeros(B, H, Dk, Dv, dtype=cdtype), q.new_zeros(B, H, Dk, dtype=cdtype))

    @classmethod
    def check(cls, state: Any, B: int, H: int, Dk: int, Dv: int, q: torch.Tensor,
              name: str = "initial_state") -> LinearAttnState:
        """A carried state for q [B, T, H, Dk] and values of size Dv, in the compute dtype
        (``name``: the argument's, in messages)."""
        check_items(state, cls, "S [B, H, Dk, Dv], z [B, H, Dk]", name)
        specs = {"S": ((B, H, Dk, Dv), "[B, H, Dk, Dv]"), "z": ((B, H, Dk), "[B, H, Dk]")}
        return cls(**checked_tensors(state, cls, specs, q, state_dtype(q.dtype), name))
