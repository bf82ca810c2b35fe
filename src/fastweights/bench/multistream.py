"""Decoding many streams at once: N independent streams, each at its own position, one batched
step for all of them, for every recurrent mixer against softmax attention with a KV cache.

``fastweights bench multistream`` builds one ``LanguageModel`` per mixer (default: 4
layers, d_model 512, 8 heads, vocabulary 256, float32; every registered mixer but aft-full,
whose cache grows like softmax's and whose position table stops at max_len) and, for every
context length c and stream count N, measures one decoding step of N streams stacked with
``LanguageModel.stack_states`` (rows at their own positions: per-row positions, left-padded
caches), eager and compiled with ``torch.compile``:

- Streams: stream i (i = 0..N-1) has seen L_i = c - floor(i c / (4 N)) tokens, spread over
  (3c/4, c]. Its state is synthetic, so that 16k tokens of context need no 16k-token prefill:
  a real prefill of p_i = min(L_i, P + L_i mod P) random tokens (P = 64, a multiple of every
  mixer's period: TTT mini-batch, Infini segment, DiagAttention block, and longer than the AFT
  windows) gives each stream its place in every period, then the parts of the state that
  depend on the absolute position are set to L_i after stacking: softmax's KV cache becomes
  random keys and values [N, max L_i, H, D], left-padded with zeros, with per-row lengths L_i
  (``KVCacheRows``: attention masks the padding), and NormAttention's LRPE positions,
  AFT-local's positions (its bias table is built with max_len = longest context + steps) and the
  model's absolute-position offsets become L_i. Recurrent states have the same size at any
  context, so their contents (from the short prefill) do not change the cost.
- Time: one call to warm up (the compilation, for compiled modes: its time is reported as
  ``first_call_s``), ``--warmup`` more steps (a growing KV cache makes the compiler recompile
  once, for a dynamic length), then ``--steps`` timed steps, each timed on its own
  (bench/measure.py's time_call; the next token of each stream is its greedy choice); the median step
  counts, so that a rare recompilation (a branch first taken when a stream's Infini segment
  closes) does not; tokens/s = N / median step time.
- Memory per stream: the bytes of the stacked state (padding included) / N, and the peak
  memory one more (untimed) step adds above what was resident before it / N (CPU: resident-set
  high-water mark with glibc's mmap threshold at 64 KiB, see ``measure.PeakMemory``; CUDA:
  allocator peak).
- Compile modes (``--compile``): ``none`` (eager only), ``default``, ``reduce-overhead``, or
  ``both``: eager and both compiled modes. ``reduce-overhead`` records CUDA graphs on CUDA; on
  CPU there are no graphs to record, and the table shows what it does there.

A configuration that fails (out of memory, a compiler error) is recorded with its reason and the
run goes on; one predicted to need more than half the available memory (the softmax KV cache:
state x 3, for the copy a step makes and the padding) is skipped and recorded. Writes its record
(bench/record.py: results.csv, results.md, meta.json with the machine, lscpu.txt) into ``--out``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import state_tree
from .._commands import (
    UserError,
    command_line,
    parse_int_list,
    parse_mixer_spec,
    positive_int,
    user_errors,
)
from ..layers.aft import AFTLocalState
from ..layers.softmax import KVCacheRows
from ..layers.transnormer import NormState
from ..models.config import LMConfig
from ..models.lm import LanguageModel, LMState
from ..models.registry import check_mixer, mixer_names
from .measure import PeakMemory, prepare_cpu_memory_accounting, time_call
from .record import Record, Table, add_out_arguments, machine_line
from .suite import _available_memory

PERIOD = 64  # a multiple of every mixer's period at the default options (checked per model)
MODES = ("eager", "default", "reduce-overhead")
COMPILE_CHOICES = {"none": ("eager",), "default": ("default",),
                   "reduce-overhead": ("reduce-overhead",), "both": MODES}
COLUMNS = ("mixer", "mode", "context", "streams", "status", "step_ms", "tokens_per_s",
           "state_mib_per_stream", "step_peak_mib_per_stream", "first_call_s", "steps",
           "min_length", "max_length")
MIB = 2 ** 20


@dataclass
class Row:
    """One (mixer, mode, context, streams) result; times per batched step."""

    mixer: str
    mode: str
    context: int
    streams: int
    status: str = "ok"
    step_ms: float = math.nan
    tokens_per_s: float = math.nan
    state_mib_per_stream: float = math.nan
    step_peak_mib_per_stream: float = math.nan
    first_call_s: float = math.nan
    steps: int = 0
    lengths: list[int] = field(default_factory=list)


def stream_lengths(context: int, streams: int) -> list[int]:
    """L_i = c - floor(i c / (4 N)): N distinct-as-possible lengths in (3c/4, c]."""
    return [context - (i * context) // (4 * streams) for i in range(streams)]


def _check_periods(model: LanguageModel) -> None:
    """The short prefill reproduces every layer's place in its period (TTT mini-batch, Infini
    segment, Diag block: divisors of PERIOD) and fills every AFT window (window - 1 <= PERIOD)."""
    for block in model.blocks:
        mixer = block.mixer
        for name in ("mini_batch_size", "segment_len", "block_size"):
            period = getattr(mixer, name, None)
            if period is not None and PERIOD % period:
                raise ValueError(f"{name}={period} does not divide the synthetic prefill's "
                                 f"period {PERIOD}")
        window = getattr(mixer, "window", None)
        if window is not None and window - 1 > PERIOD:
            raise ValueError(f"window={window} is longer than the synthetic prefill's {PERIOD}")


def build_model(mixer: str, options: dict[str, Any], *, d_model: int, n_layers: int,
                n_heads: int, vocab_size: int, max_len: int, device: torch.device) -> LanguageModel:
    """The benchmarked model (eval mode); AFT-local gets a bias table of ``max_len`` rows."""
    if mixer == "aft-local":
        options = {"max_len": max_len, **options}
    torch.manual_seed(0)
    config = LMConfig(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers,
                      n_heads=n_heads, mixer=mixer, mixer_options=options)
    model = LanguageModel(config).to(device).eval()
    _check_periods(model)
    return model


@torch.no_grad()
def synthetic_state(model: LanguageModel, lengths: list[int], gen: torch.Generator,
                    device: torch.device) -> LMState:
    """The stacked state of streams that have seen ``lengths`` tokens (module docstring)."""
    V = model.config.vocab_size
    states = []
    for n in lengths:
        prefill = min(n, PERIOD + n % PERIOD)
        ids = torch.randint(0, V, (1, prefill), generator=gen).to(device)
        states.append(model(ids)[1])
    state = model.stack_states(states)
    rows = torch.tensor(lengths, device=device)
    for i, s in enumerate(state[:len(model.blocks)]):
        if isinstance(s, KVCacheRows):
            N, t_max = len(lengths), max(lengths)
            H, D = s.k_cache.shape[2:]
            padding = torch.arange(t_max, device=device) < (t_max - rows).view(-1, 1)
            k, v = (torch.randn(N, t_max, H, D, generator=gen).to(device, s.k_cache.dtype)
                    .masked_fill_(padding.view(N, t_max, 1, 1), 0.0) for _ in range(2))
            state[i] = KVCacheRows(k, v, rows.clone())
        elif isinstance(s, NormState):
            state[i] = NormState(s.S, rows.clone())
        elif isinstance(s, AFTLocalState):
            state[i] = s._replace(pos=rows.clone())
    if model.config.position != "none":
        state[-1] = rows.clone()
    return state


def _compiled(model: LanguageModel, mode: str) -> Any:
    if mode == "eager":
        return model
    torch._dynamo.reset()  # fresh caches per (mixer, mode): a new model must not hit the limit
    return torch.compile(model, mode=mode)


@torch.no_grad()
def measure(step: Any, model: LanguageModel, row: Row, *, steps: int, warmup: int,
            device: torch.device, memory: bool, seed: int) -> None:
    """Fill ``row``: the first call, ``warmup`` steps, ``steps`` timed steps, one memory step."""
    gen = torch.Generator().manual_seed(seed)
    row.lengths = stream_lengths(row.context, row.streams)
    state = synthetic_state(model, row.lengths, gen, device)
    ids = torch.randint(0, model.config.vocab_size, (row.streams, 1), generator=gen).to(device)
    carried: dict[str, Any] = {}

    def call(ids: torch.Tensor, state: Any) -> Callable[[], None]:
        def run() -> None:
            carried["out"] = step(ids, state)
        return run

    row.first_call_s = time_call(call(ids, state), device)  # compiles, for the compiled modes
    logits, state = carried["out"]
    for _ in range(warmup):
        logits, state = step(logits[:, -1:].argmax(-1), state)
    row.state_mib_per_stream = state_tree.nbytes(state) / MIB / row.streams
    times = []
    for _ in range(steps):
        times.append(time_call(call(logits[:, -1:].argmax(-1), state), device))
        logits, state = carried["out"]
    row.steps = steps
    row.step_ms = 1e3 * statistics.median(times)
    row.tokens_per_s = row.streams / statistics.median(times)
    if memory:
        ids = logits[:, -1:].argmax(-1)
        with PeakMemory(device) as peak:
            step(ids, state)
        if peak.peak is not None:
            row.step_peak_mib_per_stream = peak.peak / MIB / row.streams


def _predicted_bytes(model: LanguageModel, context: int, streams: int, steps: int) -> float:
    """Memory a softmax KV cache needs at its longest (x 3: the step's copy and slack)."""
    per_token = sum(b.mixer.state_size(2) - b.mixer.state_size(1) for b in model.blocks)
    return 3.0 * 4 * streams * (context + steps + 4) * max(per_token, 0)


def _fmt(x: float, spec: str) -> str:
    return "" if not math.isfinite(x) else format(x, spec)


def csv_rows(rows: list[Row]) -> Table:
    """results.csv: one line per configuration, ``COLUMNS``."""
    return Table([dict(zip(COLUMNS, [
        r.mixer, r.mode, r.context, r.streams, r.status, _fmt(r.step_ms, ".6g"),
        _fmt(r.tokens_per_s, ".6g"), _fmt(r.state_mib_per_stream, ".6g"),
        _fmt(r.step_peak_mib_per_stream, ".6g"), _fmt(r.first_call_s, ".4g"), r.steps,
        min(r.lengths, default=""), max(r.lengths, default="")])) for r in rows], COLUMNS)


def _table(rows: list[Row], cell) -> list[str]:
    """One line per mixer, one column per (context, streams)."""
    cols = sorted({(r.context, r.streams) for r in rows})
    by = {(r.mixer, r.context, r.streams): r for r in rows}
    lines = ["| mixer | " + " | ".join(f"c={c} N={n}" for c, n in cols) + " |",
             "|---|" + "---:|" * len(cols)]
    for mixer in dict.fromkeys(r.mixer for r in rows):
        cells = []
        for c, n in cols:
            r = by.get((mixer, c, n))
            cells.append("" if r is None else cell(r) if r.status == "ok"
                         else r.status.split(":")[0])
        lines.append(f"| {mixer} | " + " | ".join(cells) + " |")
    return lines


def markdown(rows: list[Row], meta: dict[str, Any]) -> list[str]:
    """results.md's lines: a table per compile mode, the configurations not measured, the
    method (the module notes)."""
    lines = [
        "# Decoding many streams at once", "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}; device {meta['device']}, float32",
        f"- machine: {machine_line(meta['machine'])}",
        f"- model: {meta['n_layers']} layers, d_model {meta['d_model']}, {meta['n_heads']} "
        f"heads, vocabulary {meta['vocab_size']}; {meta['steps']} timed steps after "
        f"{meta['warmup']} warm-up steps", "",
    ]
    for mode in dict.fromkeys(r.mode for r in rows):
        sel = [r for r in rows if r.mode == mode]
        softmax = {(r.context, r.streams): r.tokens_per_s for r in sel
                   if r.mixer == "softmax" and r.status == "ok"}

        def speed(r: Row, softmax=softmax) -> str:
            base = softmax.get((r.context, r.streams))
            ratio = f" (x{r.tokens_per_s / base:.2g})" if base and r.mixer != "softmax" else ""
            return f"{r.tokens_per_s:.4g}{ratio}"

        lines += [f"## {mode}", "", "Tokens/s over all streams (x speed-up over softmax):", ""]
        lines += _table(sel, speed)
        lines += ["", "Milliseconds per batched step:", ""]
        lines += _table(sel, lambda r: f"{r.step_ms:.3g}")
        lines += ["", "State MiB per stream (padding included) / step peak MiB per stream:", ""]
        lines += _table(sel, lambda r: f"{r.state_mib_per_stream:.3g} / "
                                       f"{_fmt(r.step_peak_mib_per_stream, '.3g') or 'n/a'}")
        if mode != "eager":
            lines += ["", "First call (compilation) seconds:", ""]
            lines += _table(sel, lambda r: f"{r.first_call_s:.3g}")
        lines.append("")
    notes = [r for r in rows if r.status != "ok"]
    if notes:
        lines += ["## Not measured", ""]
        lines += [f"- {r.mixer} {r.mode} c={r.context} N={r.streams}: {r.status}" for r in notes]
        lines.append("")
    doc = (__doc__ or "").split("\n\n", 1)[1].strip()
    lines += ["## Method", "", doc, ""]
    return lines


def run_multistream(specs: list[tuple[str, str, dict[str, Any]]], streams: list[int], contexts: list[int],
        out: Path, *, modes: tuple[str, ...] = MODES, d_model: int = 512, n_layers: int = 4,
        n_heads: int = 8, vocab_size: int = 256, steps: int = 8, warmup: int = 2,
        device: torch.device | str = "cpu", seed: int = 0, command: str = "",
        overwrite: bool = False) -> list[Row]:
    """Every mixer ``(label, name, options)`` (softmax, the baseline, added first unless named)
    in every compile mode at every (context, N); one line per configuration on stderr; writes
    the record (bench/record.py; ``command`` recorded as given) into ``out``, claimed first
    (refused if it holds anything unless ``overwrite``), and returns the rows."""
    rec = Record(out, NAME, overwrite=overwrite)
    if not any(name == "softmax" for _, name, _ in specs):
        specs = [("softmax", "softmax", {}), *specs]
    device = torch.device(device)
    memory = device.type == "cuda" or prepare_cpu_memory_accounting()
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    max_len = max(contexts) + steps + warmup + 8
    budget = 0.5 * _available_memory(device)
    rows: list[Row] = []
    for label, name, opts in specs:
        model = build_model(name, opts, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                            vocab_size=vocab_size, max_len=max_len, device=device)
        for mode in modes:
            step = _compiled(model, mode)
            for context in contexts:
                for n in streams:
                    row = Row(label, mode, context, n)
                    rows.append(row)
                    need = _predicted_bytes(model, context, n, steps + warmup)
                    if need > budget:
                        row.status = (f"skipped: predicted {need / 2**30:.1f} GiB > half the "
                                      f"available {2 * budget / 2**30:.1f} GiB")
                    else:
                        try:
                            measure(step, model, row, steps=steps, warmup=warmup,
                                    device=device, memory=memory, seed=seed)
                        except Exception as err:  # one config's failure is a result to record
                            first = str(err).strip().splitlines()[0][:160] if str(err).strip() else ""
                            row.status = f"failed: {type(err).__name__}: {first}"
                    print(f"{label:12s} {mode:15s} c={context:6d} N={n:3d} "
                          + (f"{row.step_ms:9.2f} ms/step {row.tokens_per_s:10.1f} tok/s "
                             f"{row.state_mib_per_stream:8.2f} MiB/stream"
                             if row.status == "ok" else row.status), file=sys.stderr, flush=True)
    meta = rec.meta(command, device=str(device), d_model=d_model, n_layers=n_layers,
                    n_heads=n_heads, vocab_size=vocab_size, steps=steps, warmup=warmup,
                    streams=streams, contexts=contexts, modes=list(modes), memory=memory)
    rec.write(csv_rows(rows), meta, markdown=markdown(rows, meta))
    print(f"wrote {out}/results.csv, results.md, meta.json, lscpu.txt", file=sys.stderr)
    return rows


NAME = "multistream"
DESCRIPTION = ("One decoding step of N streams stacked with LanguageModel.stack_states, per mixer, "
               "context and N, eager and compiled: ms per step, tokens/s, state and step-peak "
               "memory per stream (synthetic contexts: no long prefill). Writes its record "
               "(results.csv, results.md, meta.json, lscpu.txt) into --out.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    default_mixers = ",".join(m for m in mixer_names() if m != "aft-full")
    p.add_argument("--mixers", default=default_mixers,
                   help="comma-separated mixer specs (name or name:opt=value); softmax, the "
                        "baseline, is added unless named (default: every mixer but aft-full)")
    p.add_argument("--streams", default="1,8,64", help="stream counts N")
    p.add_argument("--contexts", default="1024,16384", help="context lengths c")
    p.add_argument("--compile", default="both", choices=list(COMPILE_CHOICES))
    p.add_argument("--d-model", type=positive_int, default=512)
    p.add_argument("--n-layers", type=positive_int, default=4)
    p.add_argument("--n-heads", type=positive_int, default=8)
    p.add_argument("--vocab-size", type=positive_int, default=256)
    p.add_argument("--steps", type=positive_int, default=8, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after the first call")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads (default: torch's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    add_out_arguments(p, required=True)


def run(args: argparse.Namespace) -> int:
    streams = parse_int_list("--streams", args.streams)
    contexts = parse_int_list("--contexts", args.contexts)
    if args.warmup < 0:
        raise UserError(f"--warmup must be >= 0, got {args.warmup}")
    specs = []
    for text in (t.strip() for t in args.mixers.split(",") if t.strip()):
        name, opts = parse_mixer_spec("--mixers", text)
        with user_errors((ValueError, TypeError), prefix=f"--mixers {text!r}: "):
            check_mixer(name, args.d_model, args.n_heads, **opts)
        specs.append((text, name, opts))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    run_multistream(specs, streams, contexts, args.out,
                    modes=COMPILE_CHOICES[args.compile], d_model=args.d_model,
                    n_layers=args.n_layers, n_heads=args.n_heads, vocab_size=args.vocab_size,
                    steps=args.steps, warmup=args.warmup, device=args.device, seed=args.seed,
                    command=command_line(["fastweights", "bench", NAME], args),
                    overwrite=args.overwrite)
    return 0
