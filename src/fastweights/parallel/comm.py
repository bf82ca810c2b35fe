"""Collectives for context parallelism, inside the autograd graph, and the shard layout.

Every function here is an autograd ``Function`` around a ``torch.distributed`` call, so a loss
computed on one rank sends its gradient back to the ranks whose tensors it used:

- ``all_gather``: forward ``dist.all_gather`` (the list form, which gloo supports), backward an
  ``all_reduce`` of the stacked gradients (every rank's tensor was used by every rank).
- ``Channel.send_state`` / ``recv_state``: point-to-point, backward sends the gradient back.
- ``tie``: returns its first argument unchanged and hands zero gradients to the others, so a
  collective whose result one rank happens not to use still takes part in every rank's
  backward pass (otherwise that rank would skip it and the others would wait forever).

Bytes moved by tensor collectives are added to ``TRAFFIC`` (forward and backward separately);
``counting()`` resets and reads it, for the benchmark.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .. import state_tree


@dataclass
class Traffic:
    """Bytes this rank sent into tensor collectives (an all-gather counts its own tensor once,
    an all-reduce its whole buffer once), by direction of the pass."""

    forward: int = 0
    backward: int = 0
    calls: list[str] = field(default_factory=list)


TRAFFIC = Traffic()


@contextlib.contextmanager
def counting() -> Iterator[Traffic]:
    """Reset ``TRAFFIC`` and yield it; read it after the block."""
    TRAFFIC.forward = TRAFFIC.backward = 0
    TRAFFIC.calls.clear()
    yield TRAFFIC


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class Shards:
    """How one sequence is split: this process's ``rank`` in ``group`` of ``world`` ranks and
    every rank's shard length (``lengths``, tokens, rank order = sequence order)."""

    group: Any
    rank: int
    world: int
    lengths: tuple[int, ...]

    @property
    def offsets(self) -> tuple[int, ...]:
        """Global position of each rank's first token, plus the total length at the end."""
        out = [0]
        for n in self.lengths:
            out.append(out[-1] + n)
        return tuple(out)

    @property
    def offset(self) -> int:
        return self.offsets[self.rank]

    @property
    def total(self) -> int:
        return self.offsets[-1]

    def border_problem(self, who: str, unit: str, size: int, already: int) -> str | None:
        """Why this layout cannot run ``who``, a mixer whose ``unit``s of ``size`` tokens must
        not cross a shard border (``already`` tokens of the carried state in the open one);
        None when every shard starts on a border."""
        bad = [r for r in range(1, self.world) if (already + self.offsets[r]) % size]
        if not bad:
            return None
        return (f"{who} needs every shard to start on a {unit} border ({unit} size {size}, "
                f"{already} token(s) already in the open {unit}); rank(s) {bad} start at global "
                f"position(s) {[self.offsets[r] for r in bad]}; shard lengths {list(self.lengths)}")


def agree(group: Any, local_error: str | None, payload: Any) -> list[Any]:
    """Exchange ``payload`` between all ranks and raise the same ValueError on every rank if any
    rank reported ``local_error`` (so one rank's bad input never leaves the others waiting in a
    collective). Returns every rank's payload, in rank order."""
    world = dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (local_error, payload), group=group)
    errors = [f"rank {r}: {err}" for r, (err, _) in enumerate(gathered) if err is not None]
    if errors:
        raise ValueError("context parallel forward refused: " + "; ".join(errors))
    return [p for _, p in gathered]


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, group: Any, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        tensor = tensor.contiguous()
        ctx.group = group
        ctx.rank = dist.get_rank(group)
        out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, tensor, group=group)
        TRAFFIC.forward += _nbytes([tensor])
        TRAFFIC.calls.append(f"all_gather {tuple(tensor.shape)}")
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[None, torch.Tensor]:
        # Rank j's tensor fed every rank: its gradient is the sum over ranks of grads[j].
        stacked = torch.stack([g.contiguous() for g in grads])
        dist.all_reduce(stacked, group=ctx.group)
        TRAFFIC.backward += _nbytes([stacked])
        return None, stacked[ctx.rank]


def all_gather(tensor: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape and dtype on all ranks), in rank order; differentiable."""
    return list(_AllGather.apply(group, tensor))


class _Tie(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
        ctx.shapes = [(o.shape, o.dtype, o.device) for o in others]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (grad, *(torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.shapes))


def tie(x: torch.Tensor, others: Sequence[torch.Tensor]) -> torch.Tensor:
    """``x`` unchanged, with ``others`` made part of its graph (zero gradient): every rank then
    runs the backward of the collectives that produced ``others``, used or not."""
    others = [o for o in others if isinstance(o, torch.Tensor) and o.requires_grad]
    return _Tie.apply(x, *others) if others else x


class _Send(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, group: Any, dst: int, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.group, ctx.dst = group, dst
        ctx.specs = [(t.shape, t.dtype, t.device) for t in tensors]
        for t in tensors:
            dist.send(t.contiguous(), group_dst=dst, group=group)
        TRAFFIC.forward += _nbytes(tensors)
        TRAFFIC.calls.append(f"send {len(tensors)} tensors")
        # A token to tie into the output: its backward receives the gradients.
        return torch.zeros((), dtype=tensors[0].dtype, device=tensors[0].device)

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[Any, ...]:
        grads = [torch.empty(s, dtype=d, device=dev) for s, d, dev in ctx.specs]
        for g in grads:
            dist.recv(g, group_src=ctx.dst, group=ctx.group)
        return (None, None, *grads)


class _Recv(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, group: Any, src: int, specs: list, anchor: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        ctx.group, ctx.src = group, src
        out = [torch.empty(s, dtype=d, device=anchor.device) for s, d in specs]
        for t in out:
            dist.recv(t, group_src=src, group=group)
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        for g in grads:
            dist.send(g.contiguous(), group_dst=ctx.src, group=ctx.group)
        TRAFFIC.backward += _nbytes(grads)
        return None, None, None, torch.zeros(())


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One 1-D buffer of ``tensors`` in their promoted dtype (one collective instead of many)."""
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return torch.cat([t.reshape(-1).to(dtype) for t in tensors])


def _unflat(buf: torch.Tensor, like: Sequence[tuple[torch.Size, torch.dtype]]) -> list[torch.Tensor]:
    out, i = [], 0
    for shape, dtype in like:
        n = int(torch.Size(shape).numel())
        out.append(buf[i:i + n].view(shape).to(dtype))
        i += n
    return out


class Channel:
    """The collectives of one layer's forward on one rank, kept in one order on every rank.

    Each collective's input is ``tie``d to the previous collective's outputs and the layer's
    output to the last one's, so the backward pass runs them in reverse order on every rank
    whatever each rank's own graph uses: no rank waits in a collective another rank reaches
    in a different order, and none skips one.
    """

    def __init__(self, shards: Shards) -> None:
        self.shards = shards
        self._last: list[torch.Tensor] = []

    def _chain(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if not self._last or not tensors:
            return list(tensors)
        return [tie(tensors[0], self._last), *tensors[1:]]

    def all_gather(self, tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Every rank's ``tensors`` (same shapes on every rank): ``out[rank][i]``. One collective."""
        tensors = self._chain(tensors)
        like = [(t.shape, t.dtype) for t in tensors]
        buf = _flat(tensors)
        if torch.is_grad_enabled() and not buf.requires_grad:
            # A rank whose share needs no gradient (a placeholder) must still take part in
            # the backward all-reduce the other ranks run: give every rank's buffer a graph.
            buf = buf.detach().requires_grad_()
        gathered = all_gather(buf, self.shards.group)
        self._last = gathered
        return [_unflat(g, like) for g in gathered]

    def send_state(self, state: Any, dst: int) -> None:
        """Send a layer state (tuple/NamedTuple of tensors, ints, None) to rank ``dst``."""
        tensors, layout = state_tree.flatten(state)
        shell = layout, [(t.shape, t.dtype) for t in tensors]
        meta = torch.frombuffer(bytearray(pickle.dumps(shell)), dtype=torch.uint8)
        group = self.shards.group
        dist.send(torch.tensor([meta.numel()]), group_dst=dst, group=group)
        dist.send(meta, group_dst=dst, group=group)
        if tensors:
            self._last = [_Send.apply(group, dst, *self._chain(tensors))]

    def recv_state(self, src: int, device: torch.device) -> Any:
        """The state ``send_state`` sent from rank ``src``; its gradient goes back to ``src``."""
        group = self.shards.group
        size = torch.zeros(1, dtype=torch.long)
        dist.recv(size, group_src=src, group=group)
        meta = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(meta, group_src=src, group=group)
        layout, specs = pickle.loads(meta.numpy().tobytes())  # sent by send_state of our peer
        if not specs:
            return state_tree.unflatten([], layout)
        anchor = self._chain([torch.zeros((), device=device, requires_grad=True)])[0]
        received = list(_Recv.apply(group, src, specs, anchor))
        self._last = received
        return state_tree.unflatten(received, layout)

    def broadcast_state(self, state: Any, src: int, device: torch.device) -> Any:
        """Rank ``src``'s ``state`` on every rank (``state`` is ignored elsewhere); built on one
        all-gather, so gloo needs nothing more."""
        shards = self.shards
        tensors, layout = state_tree.flatten(state) if shards.rank == src else ([], None)
        shells: list[Any] = [None] * shards.world
        shell = None if layout is None else (layout, [(t.shape, t.dtype) for t in tensors])
        dist.all_gather_object(shells, shell, group=shards.group)
        layout, specs = shells[src]
        if not specs:
            return state_tree.unflatten([], layout)
        if shards.rank != src:
            tensors = [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in specs]
        return state_tree.unflatten(self.all_gather(tensors)[src], layout)

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        """The layer output, tied to the last collective (see the class docstring)."""
        return tie(y, self._last)
