"""fastweights bench --peers and the CPU description in meta.json / results.md.

Correctness only: no assertion depends on which side is faster.
"""

from __future__ import annotations

import csv
import importlib.util
import json

from fastweights.bench import peers
from fastweights.bench.suite import cpu_info
from fastweights.cli import main

HAVE_FLA = importlib.util.find_spec("fla") is not None
TINY = ["bench", "--mixers", "none", "--peers", "--d-model", "32", "--n-heads", "2",
        "--repeats", "1", "--no-progress"]

INTEL = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse sse2 ssse3 sse4_2 avx f16c avx2 fma bmi2 avx512f avx512bw avx512_bf16 \
avx512_vnni amx_tile amx_bf16 amx_int8 avx_vnni
processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse avx
"""


def test_cpu_info_reads_model_and_vector_flags():
    info = cpu_info(INTEL)
    assert info["model"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert info["isa"] == ["amx_bf16", "amx_int8", "amx_tile", "avx", "avx2", "avx512_bf16",
                           "avx512_vnni", "avx512bw", "avx512f", "avx_vnni", "f16c", "fma"]
    assert cpu_info("") == {"model": None, "isa": []}


def test_peers_written_with_cpu_description(tmp_path):
    out = tmp_path / "res"
    assert main([*TINY, "--lengths", "64", "--out", str(out)]) == 0
    with open(out / "peers.csv") as f:
        rows = list(csv.DictReader(f))
    by_op = {r["op"]: r for r in rows}
    expected = {"softmax_attention"} | ({"linear_attn", "delta_rule", "decay_linear_attn",
                                         "ttt_linear"} if HAVE_FLA else set())
    assert set(by_op) == expected
    for r in rows:
        assert r["status"] == "ok" and float(r["ours_s"]) > 0 and float(r["peer_s"]) > 0
        ratio = float(r["peer_s"]) / float(r["ours_s"])
        assert abs(float(r["ratio"]) - ratio) <= 1e-3 * ratio
    md = (out / "results.md").read_text()
    assert "## Peers" in md and "torch.sdpa" in md and "- machine: CPU " in md
    meta = json.loads((out / "meta.json").read_text())
    assert isinstance(meta["machine"]["cpu_isa"], list) and "--peers" in meta["command"]
    assert meta["machine"]["cpu_isa"] == cpu_info()["isa"]


def test_missing_peer_is_listed_not_timed(monkeypatch):
    monkeypatch.setattr(peers, "_fla", lambda module: None)
    rows, missing = peers.run_peers([16], B=1, H=2, D=8, repeats=1, time_budget=4.0)
    assert [(r.op, r.peer, r.status) for r in rows] == [("softmax_attention", "torch.sdpa", "ok")]
    assert len(missing) == 4 and all("not installed" in why for why in missing.values())
    assert "not installed" in "\n".join(peers.peer_table(rows, missing))


def test_length_a_peer_cannot_take_is_skipped_with_reason():
    rows, _ = peers.run_peers([40], B=1, H=2, D=8, repeats=1, time_budget=4.0)
    status = {r.op: r.status for r in rows}
    assert status["softmax_attention"] == "ok"
    if HAVE_FLA:
        assert status["linear_attn"] == "skipped: the peer needs T to be a multiple of 64"
        assert status["delta_rule"] == "skipped: the peer needs T to be a multiple of 32"
        assert status["decay_linear_attn"] == "ok" and status["ttt_linear"] == "ok"
