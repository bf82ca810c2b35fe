"""Decode memory and speed of a recurrent (delta) language model vs softmax attention.

``fastweights bench decode`` (``run_decode``) builds one ``LanguageModel`` per mixer (default: 4 layers,
d_model 256, 4 heads, float32), prefills a random context of each length (in pieces of
``--prefill-chunk`` tokens with the state carried, which equals one whole forward and bounds the
softmax score blocks), then decodes ``--new-tokens`` tokens one T = 1 step at a time, greedily
(``--decode-mode layer``, the default, through the model as configured: the chunked ops take the
recurrence for one-token calls; ``recurrent`` builds a copy in the token-by-token form of the
mixers that have one, same weights), and reports per (mixer, context):

- ``state_bytes``: bytes of every tensor of the carried state after the prefill, and its growth
  per decoded token (0 for recurrent mixers; the KV cache for softmax);
- ``decode_peak_rss_mib``: the peak memory the decode loop adds to what was resident before it
  (bench/measure.py's ``PeakMemory``, the benchmarks' one memory meter: the resident-set
  high-water mark on Linux), i.e. the memory decoding touches on top of the model and the
  prefilled state; ``rss_mib`` the process resident set after decoding;
- ``tokens_per_s``: decoded tokens per second of wall time (bench/measure.py's ``time_call``,
  the benchmarks' one timer, after one untimed warm-up step).

Everything runs in one process, one setting after another; results are printed as a Markdown
table and, with ``--out``, written as a record (bench/record.py: results.csv, results.md,
meta.json with the settings and machine, lscpu.txt).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
from typing import Any

import torch

from .. import state_tree
from .._commands import command_line, positive_int, recorded_settings
from ..models.config import LMConfig
from ..models.lm import LanguageModel
from ..models.registry import mixer_options
from .measure import PeakMemory, prepare_cpu_memory_accounting, resident_bytes, time_call
from .record import add_out_arguments, machine, machine_line, open_record
from .targets import check_model_mixers

MIB = 2 ** 20


@torch.no_grad()
def measure(mixer: str, context: int, *, d_model: int, n_layers: int, n_heads: int,
            vocab_size: int, new_tokens: int, prefill_chunk: int, seed: int,
            decode_mode: str = "layer") -> dict[str, Any]:
    """Prefill ``context`` random tokens, then decode ``new_tokens``; see the module docstring."""
    torch.manual_seed(seed)
    config = LMConfig(vocab_size=vocab_size, d_model=d_model, n_layers=n_layers,
                      n_heads=n_heads, mixer=mixer)
    model = LanguageModel(config).eval()
    if decode_mode == "recurrent" and "mode" in mixer_options(mixer):
        # Same weights, token-by-token form for the T = 1 steps (the chunked form pads a lone
        # token to a whole chunk).
        options = {"mode": "recurrent"}
        stepper = LanguageModel(dataclasses.replace(config, mixer_options=options)).eval()
        stepper.load_state_dict(model.state_dict())
    else:
        stepper = model
    ids = torch.randint(0, vocab_size, (1, context))
    cpu = torch.device("cpu")
    carried: dict[str, Any] = {"state": None}

    def prefill() -> None:
        for piece in ids.split(prefill_chunk, dim=1):
            carried["logits"], carried["state"] = model(piece, carried["state"])

    prefill_s = time_call(prefill, cpu)
    prefill_state = state_tree.nbytes(carried["state"])
    # warm-up step, untimed
    carried["logits"], carried["state"] = stepper(carried["logits"][:, -1:].argmax(-1),
                                                  carried["state"])
    gc.collect()

    def decode() -> None:
        for _ in range(new_tokens):
            token = carried["logits"][:, -1:].argmax(-1)
            carried["logits"], carried["state"] = stepper(token, carried["state"])

    with PeakMemory(cpu, enabled=prepare_cpu_memory_accounting()) as mem:
        decode_s = time_call(decode, cpu)
    state = carried["state"]
    decoded = new_tokens + 1
    return {
        "mixer": mixer, "context": context, "new_tokens": new_tokens, "decode_mode": decode_mode,
        "params": model.num_parameters(),
        "state_bytes_after_prefill": prefill_state,
        "state_bytes_per_new_token": (state_tree.nbytes(state) - prefill_state) / decoded,
        "decode_peak_rss_mib": None if mem.peak is None else mem.peak / MIB,
        "rss_mib": _resident_mib(),
        "prefill_s": prefill_s,
        "tokens_per_s": new_tokens / decode_s,
    }


def _resident_mib() -> float | None:
    """The process's resident set now, MiB (None where /proc is not there)."""
    try:
        return resident_bytes() / MIB
    except OSError:
        return None


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def run_decode(mixers: list[str], contexts: list[int], *, d_model: int = 256, n_layers: int = 4,
        n_heads: int = 4, vocab_size: int = 256, new_tokens: int = 64, prefill_chunk: int = 1024,
        seed: int = 0, decode_mode: str = "layer", lines: list[str] | None = None,
        ) -> list[dict[str, Any]]:
    """``measure`` for every (mixer, context), one after another in this process; prints a
    Markdown table row by row (its lines also appended to ``lines`` when given) and returns the
    rows."""
    lines = [] if lines is None else lines

    def say(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    header = ("mixer", "context", "state MiB", "state B/token", "decode peak RSS MiB",
              "RSS MiB", "prefill s", "tokens/s")
    say(f"{n_layers} layers, d_model {d_model}, {n_heads} heads, float32, batch 1, "
        f"{new_tokens} decoded tokens, decode mode {decode_mode}; {machine_line(machine())}")
    say("")
    say("| " + " | ".join(header) + " |")
    say("|" + "---|" * len(header))
    rows = []
    for mixer in mixers:
        for context in contexts:
            r = measure(mixer, context, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                        vocab_size=vocab_size, new_tokens=new_tokens,
                        prefill_chunk=prefill_chunk, seed=seed, decode_mode=decode_mode)
            rows.append(r)
            say("| " + " | ".join([
                mixer, str(context), _fmt(r["state_bytes_after_prefill"] / MIB, ".2f"),
                _fmt(r["state_bytes_per_new_token"], ".0f"), _fmt(r["decode_peak_rss_mib"], ".1f"),
                _fmt(r["rss_mib"], ".0f"), _fmt(r["prefill_s"], ".2f"), _fmt(r["tokens_per_s"], ".1f"),
            ]) + " |")
    return rows


NAME = "decode"
DESCRIPTION = ("Prefill a random context of each length, then decode one token per step: state "
               "bytes, their growth per token, the decode loop's peak resident memory and "
               "tokens/s, per mixer and context. Prints a table; --out writes its record "
               "(results.csv, results.md, meta.json, lscpu.txt).")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mixers", nargs="+", default=["delta", "softmax"])
    p.add_argument("--contexts", nargs="+", type=positive_int, default=[1024, 16384])
    p.add_argument("--d-model", type=positive_int, default=256)
    p.add_argument("--n-layers", type=positive_int, default=4)
    p.add_argument("--n-heads", type=positive_int, default=4)
    p.add_argument("--vocab-size", type=positive_int, default=256)
    p.add_argument("--new-tokens", type=positive_int, default=64)
    p.add_argument("--prefill-chunk", type=positive_int, default=1024)
    p.add_argument("--decode-mode", choices=["recurrent", "layer"], default="layer",
                   help="recurrent: T = 1 steps in the token-by-token form of mixers that have "
                        "one (same weights); layer: the mixers' configured form (chunk)")
    p.add_argument("--seed", type=int, default=0)
    add_out_arguments(p)


def run(args: argparse.Namespace) -> int:
    check_model_mixers("--mixers", args.mixers, vocab_size=args.vocab_size, d_model=args.d_model,
                       n_layers=args.n_layers, n_heads=args.n_heads)
    rec = open_record(args, NAME)
    lines: list[str] = []
    rows = run_decode(args.mixers, args.contexts, d_model=args.d_model, n_layers=args.n_layers,
                      n_heads=args.n_heads, vocab_size=args.vocab_size,
                      new_tokens=args.new_tokens, prefill_chunk=args.prefill_chunk,
                      seed=args.seed, decode_mode=args.decode_mode, lines=lines)
    if rec is not None:
        rec.write(rows, rec.meta(command_line(["fastweights", "bench", NAME], args),
                                 config=recorded_settings(args)), markdown=lines)
    return 0
