"""``python -m fastweights.bench.fwp_forms --autocast-bf16``: the float32 and CPU bfloat16
product rows side by side, with the CPU's capabilities in the header."""

from __future__ import annotations

import os

import pytest
import torch

from fastweights.bench.fwp_forms import main as forms
from fastweights.ops._autocast import CPU_BF16_ENV


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward+backward"])
def test_autocast_bf16_rows_next_to_float32(capsys, monkeypatch, backward):
    monkeypatch.setenv(CPU_BF16_ENV, "off")  # the bench forces "on" for its rows, then restores
    forms(["--T", "20", "--H", "1", "--D", "4", "--repeats", "2", "--chunk-sizes", "8",
           "--modes", "chunk,recurrent", "--autocast-bf16"] + (["--backward"] if backward else []))
    lines = capsys.readouterr().out.splitlines()
    assert os.environ[CPU_BF16_ENV] == "off"
    header = lines[1]
    assert f"torch CPU capability {torch.backends.cpu.get_cpu_capability()}" in header
    assert "fast bfloat16 (AMX-BF16/AVX512-BF16): " in header and "bfloat16 matmul" in header
    rows = {line.split("  ")[0].strip(): line for line in lines[2:]}
    for op in ("linear_attn", "delta_rule"):
        assert f"{op}[chunk C=8]" in rows and f"{op}[recurrent]" in rows
        bf16 = rows[f"{op}[chunk C=8] autocast-bf16"]
        assert " ms " in bf16
        if not backward:  # the product path ran: close to float32, not equal to it
            err = float(bf16.rsplit("= ", 1)[1])
            assert 0 < err < 0.05
    assert f"{'linear_attn'}[recurrent] autocast-bf16" not in rows  # chunked forms only
