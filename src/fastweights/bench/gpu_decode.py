"""``fastweights bench gpu``, section ``decode``: per mixer, a language model's one-token decoding
step token by token (eager) against the same step captured once as a CUDA graph and replayed
(``fastweights.models.graph.DecodeGraph``, what ``generate`` runs on CUDA; docs/design.md,
"Decoding graphs"), after a prefill of the context, at batch 1 and 16.

Each timed call decodes ``tokens`` tokens; the rows give milliseconds per token. Eager calls
start every time from the prefilled state (a state is a value); the graph's calls continue in
its buffers, which hold the context and every token the run decodes. A mixer without a static
form (AFT-full) has a ``graph`` row that says so. In a dry run (CPU, tiny sizes) the graph pass
runs the same static buffers without capture, so the code path is exercised; its figures mean
nothing. bench/gpu.py plans and records the rows (``decode_items``, ``decode_markdown``).

Dimension legend: B batch, T context, d d_model, H heads, L layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ..models import LanguageModel, LMConfig
from ..models.graph import WARMUP_STEPS, DecodeGraph
from ..models.registry import mixer_options

__all__ = ["DRY_DECODE", "GPU_DECODE", "DecodeSizes", "decode_case", "decode_items",
           "decode_markdown"]


@dataclasses.dataclass(frozen=True)
class DecodeSizes:
    """The decode section's shapes."""

    batches: tuple[int, ...]
    context: int  # T, prefilled in pieces of ``prefill_chunk`` tokens
    d_model: int
    heads: int
    layers: int
    tokens: int  # decoded per timed call
    prefill_chunk: int


GPU_DECODE = DecodeSizes(batches=(1, 16), context=4096, d_model=1024, heads=8, layers=8,
                         tokens=32, prefill_chunk=1024)
DRY_DECODE = DecodeSizes(batches=(1, 2), context=16, d_model=32, heads=2, layers=2, tokens=2,
                         prefill_chunk=8)

Timed = Callable[[Any, Callable[[], Any]], dict[str, Any]]


def decode_items(run: Any, sizes: DecodeSizes, timed: Timed,
                 item: Callable[..., Any]) -> list[Callable[[], None]]:
    """The section's items, one per (batch, mixer) of ``run.mixers`` (bench/gpu.py's ``Run``;
    ``timed`` and ``item`` its timer and its failure guard)."""
    return [lambda n=n, B=B: decode_case(run, n, B, sizes, timed, item)
            for B in sizes.batches for n in run.mixers]


def decode_case(run: Any, name: str, B: int, sizes: DecodeSizes, timed: Timed,
                item: Callable[..., Any]) -> None:
    """The ``eager`` and ``graph`` rows of one mixer at batch B: ms per decoded token."""
    T, d, H, L, n = sizes.context, sizes.d_model, sizes.heads, sizes.layers, sizes.tokens
    capture = run.device.type == "cuda"
    fields = {"section": "decode", "name": name, "dtype": "bfloat16",
              "shape": f"B{B} T{T} d{d} H{H} L{L}"}
    # The graph's buffers hold every token the run decodes: the first call, the warm-up, the
    # timed calls, and the capture's warm-up steps.
    max_len = T + n * (run.sizes.repeats + 2) + WARMUP_STEPS + 1
    if not run.may_start(**fields, backend="eager", **{"pass": "eager"}):
        return
    with item(run, **fields, backend="eager", **{"pass": "prefill"}), torch.no_grad():
        options = {"max_len": max_len} if "max_len" in mixer_options(name) else {}
        torch.manual_seed(0)
        model = LanguageModel(LMConfig(vocab_size=256, d_model=d, n_layers=L, n_heads=H,
                                       mixer=name, mixer_options=options))
        model = model.to(device=run.device, dtype=torch.bfloat16).eval()
        gen = torch.Generator(device=run.device).manual_seed(0)
        ids = torch.randint(0, 256, (B, T + 1), device=run.device, generator=gen)
        state = None
        for start in range(0, T, sizes.prefill_chunk):
            _, state = model(ids[:, start:min(start + sizes.prefill_chunk, T)], state)
        nxt = ids[:, T:T + 1]

        def eager() -> None:
            s = state
            for _ in range(n):
                _, s = model(nxt, s)  # as generate decodes without a graph

        row = timed(run, eager)
        run.row(**fields, backend="eager", **{"pass": "eager"}, **_per_token(row, n))
        if not run.may_start(**fields, backend="graph", **{"pass": "graph"}):
            return
        how = "graph" if capture else "static buffers (no capture: CPU)"
        try:
            graph = DecodeGraph(model, state, nxt, max_len, capture=capture)
        except (TypeError, ValueError) as err:
            run.row(**fields, backend=how, **{"pass": "graph"}, status=f"skipped: {err}")
            return

        def replayed() -> None:
            for _ in range(n):
                graph(nxt)

        row = timed(run, replayed)
        run.row(**fields, backend=how, **{"pass": "graph"}, **_per_token(row, n))


def _per_token(row: dict[str, Any], tokens: int) -> dict[str, Any]:
    return row | {k: row[k] / tokens for k in ("median_ms", "min_ms", "max_ms")}


def decode_markdown(rows: list[dict[str, Any]], cell: Callable[..., str]) -> list[str]:
    """The section's table in results.md: ms per token eager and graph, and their ratio."""
    by: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for r in rows:
        if r["section"] == "decode":
            by.setdefault((r["shape"], r["name"]), {})[r["pass"]] = r
    if not by:
        return []
    lines = ["## Decoding step, bfloat16: eager against one CUDA graph", "",
             "| shape | mixer | eager ms/token | graph ms/token | eager / graph | status |",
             "|---|---|---|---|---|---|"]
    for (shape, name), passes in by.items():
        eager, graph = passes.get("eager", {}), passes.get("graph", {})
        e, g = eager.get("median_ms", ""), graph.get("median_ms", "")
        ratio = e / g if e != "" and g != "" and g else ""
        status = "; ".join(sorted({r["status"] for r in passes.values() if r["status"] != "ok"}))
        lines.append(f"| {shape} | {name} | {cell(e)} | {cell(g)} | {cell(ratio, '.2f')} | "
                     f"{status or 'ok'} |")
    return [*lines, ""]
