"""The contract every sequence mixer honours (docs/design.md, "The layer contract")."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from itertools import pairwise
from types import MappingProxyType
from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn

from .._checks import (
    check_choice,
    check_documents,
    check_layer_input,
    check_packed_states,
    check_positive_int,
)
from ..ops.backend import BACKENDS
from ..state_tree import cat_rows

State = Any  # a tuple of tensors (and ints) owned by the layer; None means "start of sequence"


class Option(NamedTuple):
    """One keyword option of a mixer's constructor: its type (a class or a union such as
    ``int | None``) and its default."""

    type: Any
    default: Any


def signature_options(cls: type) -> Mapping[str, Option]:
    """The keyword options of ``cls``'s constructor, read off its signature: every keyword-only
    parameter of ``__init__`` with its annotation (evaluated) and default. A ``**options``
    parameter forwards to the base class's constructor: the base's options join, less those
    ``cls`` names in ``fixed_options`` (it passes them itself); a parameter of ``cls`` with a
    base option's name replaces it (a new default) where the base lists it."""
    params = inspect.signature(cls.__init__).parameters.values()
    hints = inspect.get_annotations(cls.__init__, eval_str=True)
    options: dict[str, Option] = {}
    if any(p.kind is p.VAR_KEYWORD for p in params):
        base = next(b for b in cls.__mro__[1:] if issubclass(b, Mixer))
        options = {k: o for k, o in base.options.items() if k not in cls.fixed_options}
    for p in params:
        if p.kind is p.KEYWORD_ONLY:
            if p.default is p.empty:
                raise TypeError(f"{cls.__name__}: option {p.name!r} needs a default")
            options[p.name] = Option(hints.get(p.name, Any), p.default)
    return MappingProxyType(options)


class ContextParallel(NamedTuple):
    """How a mixer runs under context parallelism (one sequence split across processes,
    ``fastweights.parallel``), declared by the layer itself (``Mixer.context_parallel``).

    ``name`` is reported by ``strategy_name``; ``forward(shard, x, state0) -> (y, final state)``
    runs this rank's shard ``x`` [B, T_r, d] of the sequence that starts from ``state0`` (the
    same on every rank), written with the mechanisms ``shard`` offers
    (``fastweights.parallel.mechanisms.Shard``: ``run``, scans, ``gather``, ``relay``,
    ``independent``); ``check(shards, state0) -> problem or None`` refuses shard layouts the
    mixer cannot take (``shards``: ``fastweights.parallel.Shards``)."""

    name: str
    forward: Callable[[Any, torch.Tensor, State], tuple[torch.Tensor, State]]
    check: Callable[[Any, State], str | None] | None = None

    @classmethod
    def relay(cls) -> ContextParallel:
        """Rank r continues rank r-1's final state: exact for every mixer (sequential)."""
        return cls("relay", lambda shard, x, state0: shard.relay(x, state0))

    @classmethod
    def sum_scan(cls) -> ContextParallel:
        """For a state of tensors that add up over tokens: the sums of the ranks before."""
        return cls("sum_scan", lambda shard, x, state0: shard.sum_scan(x, state0))


class Mixer(nn.Module):
    """Base class of every sequence-mixing layer: ``forward`` and ``state_size`` below are the
    contract; ``set_inner_lr_warmup`` is a training-schedule hook (a no-op unless overridden).

    A mixer is one class: its options are the keyword-only parameters of its ``__init__``
    (types and defaults written once there; ``options``, read off the signature when the class
    is defined, is what the registry validates and lists).
    """

    #: The keyword options of the constructor (beyond d_model and n_heads) with their types and
    #: defaults, from its signature (``signature_options``).
    options: ClassVar[Mapping[str, Option]] = MappingProxyType({})
    #: Options of the base class's constructor that this class passes itself (not its options).
    fixed_options: ClassVar[tuple[str, ...]] = ()
    #: Shown every call of the layer's token-mixing op before it runs, as
    #: ``op_hook(op, q, k, v, kwargs)`` (None: no hook; set on an instance). An analysis sees
    #: what the op mixes without changing the layer (the TransNormer experiment rebuilds each
    #: layer's mixing matrix from its q and k, ``reproduce/transnormer.py``).
    op_hook: Callable[[Callable[..., Any], torch.Tensor, torch.Tensor, torch.Tensor,
                       dict[str, Any]], None] | None = None
    #: The form ``static_state`` gives: "fixed" (the state keeps its shapes and holds no
    #: position: as it is), "rows" (its rows form, ``stack_states``, positions as tensors and
    #: caches as buffers) or "none" (no static form; softmax attention's is its own).
    static_form: ClassVar[str] = "none"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.options = signature_options(cls)
        if "forward" in cls.__dict__:
            cls.forward = _documents_once(cls.__dict__["forward"])

    def __init__(self, d_model: int, n_heads: int, head_dim: int | None = None) -> None:
        super().__init__()
        check_positive_int("d_model", d_model)
        check_positive_int("n_heads", n_heads)
        if head_dim is None:
            if d_model % n_heads:
                raise ValueError(
                    f"d_model ({d_model}) must be divisible by n_heads ({n_heads}) "
                    "unless head_dim is given"
                )
            head_dim = d_model // n_heads
        check_positive_int("head_dim", head_dim)
        self.d_model = d_model
        self.n_heads = n_heads
        self.head_dim = head_dim

    def forward(self, x: torch.Tensor, state: State = None,
                cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, State]:
        """x [B, T, d_model] -> (y [B, T, d_model], state).

        ``state`` None starts a sequence; a returned state continues it, so feeding a sequence
        in pieces with the state carried equals feeding it whole, and T = 1 is the decoding step.

        ``cu_seqlens`` ([N + 1] boundaries of documents packed in a batch of one, see
        ``ops/_varlen.py``): every document starts afresh (state, positions, caches), the result
        equals running the documents one by one, and ``state`` in and out is a list with one
        state per document (each as for a batch of one; None entries start a document).
        """
        raise NotImplementedError

    def state_size(self, seq_len: int = 1) -> int:
        """Floats of recurrent state per sequence after ``seq_len`` tokens (constant for
        recurrent mixers, growing with ``seq_len`` for softmax attention)."""
        raise NotImplementedError

    def stack_states(self, states: Sequence[State]) -> State:
        """One state for a batch whose row i continues ``states[i]``, each a state ``forward``
        returned for a batch of one (or of B_i rows: the rows follow in order): N streams at
        their own positions, decoded together by one call per token (T = 1) and each row then
        exactly as if decoded alone.

        This default concatenates the states' tensors along the batch: right for states without
        a position (linear attention, the delta rule, AFT-simple), and for any state when the
        streams sit at the same position. Where positions differ (a different int, a cache of
        another length) it raises ValueError; layers whose state tracks a position override it
        with per-row positions."""
        return cat_rows(check_stackable(states), "states")

    def static_state(self, state: State, max_len: int) -> State:
        """``state`` (as ``forward`` returned it) in the form a decoding step captured in a CUDA
        graph continues (docs/design.md, "Decoding graphs"): every tensor keeps its shape from
        step to step (positions as tensors, caches as buffers of at most ``max_len`` tokens)
        and the step reads nothing back to the host. TypeError for a mixer without such a form
        (``static_form``); ValueError where this state has none (a rows form that needs full
        caches)."""
        if state is None:
            raise ValueError("static_state needs a state returned by forward (not None)")
        if self.static_form == "fixed":
            return state
        if self.static_form == "rows":
            return self.stack_states([state])
        raise TypeError(f"{type(self).__name__} has no static decoding form")

    def _mix(self, op: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             **kwargs: Any) -> Any:
        """``op(q, k, v, **kwargs)``, the layer's token-mixing op, shown to ``op_hook`` first."""
        if self.op_hook is not None:
            self.op_hook(op, q, k, v, kwargs)
        return op(q, k, v, **kwargs)

    def context_parallel(self) -> ContextParallel:
        """How this layer runs on a shard of a sequence split across processes (see
        ``ContextParallel``); a layer without a strategy raises TypeError."""
        raise TypeError(f"context parallelism has no strategy for mixer {type(self).__name__}")

    def set_inner_lr_warmup(self, progress: float) -> None:
        """Set the layer's inner learning rate for ``progress`` in [0, 1] of the outer warm-up
        (1 = warmed up). Only layers that learn at test time (TTT) have one; the default does
        nothing."""

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n_heads={self.n_heads}, head_dim={self.head_dim}"

    def _documents(self, x: torch.Tensor, state: State,
                   cu_seqlens: torch.Tensor | None) -> tuple[list[int], list[State]]:
        """Check a call's input; return the document boundaries and one state per document
        (without ``cu_seqlens``: the single document [0, T] with ``state``)."""
        check_layer_input(x, self.d_model)
        if cu_seqlens is None:
            return [0, x.shape[1]], [state]
        docs = check_documents(cu_seqlens, x.shape[1], x.shape[0], x.device)
        return list(docs.bounds), check_packed_states(state, docs.count)

    def _forward_per_document(self, x: torch.Tensor, state: State,
                              cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, list[State]]:
        """A packed forward as one unpacked forward per document, for the layers whose op has no
        ``cu_seqlens`` (softmax attention, AFT-full, DiagAttention: per-document caches of
        different lengths cannot share one call of their op)."""
        bounds, states = self._documents(x, state, cu_seqlens)
        outs, finals = [], []
        for (start, stop), s in zip(pairwise(bounds), states):
            y, s = self.forward(x[:, start:stop], s)
            outs.append(y)
            finals.append(s)
        return torch.cat(outs, dim=1), finals


def _documents_once(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` taking ``cu_seqlens`` as ``Documents``: a tensor (a layer called alone) is
    checked and read back here, once, and the layer and its ops take the ``Documents`` on
    without checking or reading it again (docs/design.md, "Packed documents")."""
    @functools.wraps(forward)
    def wrapper(self: Mixer, x: Any, state: State = None, cu_seqlens: Any = None
                ) -> tuple[torch.Tensor, State]:
        if isinstance(cu_seqlens, torch.Tensor) and isinstance(x, torch.Tensor) and x.dim() == 3:
            cu_seqlens = check_documents(cu_seqlens, x.shape[1], x.shape[0], x.device)
        return forward(self, x, state, cu_seqlens)

    return wrapper


def per_document(value: Any, cu_seqlens: torch.Tensor | None) -> list[Any]:
    """What a call with(out) ``cu_seqlens`` passes or returns (a list of per-document states, or
    one state) as a list with one item per document."""
    return list(value) if cu_seqlens is not None else [value]


def packed_or_single(values: Sequence[Any], cu_seqlens: torch.Tensor | None) -> Any:
    """The inverse of ``per_document``: the list with ``cu_seqlens``, its single item without."""
    return list(values) if cu_seqlens is not None else values[0]


def token_positions(bounds: Sequence[int], starts: Sequence[int],
                    device: torch.device) -> torch.Tensor:
    """[T] int64: the position of every token of a packed batch, document d's tokens
    (bounds[d] .. bounds[d+1] - 1) counting on from ``starts[d]`` (its tokens seen before)."""
    if len(bounds) == 2:  # one document (every unpacked call, every decoding step)
        return torch.arange(starts[0], starts[0] + bounds[1], device=device)
    # One arange per document from Python ints: the sizes stay static, so torch.export and
    # torch.compile(fullgraph=True) trace it (a repeat_interleave by tensor lengths would have
    # a data-dependent size).
    return torch.cat([torch.arange(s, s + b - a, device=device)
                      for (a, b), s in zip(pairwise(bounds), starts)])


def cache_buffers(state: State, max_len: int, most: int | None,
                  owner: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A (k_cache, v_cache) pair a forward returned ([B, t, ...] each, every row at one length)
    as buffers of ``max_len`` tokens (zeros past t) and the rows' lengths [B] long: the static
    decoding form of a cache of every token (docs/design.md, "Decoding graphs"). ``max_len``
    must lie in [t, most] (``most`` None: no bound)."""
    if not (isinstance(state, tuple) and len(state) == 2
            and all(isinstance(t, torch.Tensor) for t in state)):
        raise TypeError(f"static_state needs the (k_cache, v_cache) pair {owner} returned, "
                        f"got {type(state).__name__}")
    k, v = state
    B, t = k.shape[:2]
    if max_len < t or (most is not None and max_len > most):
        bound = f"in [{t}, {most}] (the cached tokens, the layer's max_len)" if most is not None \
            else f">= the cached tokens ({t})"
        raise ValueError(f"max_len must be {bound}, got {max_len}")

    def pad(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x.new_zeros(B, max_len - t, *x.shape[2:])], 1)

    return pad(k), pad(v), torch.full((B,), t, dtype=torch.long, device=k.device)


def check_stackable(states: Any) -> list[State]:
    """``stack_states``'s argument: a non-empty list or tuple of carried states (not None)."""
    if not isinstance(states, (list, tuple)) or not states:
        raise ValueError(f"states must be a non-empty list of layer states, got "
                         f"{type(states).__name__}" + (" (empty)" if isinstance(states, (list, tuple)) else ""))
    if any(s is None for s in states):
        raise ValueError("states must all be states returned by forward; None (a sequence not "
                         "yet started) has no rows to stack")
    return list(states)


def is_step(x: Any, cu_seqlens: torch.Tensor | None) -> bool:
    """Whether a call is a plain decoding step: x [B, 1, d] (one token per row), not packed,
    autocast off. Layers serve it by a lean path that runs their op's recurrence directly on a
    state they checked themselves: a step is a chain of tiny operations whose cost is their
    number, and the public op would re-validate q, k, v the layer has just built. Under
    autocast the public op (which switches autocast off for its float32 states) runs instead."""
    return (cu_seqlens is None and isinstance(x, torch.Tensor) and x.dim() == 3
            and x.shape[1] == 1 and not torch.is_autocast_enabled(x.device.type))


def auxiliary_backend(backend: str | None) -> str | None:
    """The backend a layer passes its auxiliary (elementwise, ``ops/fused``) ops: the layer's
    own, with "fla" (which has no such kernels) meaning the automatic choice."""
    return None if backend == "fla" else backend


def check_backend(backend: Any) -> str | None:
    """A layer's ``backend`` option: None (the automatic choice) or one of ops/backend.py's
    BACKENDS, handed to its op (docs/design.md, "Backends")."""
    return check_choice("backend", backend, (None, *BACKENDS))


def like_values(v: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``xs`` (queries and keys, after their feature maps or norms) in the dtype of the values
    ``v``: the project's mixed-precision rule for the operands of a token-mixing op. The values
    come straight from a projection, so their dtype is the activation dtype: the autocast dtype
    under ``torch.autocast``, the model's dtype otherwise. CUDA autocast runs reductions and
    pointwise functions (``sum``, ``exp``, ``rsqrt``, ``softplus``, ...) in float32, so queries
    and keys that went through a sum normalisation or an L2 norm come out float32 while the
    values stay bfloat16; the ops take one dtype for q, k, v, and the kernel backends take the
    half-precision ones. Gates and states are not operands: the ops use them in float32
    (float64 for float64 inputs) whatever their dtype."""
    return tuple(x if x.dtype == v.dtype else x.to(v.dtype) for x in xs)


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """[B, T, H*D] -> [B, T, H, D]."""
    return x.unflatten(-1, (n_heads, -1))


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, T, H, D] -> [B, T, H*D]."""
    return x.flatten(-2)
