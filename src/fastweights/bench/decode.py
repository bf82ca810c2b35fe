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
- ``decode_peak_rss_mib``: the resident-set high-water mark during the decode loop above what
  was resident before it (Linux: reset with ``/proc/self/clear_refs``, read ``VmHWM``; glibc is
  told to return freed blocks above 64 KiB), i.e. the memory decoding touches on top of the model
  and the prefilled state; ``rss_mib`` the process resident set after decoding;
- ``tokens_per_s``: decoded tokens per second of wall time (``time.perf_counter``, after one
  untimed warm-up step).

Everything runs in one process, one setting after another; results are printed as a table and
written as JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import json
import platform
import re
import time
from pathlib import Path
from typing import Any

import torch

from .. import state_tree
from .._commands import positive_int, recorded_settings
from ..models.config import LMConfig
from ..models.lm import LanguageModel
from ..models.registry import mixer_options
from .targets import check_model_mixers

MIB = 2 ** 20


def _status_kib(field: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    match = re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) if match else None


def _return_freed_memory() -> None:
    """Make glibc give every freed block above 64 KiB back to the kernel (M_MMAP_THRESHOLD), so
    the resident set shows what decoding allocates instead of a heap that only grows."""
    # Not glibc: RSS figures then include the allocator's cached blocks.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)


def _reset_rss_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
    except OSError:
        return False
    return True


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
    state = None
    t0 = time.perf_counter()
    for piece in ids.split(prefill_chunk, dim=1):
        logits, state = model(piece, state)
    prefill_s = time.perf_counter() - t0
    prefill_state = state_tree.nbytes(state)

    token = logits[:, -1:].argmax(-1)
    logits, state = stepper(token, state)  # warm-up step, untimed
    gc.collect()
    rss_before = _status_kib("VmRSS")
    tracked = _reset_rss_peak() and rss_before is not None
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        token = logits[:, -1:].argmax(-1)
        logits, state = stepper(token, state)
    decode_s = time.perf_counter() - t0
    hwm = _status_kib("VmHWM")
    rss_after = _status_kib("VmRSS")
    decoded = new_tokens + 1
    return {
        "mixer": mixer, "context": context, "new_tokens": new_tokens, "decode_mode": decode_mode,
        "params": model.num_parameters(),
        "state_bytes_after_prefill": prefill_state,
        "state_bytes_per_new_token": (state_tree.nbytes(state) - prefill_state) / decoded,
        "decode_peak_rss_mib": (hwm - rss_before) / 1024 if tracked and hwm else None,
        "rss_mib": rss_after / 1024 if rss_after else None,
        "prefill_s": prefill_s,
        "tokens_per_s": new_tokens / decode_s,
    }


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def run_decode(mixers: list[str], contexts: list[int], *, d_model: int = 256, n_layers: int = 4,
        n_heads: int = 4, vocab_size: int = 256, new_tokens: int = 64, prefill_chunk: int = 1024,
        seed: int = 0, decode_mode: str = "layer") -> list[dict[str, Any]]:
    """``measure`` for every (mixer, context), one after another in this process; prints a
    table row by row and returns the rows."""
    _return_freed_memory()
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {n_layers} layers, d_model {d_model}, "
          f"{n_heads} heads, float32, batch 1, {new_tokens} decoded tokens, "
          f"decode mode {decode_mode}")
    header = ("mixer", "context", "state MiB", "state B/token", "decode peak RSS MiB",
              "RSS MiB", "prefill s", "tokens/s")
    print(" | ".join(header))
    rows = []
    for mixer in mixers:
        for context in contexts:
            r = measure(mixer, context, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                        vocab_size=vocab_size, new_tokens=new_tokens,
                        prefill_chunk=prefill_chunk, seed=seed, decode_mode=decode_mode)
            rows.append(r)
            print(" | ".join([
                mixer, str(context), _fmt(r["state_bytes_after_prefill"] / MIB, ".2f"),
                _fmt(r["state_bytes_per_new_token"], ".0f"), _fmt(r["decode_peak_rss_mib"], ".1f"),
                _fmt(r["rss_mib"], ".0f"), _fmt(r["prefill_s"], ".2f"), _fmt(r["tokens_per_s"], ".1f"),
            ]), flush=True)
    return rows


NAME = "decode"
DESCRIPTION = ("Prefill a random context of each length, then decode one token per step: state "
               "bytes, their growth per token, the decode loop's peak resident memory and "
               "tokens/s, per mixer and context. Prints a table; --out writes JSON.")


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
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")


def run(args: argparse.Namespace) -> int:
    check_model_mixers("--mixers", args.mixers, vocab_size=args.vocab_size, d_model=args.d_model,
                       n_layers=args.n_layers, n_heads=args.n_heads)
    rows = run_decode(args.mixers, args.contexts, d_model=args.d_model, n_layers=args.n_layers,
                      n_heads=args.n_heads, vocab_size=args.vocab_size,
                      new_tokens=args.new_tokens, prefill_chunk=args.prefill_chunk,
                      seed=args.seed, decode_mode=args.decode_mode)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": recorded_settings(args),
                                        "torch": torch.__version__, "results": rows}, indent=2))
    return 0
