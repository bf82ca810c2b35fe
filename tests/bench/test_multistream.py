"""The many-streams decoding benchmark runs end to end and builds the states it claims."""

from __future__ import annotations

import json

import torch

from fastweights.bench import multistream
from fastweights.bench.multistream import build_model, stream_lengths, synthetic_state
from fastweights.cli import main
from fastweights.layers.softmax import KVCacheRows
from fastweights.layers.transnormer import NormState


def test_stream_lengths_spread_below_the_context():
    assert stream_lengths(1024, 1) == [1024]
    lengths = stream_lengths(1024, 8)
    assert lengths[0] == 1024 and min(lengths) > 768 and len(set(lengths)) == 8


def test_synthetic_state_sets_every_position():
    """Softmax gets random caches of the streams' lengths (left-padded), NormAttention the
    streams' positions, the model's offsets too; the short prefill's places carry over."""
    lengths = [300, 250, 200]
    model = build_model("softmax", {}, d_model=16, n_layers=1, n_heads=2, vocab_size=11,
                        max_len=400, device=torch.device("cpu"))
    state = synthetic_state(model, lengths, torch.Generator().manual_seed(0), torch.device("cpu"))
    cache = state[0]
    assert isinstance(cache, KVCacheRows) and cache.k_cache.shape[:2] == (3, 300)
    assert cache.lengths.tolist() == lengths and cache.k_cache[2, :100].abs().max() == 0
    norm = build_model("norm", {}, d_model=16, n_layers=1, n_heads=2, vocab_size=11,
                       max_len=400, device=torch.device("cpu"))
    state = synthetic_state(norm, lengths, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert isinstance(state[0], NormState) and state[0].pos.tolist() == lengths


def test_multistream_bench_writes_results(tmp_path, capsys):
    assert main(["bench", "multistream", "--mixers", "ttt-linear", "--streams", "1,2",
                 "--contexts", "70", "--compile", "none", "--d-model", "16", "--n-heads", "2",
                 "--n-layers", "1", "--steps", "1", "--warmup", "0", "--out",
                 str(tmp_path / "cli")]) == 0
    assert "| ttt-linear |" in (tmp_path / "cli" / "results.md").read_text()
    command = json.loads((tmp_path / "cli" / "meta.json").read_text())["command"]
    assert command.startswith("fastweights bench multistream --mixers ttt-linear --streams 1,2")
    assert main(["bench", "multistream", "--mixers", "ttt-linear", "--out",
                 str(tmp_path / "cli")]) == 2  # results there already, no --overwrite
    assert "--overwrite" in capsys.readouterr().err
    lib = tmp_path / "lib"
    rows = multistream.run_multistream([("ttt-linear", "ttt-linear", {})], [1, 2], [70], lib,
                           modes=("eager",), d_model=16, n_heads=2, n_layers=1, steps=1,
                           warmup=0, command="fastweights bench multistream --streams 1,2")
    assert [(r.mixer, r.streams, r.status) for r in rows] == [
        ("softmax", 1, "ok"), ("softmax", 2, "ok"), ("ttt-linear", 1, "ok"),
        ("ttt-linear", 2, "ok")]
    assert all(r.tokens_per_s > 0 and r.state_mib_per_stream > 0 for r in rows)
    meta = json.loads((lib / "meta.json").read_text())
    assert "--streams 1,2" in meta["command"] and "cpu_isa" in meta["machine"]
    table = (lib / "results.md").read_text()
    assert "| ttt-linear |" in table and "c=70 N=2" in table
    assert (lib / "results.csv").read_text().count("\n") == 5
