"""transformers' Qwen3.5 on CPU with and without ``fastweights.hf.use_fastweights``: the
gated-delta layer's prefill and one-token decoding, and a whole small Qwen3.5-shaped model's
prefill and decode tokens/s, in one process.

``fastweights bench gated-delta-models [--T 1024,4096] [--dtypes float32,bfloat16] [--out DIR]``:

- ``layer prefill`` / ``layer decode``: transformers' own ``Qwen3_5GatedDeltaNet`` layer at the
  head layout of transformers' Qwen3.5 config defaults (16 key heads, 32 value heads, head dims
  128; hidden size ``--hidden``), B 1, on T tokens (prefill, no cache) or one token continuing
  a cache filled by a 64-token prefill (decode, the conv and recurrent states updated in place
  as in generation). ``transformers`` runs its PyTorch fallbacks (``torch_chunk_gated_delta_rule``,
  ``torch_recurrent_gated_delta_rule``, ``causal_conv1d_fn`` / ``_update``, bound for the
  benchmark where fla's Triton kernels, which fail on CPU, would be); ``fastweights`` is the
  same layer after ``use_fastweights``.
- ``model prefill`` / ``model decode``: a random-weight ``Qwen3_5ForCausalLM`` with that layer
  layout (``--layers`` layers, every fourth full attention as in Qwen3.5, ``--hidden``, vocab
  ``--vocab``): prefill tokens/s of a forward over ``--model-T`` tokens, and decode tokens/s of
  ``generate`` producing ``--new-tokens`` tokens greedily after an 8-token prompt.

Method as ``fastweights.bench.gated_delta``: one warm-up call each, then ``--repeats`` rounds
calling both candidates in alternating order; medians, [min, max], the per-round (paired) ratio
transformers / fastweights, wall clock and process CPU time per call.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import inspect
import statistics
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .._commands import parse_int_list, parse_name_list, positive_int, user_errors
from .gated_delta import _time_rounds, report
from .measure import prepare_cpu_memory_accounting
from .record import add_out_arguments, machine, machine_line, open_record

__all__ = ["CANDIDATES", "DTYPES", "ModelRow", "report_lines", "run_gated_delta_models",
           "summary_table"]
CANDIDATES = ("transformers", "fastweights")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclasses.dataclass
class ModelRow:
    """One candidate of one case: seconds per call (wall median, min, max; process CPU
    median), tokens per second (from the wall median) and the per-round ratio of the
    transformers fallback's wall time to fastweights' (median, min, max)."""

    case: str
    dtype: str
    T: int
    name: str
    tokens: int
    median_s: float
    min_s: float
    max_s: float
    cpu_s: float
    tokens_per_s: float
    speedup: float
    speedup_min: float
    speedup_max: float
    repeats: int


@contextmanager
def _fallbacks() -> Iterator[Any]:
    """Qwen3.5's modeling module with its four kernel names bound to transformers' PyTorch
    fallbacks (where fla is installed the import bound fla's Triton kernels, which fail on a
    CPU), restored on exit. Yields the module."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    from ..hf.kernels import KERNELS
    saved = {name: getattr(qwen, name) for name in KERNELS}
    try:
        for name in KERNELS:
            setattr(qwen, name, inspect.unwrap(saved[name]))
        yield qwen
    finally:
        for name, fn in saved.items():
            setattr(qwen, name, fn)


def _config(hidden: int, layers: int, vocab: int) -> Any:
    from transformers import Qwen3_5TextConfig
    return Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                     for i in range(layers)])


def _pair(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The model as is (transformers) and a copy after use_fastweights (same weights)."""
    from ..hf import use_fastweights
    return {"transformers": model, "fastweights": use_fastweights(copy.deepcopy(model))}


def _rows(case: str, dtype: str, T: int, tokens: int, calls: dict[str, Callable[[], Any]],
          repeats: int) -> list[ModelRow]:
    with torch.no_grad():
        times = _time_rounds(calls, repeats)
    ratios = [t / f for (t, _), (f, _) in zip(times["transformers"], times["fastweights"])]
    rows = []
    for name in CANDIDATES:
        wall = [w for w, _ in times[name]]
        med = statistics.median(wall)
        rows.append(ModelRow(case, dtype, T, name, tokens, med, min(wall), max(wall),
                             statistics.median(c for _, c in times[name]), tokens / med,
                             statistics.median(ratios), min(ratios), max(ratios), repeats))
    return rows


def _layer_cases(dtype: torch.dtype, Ts: tuple[int, ...], hidden: int, repeats: int,
                 decode_calls: int) -> list[ModelRow]:
    from transformers import DynamicCache
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    config = _config(hidden, 4, 1024)
    torch.manual_seed(0)
    layers = _pair(Qwen3_5GatedDeltaNet(config, 0).to(dtype).eval())
    name = str(dtype).removeprefix("torch.")
    rows: list[ModelRow] = []
    gen = torch.Generator().manual_seed(0)
    for T in Ts:
        x = torch.randn(1, T, hidden, generator=gen).to(dtype)
        rows += _rows("layer prefill", name, T, T,
                      {n: (lambda m=m, x=x: m(x)) for n, m in layers.items()}, repeats)
    prompt = torch.randn(1, 64, hidden, generator=gen).to(dtype)
    token = torch.randn(1, 1, hidden, generator=gen).to(dtype)
    caches = {}
    with torch.no_grad():
        for n, m in layers.items():
            caches[n] = DynamicCache(config=config)
            m(prompt, cache=caches[n])

    def decode(m: torch.nn.Module, cache: Any) -> Callable[[], None]:
        def run() -> None:  # a step updates the cache in place: the state keeps evolving
            for _ in range(decode_calls):
                m(token, cache=cache)
        return run

    step_rows = _rows("layer decode", name, 1, decode_calls,
                      {n: decode(m, caches[n]) for n, m in layers.items()}, repeats)
    for r in step_rows:  # per token
        r.median_s, r.min_s, r.max_s, r.cpu_s = (v / decode_calls for v in
                                                 (r.median_s, r.min_s, r.max_s, r.cpu_s))
        r.tokens = 1
    return rows + step_rows


def _model_cases(dtype: torch.dtype, T: int, new_tokens: int, hidden: int, layers: int,
                 vocab: int, repeats: int) -> list[ModelRow]:
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = Qwen3_5ForCausalLM(_config(hidden, layers, vocab)).to(dtype).eval()
    models = _pair(model)
    name = str(dtype).removeprefix("torch.")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (1, T), generator=gen)
    prompt = ids[:, :8]
    kwargs = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False,
              "pad_token_id": 0}
    rows = _rows("model prefill", name, T, T,
                 {n: (lambda m=m: m(ids, use_cache=False)) for n, m in models.items()}, repeats)
    rows += _rows("model decode", name, 8, new_tokens,
                  {n: (lambda m=m: m.generate(prompt, **kwargs)) for n, m in models.items()},
                  repeats)
    return rows


def run_gated_delta_models(
    Ts: tuple[int, ...] = (1024, 4096), dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    hidden: int = 1024, layers: int = 4, vocab: int = 8192, model_T: int = 1024,
    new_tokens: int = 32, repeats: int = 5, decode_calls: int = 20, threads: int = 1,
    cases: tuple[str, ...] = ("layer", "model"),
) -> list[ModelRow]:
    """Time transformers' fallbacks and ``use_fastweights`` on the cases of the module
    docstring; one row per candidate and case."""
    for name, value in (("hidden", hidden), ("layers", layers), ("vocab", vocab),
                        ("model_T", model_T), ("new_tokens", new_tokens), ("repeats", repeats),
                        ("decode_calls", decode_calls), ("threads", threads)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not Ts or min(Ts) < 1:
        raise ValueError(f"T must be positive lengths, got {Ts}")
    unknown = [d for d in dtypes if d not in DTYPES] + [c for c in cases
                                                         if c not in ("layer", "model")]
    if unknown or not dtypes or not cases:
        raise ValueError(f"dtypes must be some of {list(DTYPES)} and cases some of "
                         f"['layer', 'model'], got {dtypes}, {cases}")
    prepare_cpu_memory_accounting()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    rows: list[ModelRow] = []
    try:
        with _fallbacks():
            for d in dtypes:
                if "layer" in cases:
                    rows += _layer_cases(DTYPES[d], Ts, hidden, repeats, decode_calls)
                if "model" in cases:
                    rows += _model_cases(DTYPES[d], model_T, new_tokens, hidden, layers, vocab,
                                         repeats)
    finally:
        torch.set_num_threads(before)
    return rows


def summary_table(rows: list[ModelRow]) -> list[str]:
    """Markdown lines: a row per case, both candidates side by side."""
    lines = ["| case | dtype | T | transformers fallback | fastweights | speed-up (paired, "
             "median [min, max]) | CPU time transformers / fastweights |",
             "|---|---|---:|---:|---:|---|---:|"]
    by = {(r.case, r.dtype, r.T, r.name): r for r in rows}
    for r in rows:
        if r.name != "fastweights":
            continue
        t = by[(r.case, r.dtype, r.T, "transformers")]

        def show(x: ModelRow) -> str:
            if x.case.startswith("model"):
                return f"{x.tokens_per_s:.4g} tok/s ({x.median_s * 1e3:.4g} ms)"
            unit = 1e6 if x.case == "layer decode" else 1e3
            return f"{x.median_s * unit:.4g} {'us' if unit == 1e6 else 'ms'}"

        lines.append(f"| {r.case} | {r.dtype} | {r.T} | {show(t)} | {show(r)} | "
                     f"{r.speedup:.2f}x [{r.speedup_min:.2f}, {r.speedup_max:.2f}] | "
                     f"{t.cpu_s / r.cpu_s:.2f}x |")
    return lines


def report_lines(rows: list[ModelRow], config: dict[str, Any]) -> list[str]:
    """The run's markdown lines: a head naming the layout, the machine and threads, then
    ``summary_table`` (``config``: the settings as given, with ``hidden``, ``threads`` and
    ``repeats``)."""
    head = (f"Qwen3.5 layout (16 key / 32 value heads of 128), hidden {config['hidden']}, B1; "
            f"{machine_line(machine())}; {config['threads']} thread(s); "
            f"{config['repeats']} interleaved rounds, wall-clock medians")
    return [head, "", *summary_table(rows)]


NAME = "gated-delta-models"
DESCRIPTION = ("Time transformers' Qwen3_5GatedDeltaNet layer at Qwen3.5's head layout (16 key / "
               "32 value heads of 128) on a T-token prefill and a one-token decode, and a "
               "random-weight Qwen3_5ForCausalLM's prefill and greedy-decode tokens/s, each with "
               "transformers' PyTorch fallbacks and after fastweights.hf.use_fastweights, in "
               "interleaved rounds on the CPU. Needs the [hf] extra (transformers). Prints the "
               "table; with --out writes its record (results.csv, results.md, meta.json, "
               "lscpu.txt) there.")
CASES = ("layer", "model")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--T", default="1024,4096", help="comma-separated layer prefill lengths")
    p.add_argument("--dtypes", default="float32,bfloat16",
                   help=f"comma-separated, some of {', '.join(DTYPES)}")
    p.add_argument("--cases", default=",".join(CASES),
                   help=f"comma-separated, some of {', '.join(CASES)}")
    p.add_argument("--hidden", type=positive_int, default=1024, help="hidden size")
    p.add_argument("--layers", type=positive_int, default=4,
                   help="model layers (every fourth full attention, as in Qwen3.5)")
    p.add_argument("--vocab", type=positive_int, default=8192, help="model vocabulary size")
    p.add_argument("--model-T", type=positive_int, default=1024, help="model prefill length")
    p.add_argument("--new-tokens", type=positive_int, default=32,
                   help="tokens the model decodes greedily after an 8-token prompt")
    p.add_argument("--repeats", type=positive_int, default=5, help="timed rounds")
    p.add_argument("--decode-calls", type=positive_int, default=20,
                   help="one-token layer calls per timed sample of the layer decode")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads")
    add_out_arguments(p)


def run(args: argparse.Namespace) -> int:
    Ts = parse_int_list("--T", args.T)
    dtypes = parse_name_list("--dtypes", args.dtypes, tuple(DTYPES))
    cases = parse_name_list("--cases", args.cases, CASES)
    rec = open_record(args, NAME)
    with user_errors((ValueError, ImportError)):
        rows = run_gated_delta_models(
            Ts=tuple(Ts), dtypes=dtypes, hidden=args.hidden, layers=args.layers,
            vocab=args.vocab, model_T=args.model_T, new_tokens=args.new_tokens,
            repeats=args.repeats, decode_calls=args.decode_calls, threads=args.threads,
            cases=cases)
    report(args, rec, rows, report_lines)
    return 0
