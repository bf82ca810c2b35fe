"""`fastweights bench fla-decode` on its tiny shape: the rows it reports and their invariants
(recurrent state constant in the context, KV cache growing), with the context prefilled or
synthetic. No assertion depends on speed."""

from __future__ import annotations

import csv
import json

import pytest

pytest.importorskip("transformers", reason="the Llama baseline needs the [hf] extra")

import torch

from fastweights.bench import fla_decode
from fastweights.bench.fla_decode import SHAPES, build, synthetic_context
from fastweights.cli import main


@pytest.mark.parametrize("fill", ["prefill", "synthetic"])
def test_tiny_run_reports_state_and_speed(tmp_path, fill):
    out = tmp_path / "decode"
    assert main(["bench", "fla-decode", "--shapes", "tiny", "--contexts", "5", "40",
                 "--new-tokens", "3", "--prefill-chunk", "16", "--dtypes", "float32",
                 "--out", str(out), "--context-fill", fill]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["config"]["context_fill"] == fill and meta["machine"]["threads"] >= 1
    text = ("model", "shape", "dtype", "context_fill")
    with open(out / "results.csv") as f:  # the record (bench/record.py): numbers as text
        rows = [{k: v if k in text else (int(v) if v.isdigit() else float(v)) if v else None
                 for k, v in r.items()} for r in csv.DictReader(f)]
    assert all(r["context_fill"] == fill for r in rows)
    assert all((r["prefill_s"] is None) == (fill == "synthetic") for r in rows)
    assert [(r["model"], r["context"]) for r in rows] == [
        ("deltanet", 5), ("deltanet", 40), ("llama", 5), ("llama", 40)]
    by = {(r["model"], r["context"]): r for r in rows}
    d = SHAPES["tiny"]["hidden_size"]
    L = SHAPES["tiny"]["num_hidden_layers"]
    H = SHAPES["tiny"]["num_heads"]
    # DeltaNet: S [H, d/H, d/H] plus 3 convolutions keeping 3 inputs of d channels, per layer
    delta_bytes = L * 4 * (H * (d // H) ** 2 + 3 * 3 * d)
    for context in (5, 40):
        assert by[("deltanet", context)]["state_mib_after_prefill"] * 2 ** 20 == delta_bytes
        assert by[("deltanet", context)]["state_bytes_per_new_token"] == 0
        # Llama: keys and values of every position, every layer
        assert by[("llama", context)]["state_mib_after_prefill"] * 2 ** 20 == L * 2 * context * d * 4
        assert by[("llama", context)]["state_bytes_per_new_token"] == L * 2 * d * 4
    assert by[("deltanet", 5)]["params"] == by[("deltanet", 40)]["params"]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    # the function returns the rows the command writes
    again = fla_decode.run_fla_decode(["tiny"], ["deltanet"], ["float32"], [5], new_tokens=3,
                           prefill_chunk=16, fill=fill)
    assert [set(r) for r in again] == [set(by[("deltanet", 5)])]
    assert again[0]["state_mib_after_prefill"] == by[("deltanet", 5)]["state_mib_after_prefill"]


def test_bad_arguments_exit_2(capsys):
    assert main(["bench", "fla-decode", "--contexts", "0"]) == 2
    assert "--contexts" in capsys.readouterr().err


def test_synthetic_context_has_the_shapes_of_a_real_one():
    """The random state / KV cache has exactly the structure a prefill leaves, random values,
    and the models decode from it (Llama at position ``context``)."""
    g = torch.Generator().manual_seed(0)

    def tensors(model, state):
        if model == "llama":
            return [t for layer in state.layers for t in (layer.keys, layer.values)]
        return [t for layer in state for t in layer]

    for model in ("deltanet", "llama"):
        net, step, empty = build(model, "tiny", torch.bfloat16, 64)
        with torch.no_grad():
            _, real = step(torch.ones(1, 9, dtype=torch.long), empty)
            fake = synthetic_context(model, net, step, build(model, "tiny", torch.bfloat16, 64)[2],
                                     9, g)
            assert [(t.shape, t.dtype) for t in tensors(model, fake)] == \
                [(t.shape, t.dtype) for t in tensors(model, real)]
            assert all(t.abs().sum() > 0 for t in tensors(model, fake))
            if model == "llama":
                assert fake.get_seq_length() == 9
            logits, _ = step(torch.ones(1, 1, dtype=torch.long), fake)
            assert logits.shape == (1, 1, SHAPES["tiny"]["vocab_size"])
            assert torch.isfinite(logits).all()
