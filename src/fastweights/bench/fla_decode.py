"""CPU decoding of fla's DeltaNet (on fastweights' ops) against a transformers Llama of the same shape.

``fastweights bench fla-decode`` builds, for each shape (``340M``: fla's flame config
delta_net_340M, hidden 1024, 8 heads, 24 layers; ``1.3B``: fla-hub's delta_net-1.3B, hidden
2048, 16 heads, 24 layers; vocabulary 32000, untied, SwiGLU width by fla's rule) and each dtype,
two models with random weights:

- ``deltanet``: ``fastweights.fla.FlaDeltaNetLM`` (fla's DeltaNetForCausalLM: short
  convolutions, L2-normalised SiLU q/k, sigmoid beta, output RMSNorm), decoding from its
  recurrent state;
- ``llama``: ``transformers.LlamaForCausalLM`` with the same hidden size, heads (as many KV
  heads), layers, MLP width and vocabulary, decoding from its ``DynamicCache`` (KV cache).

For each context length it puts the model in the state of having read that many tokens, then
decodes ``--new-tokens`` tokens greedily one at a time, and reports the parameter bytes, the
bytes of recurrent state / KV cache after the context and its growth per decoded token, the
resident-set high-water mark of the decode loop above what was resident before it, the process
RSS, prefill seconds and decoded tokens per second (after one untimed warm-up step). One process,
one setting after another, batch 1; ``--threads`` sets torch's intra-op threads. Results print as
a Markdown table and, with ``--out``, are written as a record (bench/record.py: results.csv,
results.md, meta.json with the settings and machine, lscpu.txt). ``--shapes tiny`` (hidden 64,
2 layers, vocabulary 1000) checks the command in seconds.

``--context-fill`` says how the context is put in place:

- ``synthetic`` (the default, at every length): the state a context leaves, filled with random
  values of the right shapes and dtypes, without running the prefill (a real 16k-token prefill
  takes far longer on a CPU than the decoding measured): DeltaNet's delta-rule matrices
  (float32) and short-convolution inputs (the model dtype), the same for any context length;
  Llama's ``DynamicCache`` with random keys and values of ``context`` positions in every layer.
  A decoding step's work and memory depend on these shapes, not on the values, so tokens/s and
  memory are those of decoding after a real context of that length; prefill seconds are not
  reported. The first decoded token is a random id.
- ``prefill``: random tokens fed in pieces of ``--prefill-chunk`` (the state or cache carried;
  equal to one whole forward), timed, and decoding continues from the last logits.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
from typing import Any

import torch

from .. import state_tree
from .._commands import UserError, command_line, positive_int, recorded_settings
from ..fla import FlaDeltaNetConfig, FlaDeltaNetLM
from .decode import MIB, _fmt, _resident_mib
from .measure import PeakMemory, prepare_cpu_memory_accounting, time_call
from .record import add_out_arguments, machine, machine_line, open_record

SHAPES: dict[str, dict[str, int]] = {
    "340M": {"hidden_size": 1024, "num_heads": 8, "num_hidden_layers": 24, "vocab_size": 32000},
    "1.3B": {"hidden_size": 2048, "num_heads": 16, "num_hidden_layers": 24, "vocab_size": 32000},
    "tiny": {"hidden_size": 64, "num_heads": 4, "num_hidden_layers": 2, "vocab_size": 1000},
}
MODELS = ("deltanet", "llama")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FILLS = ("synthetic", "prefill")
SYNTHETIC_STD = 0.1


class _LlamaStepper:
    """``(logits, cache) = step(ids, cache)`` for a transformers causal LM with a DynamicCache."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __call__(self, ids: torch.Tensor, cache: Any) -> tuple[torch.Tensor, Any]:
        from ..hf import CACHE_FIELD  # the installed transformers' name for the cache

        out = self.model(input_ids=ids, use_cache=True, **{CACHE_FIELD: cache})
        return out.logits, out[CACHE_FIELD]


def _cache_bytes(cache: Any) -> int:
    """Bytes of a recurrent state (nested tuples) or of a transformers cache's keys and values."""
    if hasattr(cache, "layers"):
        return sum(state_tree.nbytes((layer.keys, layer.values)) for layer in cache.layers)
    return state_tree.nbytes(cache)


def _random_like(state: Any, generator: torch.Generator) -> Any:
    """``state`` (a tensor or nested tuples/lists of them) with every floating tensor replaced by
    random values of the same shape and dtype (normal, std ``SYNTHETIC_STD``)."""
    def draw(t: torch.Tensor) -> torch.Tensor:
        if not t.dtype.is_floating_point:
            return t
        return (SYNTHETIC_STD * torch.randn(t.shape, generator=generator)).to(t.dtype)

    return state_tree.map_tensors(draw, state)


def synthetic_context(model: str, net: torch.nn.Module, step: Any, state: Any, context: int,
                      generator: torch.Generator) -> Any:
    """The state ``model`` holds after ``context`` tokens, with random values (see the module
    docstring): for "deltanet" the recurrent state (its structure taken from one step, which a
    context of any length leaves the same), for "llama" ``state`` (an empty DynamicCache)
    filled with ``context`` random keys and values per layer."""
    if model == "deltanet":
        _, fresh = step(torch.zeros(1, 1, dtype=torch.long), None)
        return _random_like(fresh, generator)
    cfg = net.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    dtype = next(net.parameters()).dtype
    for layer in range(cfg.num_hidden_layers):
        k, v = (SYNTHETIC_STD * torch.randn(1, cfg.num_key_value_heads, context, head_dim,
                                            generator=generator) for _ in range(2))
        state.update(k.to(dtype), v.to(dtype), layer)
    return state


def build(model: str, shape: str, dtype: torch.dtype, max_len: int, seed: int = 0
          ) -> tuple[torch.nn.Module, Any, Any]:
    """(module, step function ``(ids, state) -> (logits, state)``, empty state) of ``model``
    ("deltanet" or "llama") at ``shape`` with random weights in ``dtype``."""
    torch.manual_seed(seed)
    config = FlaDeltaNetConfig(**SHAPES[shape], tie_word_embeddings=False)
    if model == "deltanet":
        net = FlaDeltaNetLM(config).to(dtype).eval()
        return net, net, None
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

    llama_config = LlamaConfig(
        hidden_size=config.hidden_size, intermediate_size=config.mlp_hidden_size(),
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_heads,
        num_hidden_layers=config.num_hidden_layers, vocab_size=config.vocab_size,
        max_position_embeddings=max_len, rms_norm_eps=config.norm_eps,
        tie_word_embeddings=False)
    net = LlamaForCausalLM(llama_config).to(dtype).eval()
    return net, _LlamaStepper(net), DynamicCache(config=llama_config)


@torch.no_grad()
def measure(model: str, shape: str, dtype: str, context: int, *, new_tokens: int,
            prefill_chunk: int, seed: int = 0, fill: str = "synthetic") -> dict[str, Any]:
    """Put ``context`` tokens in place (``fill``: "synthetic" or "prefill"), then decode
    ``new_tokens``; see the module docstring."""
    if fill not in FILLS:
        raise ValueError(f"fill must be one of {FILLS}, got {fill!r}")
    net, step, state = build(model, shape, DTYPES[dtype], context + new_tokens + 1, seed)
    params = sum(p.numel() for p in net.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in net.parameters())
    vocab = SHAPES[shape]["vocab_size"]
    generator = torch.Generator().manual_seed(seed)
    prefill_s = None
    cpu = torch.device("cpu")
    carried: dict[str, Any] = {"state": state}
    if fill == "prefill":
        ids = torch.randint(0, vocab, (1, context), generator=generator)

        def prefill() -> None:
            for piece in ids.split(prefill_chunk, dim=1):
                carried["logits"], carried["state"] = step(piece, carried["state"])

        prefill_s = time_call(prefill, cpu)
        state = carried["state"]
        first = carried["logits"][:, -1:].argmax(-1)
    else:
        state = synthetic_context(model, net, step, state, context, generator)
        first = torch.randint(0, vocab, (1, 1), generator=generator)
    prefill_state = _cache_bytes(state)

    carried["logits"], carried["state"] = step(first, state)  # warm-up step, untimed
    gc.collect()

    def decode() -> None:
        for _ in range(new_tokens):
            carried["logits"], carried["state"] = step(carried["logits"][:, -1:].argmax(-1),
                                                       carried["state"])

    with PeakMemory(cpu, enabled=prepare_cpu_memory_accounting()) as mem:
        decode_s = time_call(decode, cpu)
    logits, state = carried["logits"], carried["state"]
    result = {
        "model": model, "shape": shape, "dtype": dtype, "context": context, "context_fill": fill,
        "new_tokens": new_tokens, "params": params, "param_mib": param_bytes / MIB,
        "state_mib_after_prefill": prefill_state / MIB,
        "state_bytes_per_new_token": (_cache_bytes(state) - prefill_state) / (new_tokens + 1),
        "decode_peak_rss_mib": None if mem.peak is None else mem.peak / MIB,
        "rss_mib": _resident_mib(),
        "prefill_s": prefill_s, "tokens_per_s": new_tokens / decode_s,
    }
    carried.clear()  # (the closures above keep step alive until measure returns)
    del net, state, logits
    gc.collect()
    return result


HEADER = ("model", "shape", "dtype", "context", "fill", "params (M)", "weights MiB", "state MiB",
          "state B/token", "decode peak RSS MiB", "RSS MiB", "prefill s", "tokens/s")


def _row(r: dict[str, Any]) -> str:
    return "| " + " | ".join([
        r["model"], r["shape"], r["dtype"], str(r["context"]), r["context_fill"],
        _fmt(r["params"] / 1e6, ".1f"),
        _fmt(r["param_mib"], ".0f"), _fmt(r["state_mib_after_prefill"], ".2f"),
        _fmt(r["state_bytes_per_new_token"], ".0f"), _fmt(r["decode_peak_rss_mib"], ".1f"),
        _fmt(r["rss_mib"], ".0f"), _fmt(r["prefill_s"], ".1f"), _fmt(r["tokens_per_s"], ".2f"),
    ]) + " |"


def run_fla_decode(shapes: list[str], models: list[str], dtypes: list[str], contexts: list[int], *,
        new_tokens: int = 32, prefill_chunk: int = 1024, seed: int = 0,
        fill: str = "synthetic", lines: list[str] | None = None) -> list[dict[str, Any]]:
    """``measure`` for every (shape, dtype, model, context), one after another in this process;
    prints a Markdown table row by row (its lines also appended to ``lines`` when given) and
    returns the rows."""
    lines = [] if lines is None else lines

    def say(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    how = (f"prefill in pieces of {prefill_chunk}" if fill == "prefill"
           else "synthetic context (random state / KV cache, no prefill)")
    say(f"Batch 1, {new_tokens} decoded tokens, {how}; {machine_line(machine())}")
    say("")
    say("| " + " | ".join(HEADER) + " |")
    say("|" + "---|" * len(HEADER))
    rows = []
    # The objects alive now (imported libraries) are set aside from the collector: the full
    # collections between settings then cost milliseconds instead of a pass over every module.
    gc.freeze()
    try:
        for shape in shapes:
            for dtype in dtypes:
                for model in models:
                    for context in contexts:
                        r = measure(model, shape, dtype, context, new_tokens=new_tokens,
                                    prefill_chunk=prefill_chunk, seed=seed, fill=fill)
                        rows.append(r)
                        say(_row(r))
    finally:
        gc.unfreeze()
    return rows


NAME = "fla-decode"
DESCRIPTION = ("Decode with random-weight DeltaNet (fla's 340M / 1.3B shapes) and Llama models "
               "after a context of each length (synthetic state / KV cache, or a real prefill): "
               "state bytes, decode memory and tokens/s. Prints a Markdown table; --out writes its "
               "record (results.csv, results.md, meta.json, lscpu.txt). --shapes tiny checks "
               "the command in seconds.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["340M", "1.3B"])
    p.add_argument("--models", nargs="+", choices=MODELS,
                   default=list(MODELS))
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES),
                   default=list(DTYPES))
    p.add_argument("--contexts", nargs="+", type=positive_int, default=[1024, 16384])
    p.add_argument("--new-tokens", type=positive_int, default=32)
    p.add_argument("--context-fill", choices=FILLS, default="synthetic",
                   help="synthetic: random state/KV cache of the context's shapes, no prefill "
                        "(default); prefill: run the context through the model first")
    p.add_argument("--prefill-chunk", type=positive_int, default=1024,
                   help="tokens per forward of the prefill (--context-fill prefill)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=0)
    add_out_arguments(p)


def run(args: argparse.Namespace) -> int:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if "llama" in args.models and importlib.util.find_spec("transformers") is None:
        raise UserError("--models llama needs transformers (pip install 'fastweights[hf]')")
    rec = open_record(args, NAME)
    lines: list[str] = []
    rows = run_fla_decode(args.shapes, args.models, args.dtypes, args.contexts,
                          new_tokens=args.new_tokens, prefill_chunk=args.prefill_chunk,
                          seed=args.seed, fill=args.context_fill, lines=lines)
    if rec is not None:
        rec.write(rows, rec.meta(command_line(["fastweights", "bench", NAME], args),
                                 config=recorded_settings(args)), markdown=lines)
    return 0
