"""What the benchmark runs: every registered mixer, and the op-level forms of ``fastweights.ops``.

A ``Target`` builds a ``Workload`` for one sequence length: closures for the forward pass (no
autograd), forward + backward (of ``y.sum()``, gradients to the input and every parameter),
and the decoding pair ``prefill`` (state after T tokens, chunked/default form, not timed) and
``step`` (one token against that state, the timed part of ``decode``).

Dimension legend: B batch, T sequence length, H heads, D head dim (d_model / H), d_model width.

Op-level inputs are every op's example call, declared in its folder (``ops.example_inputs``:
inputs as the op's layers make them). Every op with one (``ops.EXAMPLE_OPS``: every op of
``fastweights.ops``) is included; every ``mode`` a tiny probe call accepts becomes its own
target (``delta_rule[chunk]``, ``delta_rule[recurrent]``, ...); an op whose probe is rejected
is listed in the report as skipped with the reason, never silently dropped.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .. import ops, state_tree
from .._commands import UserError
from ..models import LMConfig
from ..models.registry import build_mixer, mixer_names, mixer_options
from ..ops.backend import preferred_chunk_size

__all__ = ["ScanWidth", "Setting", "Target", "Workload", "check_model_mixers", "mixer_targets",
           "op_targets", "scan_width"]

_CANDIDATE_MODES = ("chunk", "recurrent", "naive", "dual", "primal")
_DECODE_STEPS = 8  # tokens per timed decoding call; time is reported per token


@dataclass(frozen=True)
class Setting:
    """The shape and placement every target is built for."""

    batch: int
    d_model: int
    n_heads: int
    dtype: torch.dtype
    device: torch.device

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass
class Workload:
    """Closures for one (target, T). ``step`` runs ``decode_steps`` tokens from ``state``."""

    forward: Callable[[], Any]
    forward_backward: Callable[[], Any]
    prefill: Callable[[], Any] | None
    step: Callable[[Any], Any] | None
    decode_steps: int
    no_decode_reason: str = ""
    module: torch.nn.Module | None = None  # mixers: the layer and its input [B, T, d_model],
    x: torch.Tensor | None = None  # for the torch.compile check


@dataclass(frozen=True)
class Target:
    """A benchmarked thing: a registered mixer (``kind='mixer'``) or an op form (``kind='op'``)."""

    name: str
    kind: str
    build: Callable[[int, Setting], Workload]


# ----------------------------------------------------------------------------- mixers


def _mixer_workload(name: str, options: dict[str, Any], T: int, s: Setting) -> Workload:
    # Mixers with absolute position tables (AFT-full/local) are sized for the benchmarked length
    # plus the decoding steps unless ``options`` set max_len; every other option not in
    # ``options`` keeps its default.
    opts = dict(options)  # a copy per length: max_len depends on T
    if "max_len" in mixer_options(name):
        opts.setdefault("max_len", T + _DECODE_STEPS)
    layer = build_mixer(name, s.d_model, s.n_heads, **opts).to(device=s.device, dtype=s.dtype)
    x = torch.randn(s.batch, T, s.d_model, device=s.device, dtype=s.dtype)
    x_grad = x.clone().requires_grad_()
    x_step = torch.randn(s.batch, 1, s.d_model, device=s.device, dtype=s.dtype)

    def forward() -> Any:
        layer.eval()
        with torch.no_grad():
            return layer(x)[0]

    def forward_backward() -> None:
        layer.train()
        for p in layer.parameters():
            p.grad = None
        x_grad.grad = None
        layer(x_grad)[0].sum().backward()

    def prefill() -> Any:
        layer.eval()
        with torch.no_grad():
            return layer(x)[1]

    def step(state: Any) -> Any:
        with torch.no_grad():
            for _ in range(_DECODE_STEPS):
                _, state = layer(x_step, state)
        return state

    return Workload(forward, forward_backward, prefill, step, _DECODE_STEPS, module=layer, x=x)


def mixer_targets(mixers: list[tuple[str, str, dict[str, Any]]] | None = None) -> list[Target]:
    """One target per ``(label, registered name, options)`` of ``mixers``, named by its label
    (None: every registered mixer, named by its name, with its default options)."""
    if mixers is None:
        mixers = [(name, name, {}) for name in mixer_names()]
    return [Target(label, "mixer", lambda T, s, n=name, o=opts: _mixer_workload(n, o, T, s))
            for label, name, opts in mixers]


# ----------------------------------------------------------------------------- ops
# An op's inputs are its example call (its folder's examples.py, ``ops.example_inputs``), in
# the setting's dtype, as (positional args, keyword args).


def _recipe(op_name: str, T: int, s: Setting) -> tuple[list[torch.Tensor], dict[str, Any]]:
    ex = ops.example_inputs(op_name, s.batch, T, s.n_heads, s.head_dim, device=s.device,
                            seed=None)

    def cast(x: Any) -> Any:
        return x.to(s.dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    args = [cast(x) for x in (*ex.qkv, *ex.gates, *ex.consts)]
    if op_name == "aft":  # w [T, P]: columns for the decoded tokens after the call's, too
        args[-1] = F.pad(args[-1], (0, _DECODE_STEPS))
    kwargs = {k: cast(v) for k, v in ex.options.items()}
    if ex.state is not None:
        kwargs["initial_state"] = state_tree.map_tensors(cast, ex.state)
    return args, kwargs


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _op_workload(op_name: str, mode: str | None, T: int, s: Setting) -> Workload:
    fn = getattr(ops, op_name)
    params = inspect.signature(fn).parameters
    args, kwargs = _recipe(op_name, T, s)
    if mode is not None:
        kwargs["mode"] = mode
    grad_args = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]

    def forward() -> Any:
        with torch.no_grad():
            return _first(fn(*args, **kwargs))

    def forward_backward() -> None:
        for a in grad_args:
            a.grad = None
        _first(fn(*grad_args, **kwargs)).sum().backward()

    if "output_final_state" in params:
        # Decoding feeds one fresh token: every time-indexed input cut to its last position,
        # [B, T, ...] on dim 1 and AFT's per-token bias rows [T, *] on dim 0.
        def last(a: torch.Tensor) -> torch.Tensor:
            if a.dim() >= 3 and a.shape[1] == T:
                return a[:, -1:].clone()
            return a[-1:].clone() if op_name in ("aft", "aft_local") and a.dim() == 2 else a

        step_args = [last(a) for a in args]

        def prefill() -> Any:
            prefill_kwargs = {k: v for k, v in kwargs.items() if k != "mode"}
            with torch.no_grad():
                return fn(*args, **prefill_kwargs, output_final_state=True)[1]

        def step(state: Any) -> Any:
            with torch.no_grad():
                for _ in range(_DECODE_STEPS):
                    state = fn(*step_args, **{**kwargs, "initial_state": state},
                               output_final_state=True)[1]
            return state

        return Workload(forward, forward_backward, prefill, step, _DECODE_STEPS)
    if op_name == "softmax_attention":
        # Stateless, but a KV cache makes decoding well defined: one query against T keys.
        q1 = args[0][:, -1:]

        def step_softmax(state: Any) -> Any:
            with torch.no_grad():
                for _ in range(_DECODE_STEPS):
                    fn(q1, args[1], args[2])
            return state

        return Workload(forward, forward_backward, lambda: None, step_softmax, _DECODE_STEPS)
    return Workload(forward, forward_backward, None, None, _DECODE_STEPS,
                    no_decode_reason="op has no state to decode with")


def _accepted_modes(op_name: str, setting: Setting) -> tuple[list[str | None], str]:
    """Modes the op accepts on a tiny probe input ([None] for ops without ``mode``), or an empty
    list and the reason the recipe was rejected."""
    fn = getattr(ops, op_name)
    tiny = Setting(1, setting.n_heads * 2, setting.n_heads, torch.float32, torch.device("cpu"))
    has_mode = "mode" in inspect.signature(fn).parameters
    accepted: list[str | None] = []
    reason = ""
    for mode in (_CANDIDATE_MODES if has_mode else (None,)):
        args, kwargs = _recipe(op_name, 5, tiny)
        if mode is not None:
            kwargs["mode"] = mode
        try:
            fn(*args, **kwargs)
        except (ValueError, TypeError) as err:  # an unknown mode, or a recipe this op rejects
            reason = str(err).splitlines()[0]
            continue
        accepted.append(mode)
    return accepted, reason


def op_targets(setting: Setting) -> tuple[list[Target], dict[str, str]]:
    """Targets for every op form in ``fastweights.ops`` with an accepted recipe, and
    ``{op name: reason}`` for the ops left out."""
    targets: list[Target] = []
    left_out: dict[str, str] = {}
    for op_name in ops.EXAMPLE_OPS:
        modes, reason = _accepted_modes(op_name, setting)
        if not modes:
            left_out[op_name] = f"probe input rejected: {reason}"
        for mode in modes:
            name = op_name if mode is None else f"{op_name}[{mode}]"
            targets.append(Target(name, "op",
                                  lambda T, s, o=op_name, m=mode: _op_workload(o, m, T, s)))
    return targets, left_out


# ----------------------------------------------------------------------------- scan widths


@dataclass(frozen=True)
class ScanWidth:
    """The parallel width of a target's sequential scan at one shape: ``steps`` sequential steps
    (chunk or mini-batch hand-offs, or tokens), each doing ``items`` independent work items
    (``item`` says what one is). A machine with more cores than ``items`` idles on the scan
    unless one item is split further by the BLAS call that runs it."""

    steps: int
    items: int
    item: str


# The op behind each scanning mixer (mixers not listed have no sequential scan in forward).
_MIXER_OPS = {"linear": "linear_attn", "dpfp": "linear_attn", "favor": "linear_attn",
              "delta": "delta_rule", "gated-delta": "gated_delta_rule",
              "norm": "decay_linear_attn", "ttt-linear": "ttt_linear", "ttt-mlp": "ttt_mlp"}


def _default(fn: Callable[..., Any], name: str) -> Any:
    param = inspect.signature(fn).parameters.get(name)
    return None if param is None else param.default


def _op_width(op_name: str, mode: str | None, size: int | None, T: int,
              s: Setting) -> ScanWidth | None:
    """The scan width of ``op_name`` in ``mode`` with chunk / mini-batch ``size`` (None: the
    op's default)."""
    if op_name not in _MIXER_OPS.values():
        return None
    fn = getattr(ops, op_name)
    mode = mode or _default(fn, "mode")
    BH, D = s.batch * s.n_heads, s.head_dim
    if op_name.startswith("ttt_"):
        b = size or _default(fn, "mini_batch_size")
        mats = (f"[{b}x{D}]@[{D}x{D}]" if op_name == "ttt_linear" else
                f"[{b}x{D}]@[{D}x{4 * D}] and [{b}x{4 * D}]@[{4 * D}x{D}]")
        return ScanWidth(-(-T // b), BH, f"one (batch, head) mini-batch update: {mats} products")
    if mode in ("recurrent", "naive"):
        return ScanWidth(T, BH, f"one (batch, head) rank-1 update of a {D}x{D} state")
    C = min(T, size or _default(fn, "chunk_size") or 64)
    return ScanWidth(-(-T // C), BH,
                     f"one (batch, head) chunk hand-off: {C} keys and values into its state")


def scan_width(target: Target, T: int, s: Setting,
               mixers: dict[str, tuple[str, dict[str, Any]]] | None = None) -> ScanWidth | None:
    """The parallel width of ``target``'s sequential scan at length T (None: no scan, e.g.
    softmax). Op targets are named ``op[mode]``; mixer targets are looked up in ``mixers``
    (label -> (registered name, options)), their chunk / mini-batch size the options' or the
    layer's default (``preferred_chunk_size`` where that is None)."""
    if target.kind == "op":
        op_name, _, mode = target.name.partition("[")
        return _op_width(op_name, mode.rstrip("]") or None, None, T, s)
    name, options = (mixers or {}).get(target.name, (target.name, {}))
    op_name = _MIXER_OPS.get(name)
    if op_name is None:
        return None
    opts = {**mixer_options(name), **options}
    size = opts.get("mini_batch_size") or opts.get("chunk_size")
    if size is None and "chunk_size" in opts:
        size = preferred_chunk_size(op_name, s.device) if op_name in (
            "linear_attn", "delta_rule", "gated_delta_rule") else None
    return _op_width(op_name, opts.get("mode"), size, T, s)


def check_model_mixers(flag: str, mixers: list[str], **config: Any) -> None:
    """The LMConfig of each of ``mixers`` (names or specifications as ``LMConfig(mixer=...)``
    takes them) with ``config`` must be valid, else a UserError naming ``flag``: a benchmark
    that builds one model per mixer checks them all before it measures anything."""
    for mixer in mixers:
        try:
            LMConfig(mixer=mixer, **config)
        except (TypeError, ValueError) as err:
            raise UserError(f"{flag} {mixer}: {str(err).removeprefix('LMConfig.')}") from None
