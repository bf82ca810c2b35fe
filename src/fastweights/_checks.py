"""Argument validation shared by every op and layer.

Each helper raises a ValueError/TypeError whose message names the argument, what was given and
what was expected, and is called before any computation (docs/design.md, "Bad arguments").
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensor(name: str, x: Any, ndim: int | None = None, layout: str = "") -> torch.Tensor:
    """Check that ``x`` is a floating-point tensor of rank ``ndim`` (layout names the dims)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be a floating-point tensor (float16/bfloat16/float32/float64), "
            f"got dtype {x.dtype}"
        )
    if ndim is not None and x.dim() != ndim:
        what = f" {layout}" if layout else ""
        raise ValueError(
            f"{name} must be a {ndim}-D tensor{what}, got shape {tuple(x.shape)}"
        )
    return x


def check_shape(name: str, x: torch.Tensor, expected: Sequence[int | None], layout: str) -> None:
    """Check ``x.shape`` against ``expected`` (None matches any size)."""
    ok = x.dim() == len(expected) and all(
        e is None or s == e for s, e in zip(x.shape, expected)
    )
    if not ok:
        want = "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
        raise ValueError(
            f"{name} must have shape {layout} = {want}, got {tuple(x.shape)}"
        )


def check_same_dtype_device(**tensors: torch.Tensor | None) -> None:
    """All given tensors share one dtype and one device."""
    items = [(n, t) for n, t in tensors.items() if t is not None]
    if not items:
        return
    n0, t0 = items[0]
    for n, t in items[1:]:
        if t.dtype != t0.dtype:
            raise TypeError(
                f"{n} has dtype {t.dtype} but {n0} has dtype {t0.dtype}; they must match"
            )
        if t.device != t0.device:
            raise ValueError(
                f"{n} is on device {t.device} but {n0} is on {t0.device}; they must match"
            )


def check_same_device(**tensors: torch.Tensor | None) -> None:
    """All given tensors live on one device (dtypes may differ, e.g. float32 states)."""
    items = [(n, t) for n, t in tensors.items() if t is not None]
    for n, t in items[1:]:
        if t.device != items[0][1].device:
            raise ValueError(
                f"{n} is on device {t.device} but {items[0][0]} is on {items[0][1].device}; "
                "they must match"
            )


def is_int(value: Any) -> bool:
    """A Python int that is not a bool (``True`` is an int to Python, never a size to us)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A Python int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(name: str, value: Any, minimum: int) -> int:
    """A Python int >= ``minimum`` (bools rejected): TypeError for another type, ValueError
    below the minimum."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_positive_int(name: str, value: Any) -> int:
    """A strictly positive Python int (bools rejected)."""
    if not is_int(value):
        raise TypeError(f"{name} must be a positive int, got {value!r}")
    return check_int(name, value, 1)


def check_nonneg_float(name: str, value: Any) -> float:
    """A finite float >= 0."""
    if not is_number(value):
        raise TypeError(f"{name} must be a float, got {value!r}")
    if not (value >= 0.0) or value == float("inf"):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    return float(value)


def check_finite_float(name: str, value: Any) -> float:
    """Any finite float."""
    if not is_number(value):
        raise TypeError(f"{name} must be a float, got {value!r}")
    # Comparisons rather than math.isfinite: under torch.compile(dynamic=True) a float argument
    # may be a SymFloat, which math.isfinite cannot take (NaN fails both comparisons).
    if not -math.inf < value < math.inf:
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def check_choice(name: str, value: Any, choices: Iterable[Any]) -> Any:
    """``value`` is one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """A Python bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def check_layer_input(x: Any, d_model: int) -> torch.Tensor:
    """Layer input ``x`` is ``[B, T, d_model]`` floating point with T >= 1."""
    check_tensor("x", x, 3, "[B, T, d_model]")
    if x.shape[-1] != d_model:
        raise ValueError(
            f"x must have shape [B, T, d_model] with d_model={d_model}, got {tuple(x.shape)}"
        )
    if x.shape[1] < 1 or x.shape[0] < 1:
        raise ValueError(f"x must have B >= 1 and T >= 1, got shape {tuple(x.shape)}")
    return x


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype recurrent states are kept in: float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_qkv(q: Any, k: Any, v: Any) -> tuple[int, int, int, int, int]:
    """q, k ``[B, T, H, Dk]`` and v ``[B, T, H, Dv]``: floating point, one dtype and device.

    Returns (B, T, H, Dk, Dv).
    """
    check_tensor("q", q, 4, "[B, T, H, Dk]")
    check_tensor("k", k, 4, "[B, T, H, Dk]")
    check_tensor("v", v, 4, "[B, T, H, Dv]")
    if k.shape != q.shape:
        raise ValueError(
            f"k must have the same shape as q [B, T, H, Dk] = {tuple(q.shape)}, got {tuple(k.shape)}"
        )
    if v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"v must have shape [B, T, H, Dv] with B, T, H = {tuple(q.shape[:3])} as in q, "
            f"got {tuple(v.shape)}"
        )
    B, T, H, Dk = q.shape
    if min(B, T, H, Dk, v.shape[-1]) < 1:
        raise ValueError(f"q, k, v must have non-empty dims, got q {tuple(q.shape)}, v {tuple(v.shape)}")
    check_same_dtype_device(q=q, k=k, v=v)
    return B, T, H, Dk, v.shape[-1]


def check_device(name: str, x: torch.Tensor, ref: torch.Tensor, ref_name: str = "q") -> None:
    """``x`` lives on the device of ``ref`` (the op's first input, ``q`` unless named)."""
    check_same_device(**{ref_name: ref, name: x})


def check_arg(
    name: str, x: Any, expected: Sequence[int | None], layout: str, ref: torch.Tensor,
) -> torch.Tensor:
    """The tensor-argument check of every op: ``x`` is a floating-point tensor of shape
    ``expected`` (None matches any size) on ``ref``'s device; its dtype may differ from q's
    (parameters and states are upcast to the compute dtype with the inputs)."""
    check_tensor(name, x)
    check_shape(name, x, expected, layout)
    check_device(name, x, ref)
    return x


def matrix_state(
    initial_state: Any, shape: tuple[int, int, int, int], ref: torch.Tensor, dtype: torch.dtype,
    name: str = "initial_state",
) -> torch.Tensor:
    """The single-matrix state S [B, H, Dk, Dv] of an op (delta rule, decayed linear attention):
    zeros when ``initial_state`` is None, else the checked tensor (a 1-tuple is unwrapped) in
    ``dtype``; ``name`` is the argument's in messages."""
    if initial_state is None:
        return ref.new_zeros(shape, dtype=dtype)
    if isinstance(initial_state, (tuple, list)) and len(initial_state) == 1:
        initial_state = initial_state[0]
    check_arg(name, initial_state, shape, "[B, H, Dk, Dv]", ref)
    return initial_state if initial_state.dtype == dtype else initial_state.to(dtype)


def check_mode(mode: Any, modes: Sequence[str]) -> str:
    """``mode`` is one of ``modes``."""
    return check_choice("mode", mode, modes)


class Documents(NamedTuple):
    """Documents packed back to back in a batch of one (docs/design.md, "Packed documents"),
    checked once where a call enters the library (the model, or a layer or op called alone):
    ``bounds`` the boundaries 0 = c_0 < c_1 < ... < c_N = T as host ints, ``cu_seqlens`` the
    same boundaries as an integer tensor [N + 1] on the inputs' device (what kernels take).
    Every ``cu_seqlens=`` argument takes one; layers and ops pass it on without checking its
    values again or reading the tensor back (a device synchronisation on a GPU)."""

    bounds: tuple[int, ...]
    cu_seqlens: torch.Tensor

    @property
    def count(self) -> int:
        """N, the number of documents."""
        return len(self.bounds) - 1

    def spans(self) -> list[tuple[int, int]]:
        """(start, stop) of every document."""
        return list(itertools.pairwise(self.bounds))

    @classmethod
    def of(cls, bounds: Sequence[int], device: torch.device | str) -> Documents:
        """Documents with these (host) boundaries, checked; the tensor made on ``device``."""
        bounds = tuple(int(b) for b in bounds)
        _check_bounds(bounds, bounds[-1] if bounds else 0)
        return cls(bounds, torch.tensor(bounds, dtype=torch.int32, device=device))


def _check_bounds(bounds: Sequence[int], T: int) -> None:
    if len(bounds) < 2:
        raise ValueError(f"cu_seqlens must hold N + 1 >= 2 boundaries, got {list(bounds)}")
    if bounds[0] != 0 or bounds[-1] != T:
        raise ValueError(f"cu_seqlens must start at 0 and end at T = {T}, got {bounds[0]} ... {bounds[-1]}")
    if any(b <= a for a, b in itertools.pairwise(bounds)):
        raise ValueError(f"cu_seqlens must be strictly increasing (no empty documents), got {list(bounds)}")


def _check_batch(batch: int) -> None:
    if batch != 1:
        raise ValueError(f"packed sequences (cu_seqlens) need batch size B = 1, got B = {batch}")


def check_documents(cu_seqlens: Any, T: int, batch: int, device: torch.device) -> Documents:
    """``cu_seqlens`` for a packed batch of length T (B = ``batch`` must be 1) on ``device``,
    as ``Documents``: a ``Documents`` is taken as it is (its last boundary checked against T,
    on the host); a tensor is validated and read back once."""
    if isinstance(cu_seqlens, Documents):
        _check_batch(batch)
        if cu_seqlens.bounds[-1] != T:
            raise ValueError(f"cu_seqlens must end at T = {T}, got {cu_seqlens.bounds[-1]}")
        return cu_seqlens
    check_cu_seqlens_tensor(cu_seqlens, batch, device)
    return documents_from(cu_seqlens.tolist(), cu_seqlens, T)  # the one read back to the host


def check_cu_seqlens_tensor(cu_seqlens: Any, batch: int, device: torch.device) -> torch.Tensor:
    """What can be checked of a ``cu_seqlens`` tensor without reading it: type, shape, dtype,
    device, and B = ``batch`` = 1."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a 1-D integer torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be a 1-D tensor [N + 1] with N >= 1, got shape {tuple(cu_seqlens.shape)}"
        )
    if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"cu_seqlens must have an integer dtype, got {cu_seqlens.dtype}")
    _check_batch(batch)
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on device {cu_seqlens.device} but q is on {device}; they must match")
    return cu_seqlens


def documents_from(bounds: Sequence[int], cu_seqlens: torch.Tensor, T: int) -> Documents:
    """``Documents`` from the values of ``cu_seqlens`` already read back (``bounds``), checked
    against T (a caller that reads other values too reads them all at once)."""
    bounds = tuple(int(c) for c in bounds)
    _check_bounds(bounds, T)
    return Documents(bounds, cu_seqlens)


def check_packed_states(initial_state: Any, n_docs: int) -> list[Any]:
    """``initial_state`` under cu_seqlens: None or a list/tuple of one state per document."""
    if initial_state is None:
        return [None] * n_docs
    if not isinstance(initial_state, list) or len(initial_state) != n_docs:
        got = f"a list of {len(initial_state)}" if isinstance(initial_state, list) else type(initial_state).__name__
        raise ValueError(
            f"with cu_seqlens, initial_state must be None or a list with one state per document "
            f"({n_docs}), got {got}"
        )
    return initial_state
