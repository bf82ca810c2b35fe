"""fastweights.bench.fla_decode on its tiny shape: the rows it reports and their invariants
(recurrent state constant in the context, KV cache growing). No assertion depends on speed."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers", reason="the Llama baseline needs the [hf] extra")

from fastweights.bench.fla_decode import SHAPES, main


def test_tiny_run_reports_state_and_speed(tmp_path):
    out = tmp_path / "decode.json"
    rows = main(["--shapes", "tiny", "--contexts", "5", "40", "--new-tokens", "3",
                 "--prefill-chunk", "16", "--dtypes", "float32", "--out", str(out)])
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
    assert json.loads(out.read_text())["results"] == rows


def test_bad_arguments_exit_2(capsys):
    with pytest.raises(SystemExit) as err:
        main(["--contexts", "0"])
    assert err.value.code == 2 and "--contexts" in capsys.readouterr().err
