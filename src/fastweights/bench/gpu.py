"""``fastweights bench gpu``: one prepared command for a GPU, within five minutes, compilation
included: are the kernels exact there, how fast are the ops, the layers and a training step.

Sections (``--sections``; all by default), each item a row of results.csv:

- ``exact``: every kernel backend (this project's Triton kernels, fla; and the PyTorch chunked
  form, their yardstick) of every kernel op (``KERNEL_OPS``) in bfloat16 and float16, against
  the float64 naive form on the same rounded inputs, at an odd length, with an initial state, the final state and the gradients of every
  input; and a packed batch of documents of odd lengths (one of a single token). Errors are
  relative to the reference's largest magnitude.
- ``ops``: forward and forward+backward time of every kernel op on each backend (triton, fla,
  torch) against causal SDPA (flash attention on a GPU), at B8 T2048 and B2 T16384, 16 heads of
  128, bfloat16.
- ``layers``: every registered mixer's layer (B4, d_model 1024, 8 heads, bfloat16 weights, the
  automatic backend) at T 4096 and 16384: forward, forward+backward and decoding time per token
  against softmax attention, with the counted FLOP rate of the forward (FLOPs counted on the
  PyTorch form of the same computation, by torch's FlopCounterMode, which sees matrix products
  only and counts causal attention as dense; the rate against the bfloat16 matmul rate measured
  on the device at the start).
- ``paper``: the TTT paper's 1.3B layer shape (d_model 2048, 32 heads of 64, b 16, B4, T 2k,
  8k, 32k): softmax, TTT-Linear, and TTT-Linear with the resident kernels, after the opt-in
  kernels' exactness rows (bench/gpu_paper.py).
- ``decode``: per mixer, a language model's decoding step token by token against one CUDA
  graph of it (B1 and B16, 4096 tokens of context, 8 layers, d_model 1024, bfloat16;
  bench/gpu_decode.py).
- ``train``: a whole training step per mixer (language model, 8 layers, d_model 1024, B8 T2048,
  byte vocabulary, float32 weights, fused AdamW, forward under bfloat16 autocast): tokens per
  second and peak memory.

Every timed figure is the median of the calls that fit a second (``gpu_plan.PASS_S``: at most
``--repeats``, at least one, fewer where they would overrun the budget: the ``calls``
column), after an untimed warm-up call only where a call is quick (``gpu_plan``); the first
call of every (item, pass), where Triton compiles and fla autotunes, is timed on its own and
reported as ``first_call_s``, never inside the timings. The wall-clock budget ``--budget-s``
keeps the whole run inside its five minutes: items run in a fixed order of priority (the
layers and the training steps first, those whose first calls are slow after the rest; then
this project's kernels and the baselines; fla's rows, whose first calls autotune for minutes,
last), an item starts only while the time left exceeds its reserve (``RESERVE_S``) and, on a
GPU, its expected seconds from the H200 record (``gpu_plan``), and an item that does not
start is a row ``skipped: time budget`` (meta.json lists them). ``--dry-run`` runs the same
code at tiny sizes on the CPU (the training step under CPU autocast with CUDA's dtype policy,
``fastweights.testing.cuda_autocast_policy``), where the kernel backends are rows skipped with
their reason; CI runs it. ``--ops`` and ``--mixers`` restrict the sections to some kernel ops
and some mixers (softmax, the baseline of layers and train, always runs).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import itertools
import math
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .. import ops, state_tree
from ..models import LanguageModel, LMConfig
from ..models.registry import mixer_names, mixer_options
from ..ops import backend as backends
from ..testing import cuda_autocast_policy
from . import gpu_paper, gpu_plan
from .gpu_decode import DRY_DECODE, GPU_DECODE, decode_items, decode_markdown
from .measure import PeakMemory, count_flops, matmul_gflops, time_call
from .record import RECORD_FILES, Record, Table, add_out_arguments, gpu_name, machine
from .targets import Setting, mixer_targets

NAME = "gpu"
DESCRIPTION = ("Run on a CUDA GPU, within --budget-s seconds (compilation and autotuning "
               "included): (exact) every kernel backend of every kernel op against the float64 "
               "naive form, outputs, states and gradients, at an odd length and on a packed "
               "batch; (ops) forward and forward+backward of each op on triton, fla and torch "
               "against causal SDPA at B8 T2048 and B2 T16384, 16 heads of 128, bfloat16; "
               "(layers) every mixer's layer forward, forward+backward and decode against "
               "softmax at B4 d_model 1024, 8 heads, T 4096 and 16384; (paper) TTT-Linear "
               "against softmax at the TTT paper's 1.3B layer, B4 d_model 2048, 32 heads of 64, "
               "T 2k, 8k and 32k; (train) a whole training "
               "step per mixer (8 layers, d_model 1024, B8 T2048, bfloat16 autocast): tokens/s "
               "and peak memory. First calls are timed apart. Writes its record (results.csv, "
               "results.md, meta.json, lscpu.txt) into --out. --dry-run runs the same code at "
               "tiny sizes on the CPU.")
SECTIONS = ("exact", "ops", "layers", "paper", "decode", "train")
OUTPUT_FILES = RECORD_FILES  # the files of its record (bench/record.py)
KERNEL_BACKENDS = ("triton", "fla")
# Seconds an item needs left in the budget to start: fla's first calls autotune (about two
# minutes per op on an H200); everything else compiles in seconds.
RESERVE_S = {"fla": 150.0, "default": 10.0}
COLUMNS = ("section", "name", "backend", "dtype", "shape", "pass", "status", "median_ms",
           "min_ms", "max_ms", "calls", "first_call_s", "vs_baseline", "tokens_per_s", "peak_mib",
           "tflops", "pct_matmul", "err_out", "err_state", "err_grad")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The shapes of every section: the GPU's, or the dry run's."""

    exact: tuple[int, int, int, int]  # B, T (odd), H, D
    packed: tuple[int, ...]  # document lengths of the packed batch (B = 1)
    ops: tuple[tuple[int, int], ...]  # (B, T)
    ops_heads: tuple[int, int]  # H, D
    layers: tuple[int, int, int, tuple[int, ...]]  # B, d_model, heads, lengths
    train: tuple[int, int, int, int, int]  # B, T, d_model, heads, layers
    repeats: int
    matmul_sizes: tuple[int, ...]


GPU_SIZES = Sizes(exact=(2, 1000, 4, 128), packed=(300, 1, 64, 635),
                  ops=((8, 2048), (2, 16384)), ops_heads=(16, 128),
                  layers=(4, 1024, 8, (4096, 16384)), train=(8, 2048, 1024, 8, 8), repeats=10,
                  matmul_sizes=(4096, 8192))
DRY_SIZES = Sizes(exact=(2, 37, 2, 16), packed=(13, 1, 7, 16), ops=((2, 64),),
                  ops_heads=(2, 16), layers=(1, 32, 2, (32,)), train=(2, 32, 32, 2, 2),
                  repeats=1, matmul_sizes=(64, 128))


# ----------------------------------------------------------------------------- kernel ops
@dataclasses.dataclass
class Inputs:
    """One call's inputs in float32: ``qkv`` (cast to the benchmarked dtype), ``gates`` (time on
    dim 1, float32 as the layers pass them), ``consts`` (positional after the gates, e.g. the
    decay), ``state`` (the initial state's tensors), ``options`` (keywords of the op)."""

    qkv: list[torch.Tensor]
    gates: list[torch.Tensor]
    consts: list[torch.Tensor]
    state: tuple[torch.Tensor, ...]
    options: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class KernelOp:
    """An op with GPU kernel backends, and how to make its inputs (B, T, H, D, device, gen):
    the ``mode`` its kernels compute with chunks (or mini-batches) of ``chunk``."""

    name: str
    make: Callable[[int, int, int, int, torch.device, torch.Generator], Inputs]
    mode: str = "chunk"
    chunk: int = 64

    def __call__(self, x: Inputs, initial_state: Any, **kw: Any) -> tuple[torch.Tensor, Any]:
        return getattr(ops, self.name)(*x.qkv, *x.gates, *x.consts, initial_state=initial_state,
                                       output_final_state=True, **x.options, **kw)


def _randn(gen: torch.Generator, device: torch.device, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, device=device, generator=gen)


def _inputs(op: str) -> Callable[..., Inputs]:
    """The op's example call (its folder's examples.py, ``ops.example_inputs``) as Inputs."""
    def make(B, T, H, D, device, gen) -> Inputs:
        seed = int(torch.randint(0, 2**31, (1,), generator=gen, device=gen.device))
        ex = ops.example_inputs(op, B, T, H, D, device=device, seed=seed)
        return Inputs(list(ex.qkv), list(ex.gates), list(ex.consts),
                      tuple(state_tree.tensors(ex.state)), dict(ex.options))
    return make


KERNEL_OPS = (KernelOp("linear_attn", _inputs("linear_attn")),
              KernelOp("delta_rule", _inputs("delta_rule")),
              KernelOp("gated_delta_rule", _inputs("gated_delta_rule")),
              KernelOp("decay_linear_attn", _inputs("decay_linear_attn")),
              KernelOp("ttt_linear", _inputs("ttt_linear"), mode="dual", chunk=16),
              KernelOp("ttt_mlp", _inputs("ttt_mlp"), mode="dual", chunk=16))


def _op_state(parts: tuple[torch.Tensor, ...]) -> Any:
    """An op's state from its tensors: (S, z) for linear_attn, S for the others."""
    return parts if len(parts) > 1 else parts[0]


def _parts(state: Any) -> tuple[torch.Tensor, ...]:
    """The tensors of a final state (of a list of per-document states: all of them, in order;
    a TTT state inside a mini-batch is a tree of start weights, rows and place)."""
    return tuple(state_tree.tensors(state))


def _refusal(op: KernelOp, backend: str, q: torch.Tensor) -> str | None:
    """Why ``backend`` cannot run ``op`` on q (the dispatcher's own reason), or None."""
    try:
        backends.choose_backend(op.name, q, backend, op.mode, op.chunk)
    except ValueError as err:
        return str(err).split(": ", 1)[-1]
    return None


# ----------------------------------------------------------------------------- the run
@dataclasses.dataclass
class Run:
    """What every section needs: sizes, device, the deadline, the rows written so far."""

    sizes: Sizes
    device: torch.device
    deadline: float
    backends: tuple[str, ...]
    matmul_tflops: float
    ops: tuple[str, ...] = ()  # the kernel ops of exact and ops (KERNEL_OPS' names)
    mixers: tuple[str, ...] = ()  # the mixers of layers and train, softmax (the baseline) first
    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def row(self, **fields: Any) -> dict[str, Any]:
        row = {c: "" for c in COLUMNS} | {"status": "ok"} | fields
        self.rows.append(row)
        return row

    def may_start(self, estimate_s: float = 0.0, **fields: Any) -> bool:
        """Whether the item of the row ``fields`` may start within the budget: the reserve of
        its backend, or its expected seconds on the GPU where more (``gpu_plan``; none in a
        dry run); if not, its row says so."""
        reserve = RESERVE_S.get(fields.get("backend", ""), RESERVE_S["default"])
        if self.sizes is GPU_SIZES:
            reserve = max(reserve, estimate_s)
        if self.deadline - time.monotonic() > reserve:
            return True
        self.row(**fields, status="skipped: time budget")
        return False


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (the absolute difference where b is all zeros)."""
    if not a.numel():
        return 0.0
    scale = b.abs().max().item()
    diff = (a.double() - b.double()).abs().max().item()
    return diff / scale if scale > 0 else diff


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def exact_case(run: Run, op: KernelOp, backend: str, dtype: torch.dtype,
               docs: tuple[int, ...] | None) -> None:
    """One row of ``exact``: ``op`` on ``backend`` in ``dtype`` (q, k, v rounded to it; gates
    and states float32) against the float64 naive form on the same values; a packed batch of
    documents ``docs`` (each from the same initial state) when given."""
    B, T, H, D = run.sizes.exact
    if docs is not None:
        B, T = 1, sum(docs)
    x = op.make(B, T, H, D, run.device, torch.Generator(device=run.device).manual_seed(0))
    fields = {"section": "exact", "name": op.name, "dtype": _dtype_name(dtype),
              "shape": f"B{B} T{T} H{H} D{D}" + (f" docs {'+'.join(map(str, docs))}" if docs
                                                 else ""),
              "pass": "packed" if docs else "dense"}
    why = _refusal(op, backend, x.qkv[0].to(dtype))
    if why is not None:
        run.row(backend=backend, status=f"skipped: {why}", **fields)
        return
    if not run.may_start(backend=backend, **fields):
        return
    kw: dict[str, Any] = {}
    if docs is not None:
        kw["cu_seqlens"] = torch.tensor([0, *itertools.accumulate(docs)], device=run.device,
                                        dtype=torch.int32)
    with _item(run, backend=backend, **fields):
        run.row(backend=backend, **_exact_errors(x, op, dtype, docs, kw, backend, run.device),
                **fields)


def _exact_errors(x: Inputs, op: KernelOp, dtype: torch.dtype, docs: tuple[int, ...] | None,
                  kw: dict[str, Any], backend: str, device: torch.device) -> dict[str, float]:
    """The relative errors of ``op`` on ``backend`` against the float64 naive form: outputs,
    final states, and the gradients of every input of sum(outputs * w) + sum(states * w')."""
    results = []
    for wide, how in ((torch.float32, {"backend": backend}), (torch.float64, {"mode": "naive"})):
        qkv = [_leaf(t.to(dtype), dtype if wide == torch.float32 else wide) for t in x.qkv]
        rest = [_leaf(t, wide) for t in (*x.gates, *x.state)]
        gates, state = rest[:len(x.gates)], tuple(rest[len(x.gates):])
        options = {n: v.to(wide) if isinstance(v, torch.Tensor) else v
                   for n, v in x.options.items()}
        call = Inputs(qkv, gates, [t.to(wide) for t in x.consts], state, options)
        init = _op_state(state) if docs is None else [_op_state(state)] * len(docs)
        o, final = op(call, init, **kw, **how)
        final = _parts(final)
        gen = torch.Generator(device=device).manual_seed(1)
        loss = sum((t.double() * torch.randn(t.shape, device=device, dtype=torch.float64,
                                             generator=gen)).sum() for t in (o, *final))
        grads = torch.autograd.grad(loss, [*qkv, *rest], allow_unused=True)
        results.append((o, final, grads))
    (o, S, grads), (o64, S64, grads64) = results
    return {"err_out": _rel(o, o64), "err_state": max(_rel(a, b) for a, b in zip(S, S64)),
            "err_grad": max(_rel(a, b) for a, b in zip(grads, grads64)
                            if a is not None and b is not None)}


def _leaf(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.detach().to(dtype).clone().requires_grad_()


def _timed(run: Run, call: Callable[[], Any]) -> dict[str, Any]:
    """The first call's seconds apart; then the median, min and max in ms of the timed calls
    (``calls``: how many): as many as fit ``gpu_plan.PASS_S`` seconds, at least one and at most
    ``repeats``, fewer where they would overrun the budget. The call after the first is one of
    them, or an untimed warm-up where it was quick (``gpu_plan.calls_and_warmup``)."""
    first = time_call(call, run.device)
    second = time_call(call, run.device)
    calls, warm = gpu_plan.calls_and_warmup(second, run.sizes.repeats)
    fit = int((run.deadline - time.monotonic()) / max(second, 1e-9))
    times = [] if warm else [second]
    while len(times) < max(1, min(calls, fit + len(times))):
        times.append(time_call(call, run.device))
    times.sort()
    return {"first_call_s": first, "median_ms": 1e3 * times[len(times) // 2],
            "min_ms": 1e3 * times[0], "max_ms": 1e3 * times[-1], "calls": len(times)}


@contextlib.contextmanager
def _item(run: Run, **fields: Any) -> Iterator[None]:
    """An item's failure is its row (``failed: ...``, or ``skipped: out of memory``), not the
    end of the run: a prepared GPU run keeps every figure it could measure."""
    try:
        yield
    except torch.OutOfMemoryError:
        run.row(status="skipped: out of memory", **fields)
    except Exception as err:  # recorded, and the run's exit code says so
        run.row(status=f"failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
                **fields)
    finally:
        if run.device.type == "cuda":
            torch.cuda.empty_cache()


def op_case(run: Run, op: KernelOp | None, backend: str, B: int, T: int) -> None:
    """Rows of ``ops``: forward and forward+backward of ``op`` on ``backend`` (None: causal
    SDPA, flash attention on a GPU), bfloat16, no initial state, the final state returned."""
    H, D = run.sizes.ops_heads
    gen = torch.Generator(device=run.device).manual_seed(0)
    fields = {"section": "ops", "name": op.name if op else "softmax (SDPA, causal)",
              "dtype": "bfloat16", "shape": f"B{B} T{T} H{H} D{D}", "backend": backend}
    if op is None:
        qkv = [_randn(gen, run.device, B, H, T, D).bfloat16() for _ in range(3)]
        x = None
    else:
        x = op.make(B, T, H, D, run.device, gen)
        qkv = [t.bfloat16() for t in x.qkv]
        why = _refusal(op, backend, qkv[0]) if backend != "torch" else None
        if why is not None:
            for p in ("fwd", "fwdbwd"):
                run.row(**fields, **{"pass": p, "status": f"skipped: {why}"})
            return
    leaves = [t.detach().clone().requires_grad_() for t in qkv]

    def forward(xs: list[torch.Tensor]) -> torch.Tensor:
        if x is None:
            with _flash(run.device):
                return F.scaled_dot_product_attention(*xs, is_causal=True)
        initial = _op_state(x.state) if op.name.startswith("ttt") else None
        return op(Inputs(xs, x.gates, x.consts, (), x.options), initial, backend=backend)[0]

    def fwd() -> None:
        with torch.no_grad():
            forward(qkv)

    def fwdbwd() -> None:
        for t in leaves:
            t.grad = None
        forward(leaves).sum().backward()

    for p, call in (("fwd", fwd), ("fwdbwd", fwdbwd)):
        if run.may_start(**fields, **{"pass": p}):
            with _item(run, **fields, **{"pass": p}):
                run.row(**fields, **{"pass": p}, **_timed(run, call))


@contextlib.contextmanager
def _flash(device: torch.device) -> Iterator[None]:
    """SDPA restricted to flash attention on a GPU (the baseline every table compares to)."""
    if device.type != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        yield


@contextlib.contextmanager
def _torch_backend() -> Iterator[None]:
    """Every op on its PyTorch form (for counting FLOPs: FlopCounterMode sees no kernel)."""
    before = os.environ.get(backends.ENV)
    os.environ[backends.ENV] = "torch"
    try:
        yield
    finally:
        if before is None:
            del os.environ[backends.ENV]
        else:
            os.environ[backends.ENV] = before


def layer_case(run: Run, name: str, T: int) -> None:
    """Rows of ``layers``: the mixer's layer forward, forward+backward and decoding (per token,
    from the state after T tokens), bfloat16 weights, the automatic backend."""
    B, d, H, _ = run.sizes.layers
    fields = {"section": "layers", "name": name, "dtype": "bfloat16",
              "shape": f"B{B} T{T} d{d} H{H}", "backend": "auto"}
    if not run.may_start(gpu_plan.layer_cost(name, T, run.sizes.repeats).total, **fields,
                         **{"pass": "fwd"}):
        return
    with _item(run, **fields, **{"pass": "build"}):
        work = mixer_targets([(name, name, {})])[0].build(T, Setting(B, d, H, torch.bfloat16, run.device))
        for p, call in (("fwd", work.forward), ("fwdbwd", work.forward_backward)):
            if not run.may_start(**fields, **{"pass": p}):
                return
            with _item(run, **fields, **{"pass": p}):
                timed = _timed(run, call)
                if p == "fwd":
                    with _torch_backend(), torch.no_grad():
                        tflops = count_flops(work.forward) / (timed["median_ms"] / 1e3) / 1e12
                    timed |= {"tflops": tflops,
                              "pct_matmul": 100 * tflops / run.matmul_tflops}
                run.row(**fields, **{"pass": p}, **timed)
        if work.prefill is None or not run.may_start(**fields, **{"pass": "decode"}):
            return
        with _item(run, **fields, **{"pass": "decode"}):
            state = work.prefill()
            timed = _timed(run, lambda: work.step(state))
            steps = work.decode_steps
            run.row(**fields, **{"pass": "decode"}, first_call_s=timed["first_call_s"],
                    calls=timed["calls"],
                    **{k: timed[k] / steps for k in ("median_ms", "min_ms", "max_ms")})


def train_case(run: Run, name: str) -> None:
    """A row of ``train``: one optimiser step of a language model of this mixer, float32
    weights, forward under bfloat16 autocast (on the CPU with CUDA's dtype policy), fused AdamW
    on a GPU: tokens per second and peak memory."""
    B, T, d, H, L = run.sizes.train
    fields = {"section": "train", "name": name, "dtype": "bfloat16 autocast",
              "shape": f"B{B} T{T} d{d} H{H} L{L}", "backend": "auto", "pass": "step"}
    if not run.may_start(gpu_plan.train_cost(name, run.sizes.repeats).total, **fields):
        return
    with _item(run, **fields):
        options = {"max_len": T} if "max_len" in mixer_options(name) else {}
        torch.manual_seed(0)
        model = LanguageModel(LMConfig(vocab_size=256, d_model=d, n_layers=L, n_heads=H,
                                       mixer=name, mixer_options=options)).to(run.device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=run.device.type == "cuda")
        ids = torch.randint(0, 256, (B, T + 1), device=run.device,
                            generator=torch.Generator(device=run.device).manual_seed(0))
        policy = cuda_autocast_policy if run.device.type == "cpu" else contextlib.nullcontext

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            with policy(), torch.autocast(run.device.type, dtype=torch.bfloat16):
                logits, _ = model(ids[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
            opt.step()

        timed = _timed(run, step)
        with PeakMemory(run.device) as mem:
            step()
        # CUDA: all memory allocated at the peak (model and optimizer state included)
        peak = mem.high if run.device.type == "cuda" else mem.peak
        run.row(**fields, **timed, tokens_per_s=B * T / (timed["median_ms"] / 1e3),
                peak_mib=None if peak is None else peak / 2**20)


# ----------------------------------------------------------------------------- sections
def plan(run: Run, sections: tuple[str, ...]) -> list[Callable[[], None]]:
    """Every item in its order of priority: the layers and the training steps first (those with
    slow first calls after the rest, ``gpu_plan.ordered``), then this project's kernels and
    the baselines, then the ops' PyTorch forms, fla's items last (their first calls
    autotune)."""
    ours = [b for b in run.backends if b != "fla"]
    fla = ["fla"] if "fla" in run.backends else []
    kernel_ops = [op for op in KERNEL_OPS if op.name in run.ops]
    items: list[Callable[[], None]] = []

    def exact(names: list[str]) -> None:
        for op in kernel_ops:
            for backend in names:
                for dtype in (torch.bfloat16, torch.float16):
                    items.append(lambda op=op, b=backend, dt=dtype: exact_case(run, op, b, dt, None))
                items.append(lambda op=op, b=backend: exact_case(run, op, b, torch.bfloat16,
                                                                 run.sizes.packed))

    def op_rows(names: list[str], baseline: bool) -> None:
        for B, T in run.sizes.ops:
            if baseline:
                items.append(lambda B=B, T=T: op_case(run, None, "flash" if run.device.type
                                                      == "cuda" else "sdpa", B, T))
            for op in kernel_ops:
                for backend in names:
                    items.append(lambda op=op, b=backend, B=B, T=T: op_case(run, op, b, B, T))

    # The rows that one call must hold (issue 43): layers and training steps, quick first
    # calls first, those with slow ones (gpu_plan.ordered) after them.
    required: dict[str, tuple[gpu_plan.Cost, Callable[[], None]]] = {}
    lengths = run.sizes.layers[3] if "layers" in sections else ()
    groups = ([("layers", T) for T in lengths[:1]] + [("train", 0)] * ("train" in sections)
              + [("layers", T) for T in lengths[1:]])
    for section, T in groups:
        for n in run.mixers:
            if section == "layers":
                required[f"layers {n} {T}"] = (gpu_plan.layer_cost(n, T, run.sizes.repeats),
                                               lambda n=n, T=T: layer_case(run, n, T))
            else:
                required[f"train {n}"] = (gpu_plan.train_cost(n, run.sizes.repeats),
                                          lambda n=n: train_case(run, n))
    items += [required[k][1] for k in gpu_plan.ordered((k, c) for k, (c, _) in
                                                       required.items())]
    if "exact" in sections:
        exact([*ours, "torch"])  # torch: the PyTorch chunked form, the kernels' yardstick
    if "ops" in sections:
        op_rows(ours, baseline=True)
    # Past the rows one call must hold: the TTT paper's shape and the decoding graphs.
    if "paper" in sections:
        items += gpu_paper.paper_items(run, gpu_paper.Tools(
            exact_case, _item, _timed, {op.name: op for op in KERNEL_OPS}))
    if "decode" in sections:
        sizes = DRY_DECODE if run.device.type == "cpu" else GPU_DECODE
        items += decode_items(run, sizes, _timed, _item)
    if "ops" in sections:
        op_rows(["torch"], baseline=False)  # the PyTorch forms: slow for TTT at T 16384
    if "exact" in sections:
        exact(fla)
    if "ops" in sections:
        op_rows(fla, baseline=False)
    return items


def _attach_baselines(rows: list[dict[str, Any]]) -> None:
    """vs_baseline: each median time over its baseline's at the same (section, shape, pass):
    causal SDPA for ops, softmax attention for layers and the training step."""
    base = {}
    for r in rows:
        if r["status"] == "ok" and r["median_ms"] != "" and (
                r["name"].startswith("softmax")):
            base[(r["section"], r["shape"], r["pass"])] = r
    for r in rows:
        b = base.get((r["section"], r["shape"], r["pass"]))
        if r["status"] == "ok" and r["median_ms"] != "" and b is not None:
            r["vs_baseline"] = r["median_ms"] / b["median_ms"]


# ----------------------------------------------------------------------------- the record
def _cell(value: Any, spec: str = ".3g") -> str:
    if value == "" or value is None:
        return ""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else format(value, spec)
    return str(value)


def csv_rows(rows: list[dict[str, Any]]) -> Table:
    """results.csv: every row, ``COLUMNS``, numbers to 6 significant digits."""
    return Table([{k: _cell(r[k], ".6g") for k in COLUMNS} for r in rows], COLUMNS)


def _table(head: list[str], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(cells) + " |" for cells in body), ""]


def _by_pass(rows: list[dict[str, Any]], section: str
             ) -> dict[tuple[str, str, str], dict[str, dict[str, Any]]]:
    """{(shape, name, backend): {pass: row}} of a section, in the order the rows came."""
    out: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {}
    for r in rows:
        if r["section"] == section:
            out.setdefault((r["shape"], r["name"], r["backend"]), {})[r["pass"]] = r
    return out


def _status(passes: dict[str, dict[str, Any]]) -> str:
    return "; ".join(sorted({r["status"] for r in passes.values() if r["status"] != "ok"})) or "ok"


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    """results.md: the run's head, one table per section, first calls beside the timings."""
    lines = [f"# fastweights bench gpu: {meta['device']}", "",
             f"`{meta['command']}`, {meta['date']}; torch {meta['machine']['torch']}, triton "
             f"{meta['machine']['triton']}, fla {meta['fla']}; budget {meta['budget_s']:g} s, run "
             f"{meta['elapsed_s']:.0f} s; bfloat16 matmul rate measured "
             f"{meta['matmul_tflops']:.3g} TFLOP/s." + (" **Dry run** (CPU, tiny sizes: no "
                                                       "figure here means anything)."
                                                       if meta["dry_run"] else ""), "",
             "Times: median (min-max) of the timed calls after one warm-up call; the first call "
             "(Triton compilation, fla autotuning) is timed apart, in seconds. Errors: max |x - "
             "ref| / max |ref| against the float64 naive form on the same rounded inputs.", ""]
    exact = [r for r in rows if r["section"] == "exact"]
    if exact:
        lines += ["## Kernel exactness", "", *_table(
            ["op", "backend", "dtype", "case", "shape", "output", "state", "gradients", "status"],
            [[r["name"], r["backend"], r["dtype"], r["pass"], r["shape"], _cell(r["err_out"]),
              _cell(r["err_state"]), _cell(r["err_grad"]), r["status"]] for r in exact])]
    for section, title in (("ops", "Ops, bfloat16"), ("layers", "Layers, bfloat16 weights"),
                           (gpu_paper.SECTION, gpu_paper.TITLE)):
        grouped = _by_pass(rows, section)
        if not grouped:
            continue
        lines += [f"## {title}", ""]
        passes = ("fwd", "fwdbwd") + (("decode",) if section == "layers" else ())
        head = (["shape", "name", "backend"] + [f"{p} ms" for p in passes]
                + [f"{p} / baseline" for p in passes] + ["first calls s"]
                + (["counted TFLOP/s fwd", "% matmul"] if section == "layers" else [])
                + ["status"])
        body = []
        for (shape, name, backend), by in grouped.items():
            cells = [shape, name, backend]
            cells += [_cell(by.get(p, {}).get("median_ms", "")) for p in passes]
            cells += [_cell(by.get(p, {}).get("vs_baseline", ""), ".2f") for p in passes]
            cells.append(" / ".join(_cell(by.get(p, {}).get("first_call_s", ""), ".2f")
                                    for p in passes))
            if section == "layers":
                fwd = by.get("fwd", {})
                cells += [_cell(fwd.get("tflops", "")), _cell(fwd.get("pct_matmul", ""), ".1f")]
            body.append([*cells, _status(by)])
        lines += _table(head, body)
    lines += decode_markdown(rows, _cell)
    train = [r for r in rows if r["section"] == "train"]
    if train:
        lines += ["## Training step (bfloat16 autocast, fused AdamW)", "", *_table(
            ["shape", "mixer", "step ms", "tokens/s", "step / softmax", "peak MiB",
             "first step s", "status"],
            [[r["shape"], r["name"], _cell(r["median_ms"]), _cell(r["tokens_per_s"], ".4g"),
              _cell(r["vs_baseline"], ".2f"), _cell(r["peak_mib"], ".0f"),
              _cell(r["first_call_s"], ".2f"), r["status"]] for r in train])]
    return lines


def _version(distribution: str) -> str:
    """An installed distribution's version, without importing it (fla's import takes seconds)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def device_name(device: torch.device) -> str:
    return gpu_name(device) if device.type == "cuda" else f"CPU {machine()['cpu_model']}"


def run_benchmark(rec: Record, *, dry_run: bool, device: torch.device, budget_s: float,
                  sections: tuple[str, ...], fla: bool, repeats: int | None,
                  command: str, kernel_ops: tuple[str, ...] | None = None,
                  mixers: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    """Run the benchmark into the record ``rec`` (rewritten after every section so that a run
    cut short keeps what it measured); returns the rows.
    ``kernel_ops`` (names of ``KERNEL_OPS``) and ``mixers`` (registered mixer names) restrict
    the sections to them (None: all); softmax, the baseline of layers and train, always runs."""
    start = time.monotonic()
    sizes = DRY_SIZES if dry_run else GPU_SIZES
    if repeats is not None:
        sizes = dataclasses.replace(sizes, repeats=repeats)
    rate, _ = matmul_gflops(device, torch.bfloat16, sizes.matmul_sizes,
                            min_seconds=0.02 if dry_run else 0.3)
    names = mixer_names() if mixers is None else ("softmax", *(m for m in mixers
                                                                 if m != "softmax"))
    run = Run(sizes, device, start + budget_s,
              ("triton", "fla") if fla else ("triton",), rate / 1e3,
              ops=tuple(op.name for op in KERNEL_OPS) if kernel_ops is None else kernel_ops,
              mixers=tuple(names))
    meta = rec.meta(command, device=device_name(device), dry_run=dry_run, budget_s=budget_s,
                    fla=_version("flash-linear-attention"), matmul_tflops=run.matmul_tflops,
                    sizes=dataclasses.asdict(sizes), sections=list(sections),
                    ops=list(run.ops), mixers=list(run.mixers))

    def write() -> None:
        rows = [dict(r) for r in run.rows]
        _attach_baselines(rows)
        meta["elapsed_s"] = time.monotonic() - start
        meta["skipped"] = [" ".join((r["section"], r["name"], r["backend"], r["shape"],
                                     r["pass"])) for r in rows
                           if r["status"] == "skipped: time budget"]
        rec.write(csv_rows(rows), meta, markdown=markdown(rows, meta))

    for item in plan(run, sections):
        item()
        write()
    rows = [dict(r) for r in run.rows]
    _attach_baselines(rows)
    return rows


# ----------------------------------------------------------------------------- command line
def add_arguments(p: argparse.ArgumentParser) -> None:
    from .._commands import positive_float, positive_int

    add_out_arguments(p, default=Path("runs/bench-gpu"))
    p.add_argument("--dry-run", action="store_true",
                   help="the same code at tiny sizes on the CPU (kernel backends skipped, with "
                        "their reason); what CI runs")
    p.add_argument("--budget-s", type=positive_float, default=300.0,
                   help="wall-clock seconds for the whole run; items that would not fit are "
                        "recorded as skipped")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated, some of {', '.join(SECTIONS)}")
    p.add_argument("--repeats", type=positive_int, default=None,
                   help="timed calls per item (default: 10 on a GPU, 1 in a dry run)")
    p.add_argument("--ops", default=None,
                   help="comma-separated kernel ops of exact and ops, some of "
                        f"{', '.join(op.name for op in KERNEL_OPS)} (default: all)")
    p.add_argument("--mixers", default=None,
                   help="comma-separated mixers of layers and train (default: every registered "
                        "mixer); softmax, their baseline, always runs")
    p.add_argument("--no-fla", action="store_true",
                   help="leave out fla's rows (its first calls autotune for minutes)")


def run(args: argparse.Namespace) -> int:
    from .._commands import UserError, command_line, parse_name_list

    sections = parse_name_list("--sections", args.sections, SECTIONS)
    kernel_ops = None if args.ops is None else parse_name_list(
        "--ops", args.ops, tuple(op.name for op in KERNEL_OPS))
    mixers = None if args.mixers is None else parse_name_list("--mixers", args.mixers,
                                                               tuple(mixer_names()))
    if args.dry_run:
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        raise UserError("fastweights bench gpu needs a CUDA GPU (torch.cuda.is_available() is "
                        "False); --dry-run runs the same code at tiny sizes on the CPU")
    else:
        device = torch.device("cuda")
    rec = Record(args.out, NAME, overwrite=args.overwrite)
    rows = run_benchmark(rec, dry_run=args.dry_run, device=device, budget_s=args.budget_s,
                         sections=sections, fla=not args.no_fla, repeats=args.repeats,
                         command=command_line(["fastweights", "bench", NAME], args),
                         kernel_ops=kernel_ops, mixers=mixers)
    failed = [r for r in rows if r["status"].startswith("failed")]
    print(f"fastweights bench gpu: {len(rows)} rows ({len(failed)} failed) in {args.out}/")
    for r in failed:
        print(f"  {r['section']} {r['name']} {r['backend']} {r['pass']}: {r['status']}")
    return 1 if failed else 0
